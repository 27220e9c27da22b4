"""What the server does with a request around the engine, in process on the fake engine: a
client that leaves frees every sequence of its request; engine failures reach the client
with their status, whole or mid-stream; best_of and n are gathered into indexed choices;
errors carry their `param` (the server parses no message)."""

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from pagedserve import SamplingParams
from pagedserve.entrypoints.openai.serving import to_openai_error
from pagedserve.errors import EngineOverloadedError, InvalidRequestError, ServerShuttingDownError

from .in_process import InProcessApp, parse_sse

LONG = {"max_tokens": 900, "ignore_eos": True}
BODIES = {
    "/v1/completions": {"prompt": "Once upon a time", **LONG},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a story"}], **LONG},
}
SHAPES = {  # one request, n sequences of one request, several requests (prompts)
    "one": {},
    "n=3": {"n": 3, "temperature": 1.0},
    "two prompts": {"prompt": ["Once upon a time", "Hello"]},
}


def error_of(event: Any, status: int) -> dict[str, Any]:
    assert isinstance(event, dict) and "error" in event, event
    error: dict[str, Any] = event["error"]
    assert error["code"] == status, error
    return error


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        (path, shape)
        for path in BODIES
        for shape in SHAPES
        if "chat" not in path or shape != "two prompts"
    ],
)
def test_leaving_mid_stream_aborts_every_sequence(
    fake_app: InProcessApp, path: str, shape: str
) -> None:
    engine = fake_app.engine
    engine.hold_after = 3  # every sequence writes 3 tokens, then runs on until aborted
    body = {**BODIES[path], **SHAPES[shape], "stream": True}
    events = fake_app.call_and_leave(path, body, lambda sent: bool(sent) and engine.held())
    assert events[0].startswith("data: {")  # it was streaming
    assert len(engine.added) == (2 if "prompt" in SHAPES[shape] else 1)
    assert engine.aborted == engine.added
    assert engine.running() == [] and not engine.children


@pytest.mark.parametrize("path", list(BODIES))
def test_leaving_while_waiting_for_a_whole_response_aborts(
    fake_app: InProcessApp, path: str
) -> None:
    engine = fake_app.engine
    engine.hold_after = 3
    fake_app.call_and_leave(path, BODIES[path], lambda sent: engine.held())
    assert len(engine.added) == 1 and engine.aborted == engine.added
    assert engine.running() == [] and not engine.children


def test_engine_death_fails_pending_requests_and_the_app_reports_it(
    fake_app_factory: Callable[..., InProcessApp],
) -> None:
    """A stream ends with a 503 error event and [DONE], a whole response is a 503, /health
    and new requests are 503s; the app's lifespan watcher calls `on_engine_death` (the real
    server then exits; test_engine_death.py kills a real engine core)."""
    died = threading.Event()
    app = fake_app_factory(on_engine_death=died.set)
    engine = app.engine
    engine.hold_after = 2
    stream = {**BODIES["/v1/completions"], "stream": True}

    async def scenario() -> list[Any]:
        async with app.app.router.lifespan_context(app.app), app.async_http() as client:
            streamed = asyncio.create_task(client.post("/v1/completions", json=stream))
            chat = BODIES["/v1/chat/completions"]
            whole = asyncio.create_task(client.post("/v1/chat/completions", json=chat))
            while len(engine.added) < 2 or not engine.held():
                await asyncio.sleep(0.01)
            engine.die()
            responses = [await streamed, await whole, await client.get("/health")]
            responses.append(await client.post("/v1/chat/completions", json=chat))
            for _ in range(2000):  # the watcher polls the engine's health every 0.2 s
                if died.is_set():
                    break
                await asyncio.sleep(0.01)
            return responses

    streamed, whole, health, new = app.run(scenario())
    assert streamed.status_code == 200  # the headers had gone out
    events = parse_sse(streamed.text)
    assert (
        events[-1] == "[DONE]" and "engine core has failed" in error_of(events[-2], 503)["message"]
    )
    for response in (whole, health, new):
        assert response.status_code == 503, response.text
    assert error_of(whole.json(), 503)["type"] == "ServiceUnavailableError"
    assert died.is_set()


def fail_mid_stream(app: InProcessApp, path: str, error: BaseException) -> list[Any]:
    """Start a stream, let it write, then fail the running requests with `error` (as
    DrainingServer does with ServerShuttingDownError); the stream's events."""
    engine = app.engine
    engine.hold_after = 2

    async def scenario() -> Any:
        async with app.async_http() as client:
            streamed = asyncio.create_task(client.post(path, json={**BODIES[path], "stream": True}))
            while not engine.held():
                await asyncio.sleep(0.01)
            engine.fail_running(error)
            return await streamed

    response = app.run(scenario())
    assert response.status_code == 200  # the headers had gone out
    assert engine.running() == []
    return parse_sse(response.text)


def test_a_stopping_server_ends_running_streams_with_a_503_event(fake_app: InProcessApp) -> None:
    """What DrainingServer does after its drain period: engine.fail_running(...)."""
    error = ServerShuttingDownError("the server is shutting down")
    events = fail_mid_stream(fake_app, "/v1/chat/completions", error)
    assert events[-1] == "[DONE]"
    assert "shutting down" in error_of(events[-2], 503)["message"]
    # the engine stays usable
    ok = fake_app.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_an_unexpected_failure_mid_stream_is_a_plain_500_event(
    fake_app: InProcessApp, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    events = fail_mid_stream(fake_app, "/v1/completions", RuntimeError("secret /srv/path detail"))
    assert events[-1] == "[DONE]"
    message = error_of(events[-2], 500)["message"]
    assert "internal server error" in message and "secret" not in message
    assert "secret /srv/path detail" in caplog.text  # the log has it


@pytest.mark.parametrize("stream", [False, True])
def test_an_overloaded_engine_is_a_429(fake_app: InProcessApp, stream: bool) -> None:
    fake_app.engine.refuse_with = EngineOverloadedError("too many requests waiting")
    body = {**BODIES["/v1/completions"], "stream": stream}
    response = fake_app.post("/v1/completions", body)
    assert response.status_code == 429, response.text
    error = error_of(response.json(), 429)
    assert error["type"] == "RateLimitError" and error["message"] == "too many requests waiting"


def test_best_of_returns_the_n_best_of_its_sequences(fake_app: InProcessApp) -> None:
    """The fake ranks sequence i with logprob -0.1 * (i + 1) per token: the best 2 of 4 are
    the first two, which are what n=2 alone returns."""
    body = {"prompt": "Once upon a time", "max_tokens": 4, "n": 2, "temperature": 1.0}
    alone = fake_app.post("/v1/completions", body).json()
    best = fake_app.post("/v1/completions", {**body, "best_of": 4}).json()
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in alone["choices"]]
    assert best["usage"]["completion_tokens"] == 2 * 4  # the returned sequences only
    streamed = fake_app.post("/v1/completions", {**body, "best_of": 4, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"


def test_chat_stream_with_n_sends_roles_first_and_one_finish_per_choice(
    fake_app: InProcessApp,
) -> None:
    body = {
        **BODIES["/v1/chat/completions"], "max_tokens": 5, "n": 2, "temperature": 1.0,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    events = fake_app.stream_events("/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant"] * 2
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[2:])  # first chunk only
    assert all(None not in c["choices"][0]["delta"].values() for c in chunks)
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in chunks)
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2 * 5
    del body["stream_options"]
    whole = fake_app.post("/v1/chat/completions", body).json()
    for choice in whole["choices"]:
        text = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in chunks
            if c["choices"][0]["index"] == choice["index"]
        )
        assert text == choice["message"]["content"]


def test_errors_carry_their_param_and_the_server_reads_no_message() -> None:
    """The server found `param` of a SamplingParams error with a regex over its message."""
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(top_p=0.0)
    assert caught.value.param == "top_p"
    assert to_openai_error(caught.value).param == "top_p"
    lookalike = InvalidRequestError("SamplingParams.top_p is only named in the text")
    assert to_openai_error(lookalike).param is None
