"""The server applies the model's generation-config defaults (vLLM's default_sampling_params)
to the sampling fields a request leaves out, on /v1/completions and /v1/chat/completions,
streamed or not; what the request sets wins."""

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from pagedserve.engine.async_engine import RequestStream
from pagedserve.engine.input_processor import PromptType
from pagedserve.sampling_params import SamplingParams

from .conftest import shared_tokenizer
from .fake_engine import FakeEngine
from .in_process import AppLoop, InProcessApp

DEFAULTS = {
    "temperature": 0.25,
    "top_p": 0.5,
    "top_k": 7,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "max_tokens": 5,
}
CHAT = {"messages": [{"role": "user", "content": "Hello"}]}


class RecordingEngine(FakeEngine):
    """A FakeEngine with a model config holding generation defaults, that records the
    SamplingParams of each request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model_config = SimpleNamespace(get_diff_sampling_param=lambda: dict(DEFAULTS))
        self.params: list[SamplingParams] = []

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        self.params.append(params)
        return super().add_request(request_id, prompt, params, priority)


@pytest.fixture
def app(app_loop: AppLoop) -> Iterator[InProcessApp]:
    engine = RecordingEngine(shared_tokenizer("llama3"))
    app = InProcessApp(app_loop, engine, "model")
    yield app
    app_loop.loop.call_soon_threadsafe(engine.shutdown)


def sampling(params: SamplingParams) -> tuple[Any, ...]:
    return (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty)


def test_chat_left_out_fields_take_the_model_defaults(app: InProcessApp) -> None:
    engine: RecordingEngine = app.engine
    for stream in (False, True):
        body = {**CHAT, "stream": stream, "stream_options": {"include_usage": True}}
        if stream:
            events = app.stream_events("/v1/chat/completions", body)
            usage = events[-2]["usage"]
        else:
            body.pop("stream_options")
            usage = app.post("/v1/chat/completions", body).json()["usage"]
        assert sampling(engine.params[-1]) == (0.25, 0.5, 7, 0.1, 1.2)
        assert usage["completion_tokens"] == 5  # max_new_tokens, not the whole context
    own = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    response = app.post("/v1/chat/completions", {**CHAT, **own, "max_completion_tokens": 3})
    assert sampling(engine.params[-1]) == (1.0, 1.0, 0, 0.0, 1.0)
    assert response.json()["usage"]["completion_tokens"] == 3


def test_completions_take_the_defaults_but_keep_vllms_16_tokens(app: InProcessApp) -> None:
    engine: RecordingEngine = app.engine
    response = app.post("/v1/completions", {"prompt": "Hello"})
    assert sampling(engine.params[-1]) == (0.25, 0.5, 7, 0.1, 1.2)
    # vLLM's CompletionRequest defaults max_tokens to 16; an explicit null takes the model's.
    assert response.json()["usage"]["completion_tokens"] == 16
    response = app.post("/v1/completions", {"prompt": "Hello", "max_tokens": None})
    assert response.json()["usage"]["completion_tokens"] == 5
    response = app.post("/v1/completions", {"prompt": "Hello", "temperature": 0.0, "top_k": 2})
    assert engine.params[-1].temperature == 0.0 and engine.params[-1].top_k == 2
    assert engine.params[-1].top_p == 0.5  # the fields it left out still take the defaults
