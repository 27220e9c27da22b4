"""The server's edge, in process (httpx over ASGI against `build_app`), on the fake engine
with the bundled stories260k model's tokenizer (the real tokenizing and validation): what runs
off the event loop, request validation that needs no generation, and error bodies; the
schema fuzzing runs on the real engine (`real_engine`)."""

import asyncio
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.entrypoints.openai.openapi import unique_operation_ids

from .in_process import AppLoop, InProcessApp

MESSAGES = [{"role": "user", "content": "Hi"}]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture
def server(fake_app_factory: Callable[..., InProcessApp]) -> InProcessApp:
    """The fake engine with the bundled model's tokenizer and context (512 tokens)."""
    return fake_app_factory("stories260k", engine={"max_model_len": 512}, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def real_server(app_loop: AppLoop, real_engine: AsyncLLMEngine) -> InProcessApp:
    return InProcessApp(app_loop, real_engine, "stories", chat_template=TEMPLATE)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == status
    return error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": False}])
def test_stream_options_without_stream_is_400(
    server: InProcessApp, path: str, options: dict[str, Any]
) -> None:
    """It was accepted and ignored; vLLM refuses it ("only when stream=True")."""
    body: dict[str, Any] = {"max_tokens": 2, "stream": False, "stream_options": options}
    body.update({"prompt": "Hi"} if "chat" not in path else {"messages": MESSAGES})
    assert error_of(server.post(path, body), 400)["param"] == "stream_options"
    body.pop("stream")  # the default is not streaming either
    assert error_of(server.post(path, body), 400)["param"] == "stream_options"
    body["stream"] = True
    assert server.post(path, body).status_code == 200


class Gate:
    """Wraps a tokenizer method so that the call blocks until the gate opens (or 20 s pass)
    and records the order of events: run on the event loop, it would stall /health."""

    def __init__(self, tokenizer: Any, name: str, events: list[str]) -> None:
        self.tokenizer, self.name, self.events = tokenizer, name, events
        self.original = getattr(tokenizer, name)
        self.opened = threading.Event()
        self.entered = threading.Event()

    def __enter__(self) -> "Gate":
        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            self.opened.wait(timeout=20.0)  # only reached when the loop was blocked
            self.events.append(f"{self.name} done")
            return self.original(*args, **kwargs)

        setattr(self.tokenizer, self.name, gated)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.opened.set()
        delattr(self.tokenizer, self.name)  # the class's method again


@pytest.mark.parametrize(
    ("path", "body", "method"),
    [
        ("/tokenize", {"prompt": "Once upon a time"}, "encode"),
        ("/tokenize", {"messages": MESSAGES}, "apply_chat_template"),
        ("/detokenize", {"tokens": [1, 2, 3]}, "decode"),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2}, "encode"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}, "apply_chat_template"),
    ],
)
def test_health_answers_while_a_request_tokenizes(
    server: InProcessApp, path: str, body: dict[str, Any], method: str
) -> None:
    """A 4.8 MB /tokenize held /health for seconds: the handler tokenized on the event loop.
    Here the tokenizer call blocks until /health has answered; on the loop it could not."""
    events: list[str] = []

    async def scenario() -> httpx.Response:
        async with server.async_http() as client:
            slow = asyncio.create_task(client.post(path, json=body))
            while not gate.entered.is_set() and not slow.done():
                await asyncio.sleep(0.01)
            health = await client.get("/health")
            events.append(f"health {health.status_code}")
            gate.opened.set()
            return await slow

    with Gate(server.engine.get_tokenizer(), method, events) as gate:
        response = server.run(scenario())
    assert response.status_code == 200, response.text
    assert events[:2] == ["health 200", f"{method} done"], events


def test_500_bodies_hide_the_exception(
    server: InProcessApp, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A 500 carried `internal error: RuntimeError('...')`: file paths, other requests'
    state. The client gets a plain line; the log the exception."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret /srv/path detail")

    monkeypatch.setattr(server.engine.get_tokenizer(), "decode", broken)
    error = error_of(server.post("/detokenize", {"tokens": [5]}), 500)
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    assert "internal server error" in error["message"]
    assert "secret /srv/path detail" in caplog.text


@pytest.mark.parametrize(
    "extra",
    [
        {"chat_template_kwargs": {"tokenize": True}},  # named apply_chat_template()
        {"chat_template_kwargs": {"conversation": []}},
    ],
)
def test_chat_template_400s_name_no_internals(server: InProcessApp, extra: dict[str, Any]) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2, **extra}
    for path in ("/v1/chat/completions", "/tokenize"):
        error = error_of(server.post(path, body), 400)
        assert error["param"] == "messages"
        for internal in ("apply_chat_template", "()", "Traceback", "Error"):
            assert internal not in error["message"], error


def test_template_raise_exception_message_reaches_the_user() -> None:
    from pagedserve.entrypoints.chat_utils import chat_template_error

    jinja2 = pytest.importorskip("jinja2")
    own = chat_template_error(jinja2.TemplateError("roles must alternate user/assistant"))
    assert own.param == "messages" and "roles must alternate" in str(own)
    other = chat_template_error(jinja2.UndefinedError("'dict object' has no attribute 'x'"))
    assert "dict object" not in str(other)


def test_405_carries_allow(server: InProcessApp) -> None:
    async def put() -> httpx.Response:
        async with server.async_http() as client:
            return await client.put("/v1/completions", json={})

    response = server.run(put())
    assert error_of(response, 405)["type"]
    assert response.headers["allow"] == "POST"


def test_openapi_documents_what_the_server_answers(server: InProcessApp) -> None:
    schema = server.app.openapi()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)  # it answers 400
    health = schema["paths"]["/health"]["get"]["responses"]["200"]
    assert not health.get("content")  # as vLLM: an empty body

    async def get_health() -> httpx.Response:
        async with server.async_http() as client:
            return await client.get("/health")

    response = server.run(get_health())
    assert response.status_code == 200 and response.content == b""


def test_openapi_operation_ids_are_unique(server: InProcessApp) -> None:
    """Every operation has its own operationId (client generators key on them): GET|POST /ping,
    one route, gets one per method, without FastAPI's duplicate warning; PUT /ping's 405 still
    allows both methods. A document with ids that still repeat is refused."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Duplicate Operation ID")
        schema = server.app.openapi()
    ids = [
        operation["operationId"]
        for operations in schema["paths"].values()
        for operation in operations.values()
    ]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    ping = schema["paths"]["/ping"]
    assert (ping["get"]["operationId"], ping["post"]["operationId"]) == (
        "ping_ping_get",
        "ping_ping_post",
    )

    async def put_ping() -> httpx.Response:
        async with server.async_http() as client:
            return await client.put("/ping")

    response = server.run(put_ping())
    assert response.status_code == 405
    assert sorted(response.headers["allow"].split(", ")) == ["GET", "POST"]

    clash = {"paths": {"/a": {"get": {"operationId": "f"}}, "/b": {"get": {"operationId": "f"}}}}
    with pytest.raises(AssertionError, match=r"duplicate operationIds: \['f_get'\]"):
        unique_operation_ids(clash)


def test_schema_fuzzing_finds_no_5xx_and_no_undocumented_answer(
    real_server: InProcessApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """schemathesis over /openapi.json, a few examples per operation, valid and invalid:
    no 5xx, and every status, content type, header and body as documented."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    monkeypatch.setenv("PAGEDSERVE_MAX_N_SEQUENCES", "4")  # keep generated requests small
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]
    schema = schemathesis.openapi.from_dict(real_server.app.openapi())
    fuzz_settings = settings(
        max_examples=10,
        deadline=None,
        derandomize=True,  # the same requests every run: a failure reproduces
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    seen: set[int] = set()

    async def send(kwargs: dict[str, Any]) -> httpx.Response:
        body = kwargs.get("json")
        if isinstance(body, dict) and "v1" in kwargs["url"]:
            # Generation length is not what is fuzzed: keep it short (chat's default is the
            # rest of the context).
            for name in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(name), int) and body[name] > 8:
                    body[name] = 8
            if body.get("max_completion_tokens") is None:
                body.setdefault("max_tokens", 8)
        async with real_server.async_http() as client:
            return await client.request(
                kwargs["method"],
                kwargs["url"],
                headers=kwargs.get("headers"),
                params=kwargs.get("params"),
                json=kwargs.get("json"),
                content=kwargs.get("data"),
            )

    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @fuzz_settings
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                response = real_server.run(send(case.as_transport_kwargs(base_url="http://test")))
                seen.add(response.status_code)
                case.validate_response(response, checks=checks)

            try:
                check()
            except Unsatisfiable:  # no invalid request exists (an operation without inputs)
                assert mode == GenerationMode.NEGATIVE
    assert {200, 400} <= seen, seen  # it did reach the handlers, with good and bad requests


MEGABYTES = "hello " * 350_000  # 2.1 MB: under the body limit, far over max_model_len (512)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": MEGABYTES, "max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": ["x", MEGABYTES], "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": MEGABYTES}]}, None),
        ("/tokenize", {"prompt": MEGABYTES}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": MEGABYTES}]}, "messages"),
    ],
)
def test_megabyte_prompts_are_400_before_tokenizing(
    server: InProcessApp, path: str, body: dict[str, Any], param: str | None
) -> None:
    """The bundled model's tokenizer (fuse_unk, with byte fallback) had no bound: such a
    prompt was tokenized in full (20 MB: 24 s and 2.9 GB) before its 400, on every path."""
    error = error_of(server.post(path, body), 400)
    assert "characters) is too long" in error["message"], error
    assert error["param"] == (param or "messages")


def test_body_over_the_limit_is_413_with_or_without_content_length(server: InProcessApp) -> None:
    small = build_app(server.engine, ["stories"], max_request_body_bytes=1000)
    big = {"prompt": "x" * 2000, "max_tokens": 2}

    async def chunks() -> Any:
        for _ in range(100):  # a streamed body: no Content-Length
            yield b'{"prompt": "' if _ == 0 else b"x" * 100

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=small)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            declared = await client.post("/v1/completions", json=big)
            streamed = await client.post("/tokenize", content=chunks())
            fine = await client.post("/tokenize", json={"prompt": "Once"})
            return [declared, streamed, fine]

    declared, streamed, fine = server.run(scenario())
    assert "transfer-encoding" in streamed.request.headers
    for response in (declared, streamed):
        assert "1000 bytes" in error_of(response, 413)["message"]
    assert fine.status_code == 200, fine.text


def test_tokenizing_stops_when_the_client_is_gone(server: InProcessApp) -> None:
    """A request's tokenizing went on after its client left (18 minutes for one prompt).
    Here the first of three prompts is held in the tokenizer while the client disconnects:
    the handler returns at once and the other two prompts are never tokenized."""
    events: list[str] = []
    body = {"prompt": ["Once", "upon", "a"], "max_tokens": 2}
    with Gate(server.engine.get_tokenizer(), "encode", events) as gate:
        # Returns while the tokenizer still holds the first prompt.
        server.call_and_leave("/v1/completions", body, lambda sent: gate.entered.is_set())
        events.append("handler returned")
        gate.opened.set()
        deadline = time.monotonic() + 20.0
        while len(events) < 2 and time.monotonic() < deadline:  # the first prompt ends
            time.sleep(0.01)
        time.sleep(0.2)  # room for a (wrong) second encode to show up
    assert events == ["handler returned", "encode done"], events
