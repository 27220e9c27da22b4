"""The server's app (`build_app`) served in process, and a fake engine to serve it with.

`InProcessApp` talks to the app through httpx's ASGITransport, with the same methods as the
real-process `Server` of conftest.py (`post`, `get`, `tokenize`, `client()` for the official
openai client, ...), so that a test reads the same against either. The app and its engine live
on one event loop in a thread (`AppLoop`): the real AsyncLLMEngine's methods must all be
called from one loop.

`FakeEngine` is the engine protocol that the app uses (`serving.Engine`) without a model or an
engine-core process. Its caller's side is the real one: the InputProcessor tokenizes and
validates (the 400s name their `param` as with AsyncLLMEngine), and the OutputProcessor
detokenizes, applies stop strings, gathers n / best_of sequences and forms the DELTA,
FINAL_ONLY and abort outputs. In place of the engine core it produces tokens from a script,
deterministically, and it can be told to refuse requests, hold them (a generation that does
not end until aborted), fail the running ones or die.
"""

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from pagedserve.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.llm_engine import register_request
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.errors import EngineDeadError
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import EngineCoreOutput
from pagedserve.step import PromptLogprobsData, SampleLogprobsData

BASE_URL = "http://test"
LEAVE_TIMEOUT_S = 30.0
# What the fake "model" writes: words, then multi-byte characters that byte-level tokenizers
# split over several tokens (the detokenizer must hold their bytes back), then more words.
SCRIPT = (
    "Once upon a time, there was a little girl named Lily. She liked to play outside 🌞. "
    "你好，世界！今天天气很好。 Emoji time 🎉🚀 and 🤖; 数学 ∑ π ≈ 3.14. The end"
)


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
        raise NotImplementedError

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


@dataclass
class _Child:
    """One engine-core request (a sequence) of the fake engine."""

    request: Request
    offset: int  # where in the script its tokens start
    logprob: float  # of each of its tokens: children rank by it for best_of
    num_output_tokens: int = 0


class FakeEngine:
    """`serving.Engine` with the real InputProcessor and OutputProcessor, and a script in
    place of the model (see the module docstring).

    Each engine-core request (one per sequence: n, or best_of) gets one token per step:
    `script[(offset + i) % len(script)]`, where the offset is the prompt's length, plus the
    child's seed (or its index) when sampling (temperature > 0): greedy sequences are alike,
    seeded ones reproducible. It finishes with "length" at max_tokens (or at max_model_len),
    with "stop" on a stop token id or EOS (not before min_tokens; EOS not with ignore_eos).
    Every token has logprob -0.1 * (child index + 1), rank 1; the top-k alternatives are the
    script's next distinct tokens, each 1.0 lower. Prompt logprobs come with the first step.

    Knobs: `write(token_ids)` (the script), `refuse_with` (add_request raises it),
    `hold_after` (sequences stop after that many tokens until aborted: a long generation),
    `fail_running(error)` and `die()`.
    Records: `added` and `aborted` request ids; `running()` lists the unfinished ones.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int = 1024,
        vocab_size: int | None = None,
        max_logprobs: int = 20,
        script: str = SCRIPT,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        if vocab_size is None:  # as conftest's tiny models: the tokenizer's, rounded up to 64
            vocab_size = (len(tokenizer) + 63) // 64 * 64
        self.vocab_size = vocab_size
        self.input_processor = InputProcessor(
            tokenizer, max_model_len, vocab_size, (tokenizer.eos_token_id,), max_logprobs
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.script: list[int] = list(tokenizer.encode(script, add_special_tokens=False))
        self.offset_by_prompt = True
        self.streams: dict[str, RequestStream] = {}
        self.children: dict[str, _Child] = {}  # by engine-core request id
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.refuse_with: BaseException | None = None
        self.hold_after: int | None = None
        self.dead_error: EngineDeadError | None = None
        self.num_steps = 0
        self._stepper: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    # The engine protocol of the server (serving.Engine), as AsyncLLMEngine has it.

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def start(self) -> None:
        if self._stepper is None or self._stepper.done():
            self._wake = asyncio.Event()
            self._stepper = asyncio.create_task(self._run(), name="fake-engine-steps")

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> RequestStream:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if self.refuse_with is not None:
            raise self.refuse_with
        self.start()
        processed, children = register_request(
            self.input_processor,
            self.output_processor,
            request_id,
            prompt,
            params,
            num_blocks=10**6,
            block_size=16,
        )
        for index, child in enumerate(children):
            child_params = child.sampling_params
            offset = len(processed.prompt_token_ids) if self.offset_by_prompt else 0
            if child_params.temperature > 0:
                offset += index if child_params.seed is None else child_params.seed
            self.children[child.request_id] = _Child(child, offset, -0.1 * (index + 1))
        stream = RequestStream(request_id)
        self.streams[request_id] = stream
        self.added.append(request_id)
        self._wakeup()
        return stream

    # AsyncLLMEngine's own: they only call add_request and abort_request.
    iterate = AsyncLLMEngine.iterate
    generate = AsyncLLMEngine.generate
    abort = AsyncLLMEngine.abort

    def abort_request(self, request_id: str) -> None:
        final_output = self.output_processor.abort_output(request_id)
        for child_id in self.output_processor.abort_request(request_id):
            self.children.pop(child_id, None)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            self.aborted.append(request_id)
            if final_output is not None:
                stream.queue.put_nowait(final_output)

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    def fail_running(self, error: BaseException) -> None:
        """Every running request's stream raises `error`; the engine stays usable."""
        for request_id, stream in list(self.streams.items()):
            for child_id in self.output_processor.abort_request(request_id):
                self.children.pop(child_id, None)
            stream.queue.put_nowait(error)
        self.streams.clear()

    def die(self, message: str = "the fake engine core died") -> None:
        """As the engine core's death: pending requests fail, new ones and /health too."""
        self.dead_error = EngineDeadError(message)
        self.fail_running(EngineDeadError(message))

    # For the tests.

    def write(self, token_ids: list[int]) -> None:
        """From now on, greedy sequences write `token_ids` (and again, and again)."""
        self.script = list(token_ids)
        self.offset_by_prompt = False

    def running(self) -> list[str]:
        """Request ids not finished (nor aborted); none may be left after a request ends."""
        return list(self.output_processor.requests)

    def held(self) -> bool:
        """True when requests run and all of them wait at `hold_after`."""
        return bool(self.children) and not self._runnable()

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()

    # The stand-in for the engine core.

    def _wakeup(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _runnable(self) -> list[_Child]:
        limit = self.hold_after
        return [c for c in self.children.values() if limit is None or c.num_output_tokens < limit]

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            runnable = self._runnable()
            if not runnable:
                self._wake.clear()
                await self._wake.wait()
                continue
            outputs = [self._step(child) for child in runnable]
            request_outputs, stopped = self.output_processor.process_outputs(outputs)
            for child_id in stopped:  # a stop string ended it
                self.children.pop(child_id, None)
            for output in request_outputs:
                stream = self.streams.get(output.request_id)
                if output.finished:
                    self.streams.pop(output.request_id, None)
                if stream is not None:
                    stream.queue.put_nowait(output)
            self.num_steps += 1
            await asyncio.sleep(0)  # one step per loop turn: handlers and disconnects run

    def _step(self, child: _Child) -> EngineCoreOutput:
        request = child.request
        params = request.sampling_params
        position = child.offset + child.num_output_tokens
        token = self.script[position % len(self.script)]
        child.num_output_tokens += 1
        finish_reason, stop_reason = None, None
        num_tokens = request.num_prompt_tokens + child.num_output_tokens
        if token in request.stop_token_ids and child.num_output_tokens > params.min_tokens:
            finish_reason = "stop"
            if token not in params.eos_token_ids or params.ignore_eos:
                stop_reason = token  # a user stop token, not EOS
        elif child.num_output_tokens >= request.max_tokens or num_tokens >= self.max_model_len:
            finish_reason = "length"
        if finish_reason is not None:
            del self.children[request.request_id]
        logprobs = None
        if params.logprobs is not None:
            ids, values = self._ranked(token, child.logprob, params.logprobs, position + 1)
            logprobs = SampleLogprobsData(ids, values, 1)
        prompt_logprobs = None
        if params.prompt_logprobs is not None and child.num_output_tokens == 1:
            rows = [
                self._ranked(t, -1.0, params.prompt_logprobs, i)
                for i, t in enumerate(request.prompt_token_ids[1:])
            ]
            prompt_logprobs = PromptLogprobsData(
                first_position=1,
                token_ids=[ids for ids, _ in rows],
                logprobs=[values for _, values in rows],
                ranks=[1] * len(rows),
            )
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_cached_tokens=0,
            prompt_logprobs=prompt_logprobs,
        )

    def _ranked(
        self, token: int, logprob: float, num_top: int, start: int
    ) -> tuple[list[int], list[float]]:
        """The token, then the top `num_top`: the token itself (rank 1) and the script's next
        distinct tokens from `start`, each 1.0 less likely."""
        top = [token]
        position = start
        while len(top) < num_top and position < start + 4 * len(self.script):
            candidate = self.script[position % len(self.script)]
            if candidate not in top:
                top.append(candidate)
            position += 1
        top = top[:num_top]
        return [token, *top], [logprob, *(logprob - i for i in range(len(top)))]
