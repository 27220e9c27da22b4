"""The server's app (`build_app`) served in process (with the real AsyncLLMEngine, or the
FakeEngine of fake_engine.py).

`InProcessApp` talks to the app through httpx's ASGITransport, with the same methods as the
real-process `Server` of conftest.py (`post`, `get`, `tokenize`, `client()` for the official
openai client, ...), so that a test reads the same against either. The app and its engine live
on one event loop in a thread (`AppLoop`): the real AsyncLLMEngine's methods must all be
called from one loop.
"""

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import openai

from pagedserve.entrypoints.openai.api_server import build_app

BASE_URL = "http://test"
LEAVE_TIMEOUT_S = 30.0


class AppLoop:
    """An event loop running in a daemon thread; `run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


class LoopTransport(httpx.BaseTransport):
    """A synchronous httpx transport that sends each request through an ASGITransport on
    `loop`: sync clients (httpx.Client, openai.OpenAI) can talk to the in-process app."""

    def __init__(self, loop: AppLoop, app: Any) -> None:
        self.loop = loop
        # The app's own 500 response, not the exception, as a real server answers.
        self.asgi = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        content = request.read()

        async def send() -> tuple[int, httpx.Headers, bytes]:
            forwarded = httpx.Request(
                request.method, request.url, headers=request.headers, content=content
            )
            response = await self.asgi.handle_async_request(forwarded)
            return response.status_code, response.headers, await response.aread()

        status, headers, body = self.loop.run(send())
        return httpx.Response(status, headers=headers, content=body, request=request)


class ServerCalls:
    """The calls that the real-process `Server` and InProcessApp share (given `post`)."""

    model: str
    api_key: str | None

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        raise NotImplementedError("each subclass sends requests its own way")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def tokenize(self, **body: Any) -> list[int]:
        response = self.post("/tokenize", {"model": self.model, **body})
        assert response.status_code == 200, response.text
        tokens: list[int] = response.json()["tokens"]
        return tokens

    def detokenize(self, tokens: list[int]) -> str:
        response = self.post("/detokenize", {"tokens": tokens})
        assert response.status_code == 200, response.text
        text: str = response.json()["prompt"]
        return text


class InProcessApp(ServerCalls):
    """`build_app(engine, [model], **app_kwargs)` and ways to talk to it, as `Server` has."""

    def __init__(
        self, loop: AppLoop, engine: Any, model: str, api_key: str | None = None, **app_kwargs: Any
    ) -> None:
        self.loop = loop
        self.engine = engine
        self.model = model
        self.api_key = api_key
        self.url = BASE_URL
        self.app = build_app(engine, [model], api_key=api_key, **app_kwargs)
        self.http = httpx.Client(
            transport=LoopTransport(loop, self.app), base_url=BASE_URL, timeout=60.0
        )

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return self.loop.run(coroutine, timeout)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The official openai client (sync), over ASGITransport on the app's loop."""
        return openai.OpenAI(
            base_url=f"{BASE_URL}/v1", api_key=kwargs.pop("api_key", self.api_key or "none"),
            max_retries=0, http_client=self.http, **kwargs,
        )  # fmt: skip

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """openai.AsyncOpenAI over httpx.ASGITransport; use it in coroutines given to `run`."""
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        return openai.AsyncOpenAI(
            base_url=f"{BASE_URL}/v1", api_key=self.api_key or "none", max_retries=0,
            http_client=httpx.AsyncClient(transport=transport, timeout=60.0), **kwargs,
        )  # fmt: skip

    def async_http(self) -> httpx.AsyncClient:
        """An httpx.AsyncClient over ASGITransport (with the API key); use it in coroutines
        given to `run`, for requests that must overlap."""
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        return httpx.AsyncClient(
            transport=transport, base_url=BASE_URL, headers=self.headers, timeout=60.0
        )

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("headers", self.headers)
        return self.http.request(method, path, **kwargs)

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return self.request("POST", path, json=body, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", path, **kwargs)

    def stream_events(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST with `stream: true`; the SSE events (JSON objects, then "[DONE]")."""
        response = self.post(path, {**body, "stream": True})
        assert response.status_code == 200, response.text
        return parse_sse(response.text)

    def call_and_leave(
        self, path: str, body: Any, leave_when: Callable[[list[str]], bool]
    ) -> list[str]:
        """POST `body` straight to the ASGI app, and disconnect (http.disconnect) once
        `leave_when(events so far)` holds, checked after each SSE event and each step of
        the engine; returns once the app has returned, with the events it sent."""
        return self.run(leave(self.app, path, body, self.headers, leave_when))


def parse_sse(text: str) -> list[Any]:
    """The events of an SSE body: parsed JSON objects, and the string "[DONE]"."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def leave(
    app: Any,
    path: str,
    body: Any,
    headers: dict[str, str],
    leave_when: Callable[[list[str]], bool],
) -> list[str]:
    """The ASGI call of InProcessApp.call_and_leave (ASGITransport buffers a whole response
    before returning, so it cannot leave mid-stream)."""
    content = json.dumps(body).encode()
    events: list[str] = []
    gone = asyncio.Event()
    received: list[None] = []

    async def receive() -> dict[str, Any]:
        if not received:
            received.append(None)
            return {"type": "http.request", "body": content, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            events.extend(e for e in message["body"].decode().split("\n\n") if e)
        if leave_when(events):
            gone.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "server": ("test", 80), "client": ("client", 1),
        "headers": [
            (b"content-type", b"application/json"), (b"host", b"test"),
            *((k.lower().encode(), v.encode()) for k, v in headers.items()),
        ],
    }  # fmt: skip
    call = asyncio.ensure_future(app(scope, receive, send))
    while not call.done():  # for a whole response, nothing is sent until the end
        if leave_when(events) and not gone.is_set():
            gone.set()
            # Generous: the app returns at once unless it fails to notice the disconnect.
            done, _ = await asyncio.wait([call], timeout=LEAVE_TIMEOUT_S)
            assert done, f"the app still runs {LEAVE_TIMEOUT_S} s after the client left"
        await asyncio.wait([call], timeout=0.01)
    call.result()
    return events
