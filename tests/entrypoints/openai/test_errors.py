"""Every error is OpenAI-shaped, has the right status, and leaves the server healthy: in
process, on the fake engine (the real tokenizing and validation) behind an API key."""

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from .conftest import API_KEY
from .in_process import InProcessApp


def assert_error(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["type"], str)
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error  # type: ignore[no-any-return]


@pytest.fixture
def fake_app(fake_app_factory: Callable[..., InProcessApp]) -> InProcessApp:
    """The fake-engine app behind an API key, as the real `fake_app` is."""
    return fake_app_factory(api_key=API_KEY)


@pytest.fixture(autouse=True)
def still_healthy_afterwards(fake_app: InProcessApp) -> Any:
    yield
    assert fake_app.get("/health").status_code == 200
    ok = fake_app.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/tokenize", "/version"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "x"}])
def test_missing_or_wrong_api_key_is_401(
    fake_app: InProcessApp, path: str, headers: dict[str, str]
) -> None:
    if path == "/v1/models" or path == "/version":
        response = fake_app.get(path, headers=headers)
    else:
        response = fake_app.post(path, {"prompt": "x"}, headers=headers)
    assert_error(response, 401, "API key")


def test_health_and_metrics_need_no_key(fake_app: InProcessApp) -> None:
    assert fake_app.get("/health", headers={}).status_code == 200
    assert fake_app.get("/metrics", headers={}).status_code == 200
    version = fake_app.get("/version")
    assert version.status_code == 200 and "version" in version.json()


def test_openai_client_with_wrong_key_raises_authentication_error(fake_app: InProcessApp) -> None:
    client = fake_app.client(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_invalid_json_is_400(fake_app: InProcessApp) -> None:
    response = fake_app.request(
        "POST", "/v1/completions", content=b"{not json",
        headers={**fake_app.headers, "Content-Type": "application/json"},
    )  # fmt: skip
    assert_error(response, 400, "JSON")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "x", "logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"prompt": []}, "prompt"),
        # checks after tokenizing name the field too (they said "param": null)
        ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": [[1, 10**7]]}, "prompt"),
        ({"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids"),
        ({"prompt": "x", "allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"prompt": "x", "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
        ({"prompt": "x", "n": 10**6}, "n"),
        ({"prompt": "x", "repetition_penalty": 1e-300}, "repetition_penalty"),
    ],
)
def test_invalid_fields_are_400(fake_app: InProcessApp, body: dict[str, Any], param: str) -> None:
    error = assert_error(fake_app.post("/v1/completions", body), 400)
    assert error["param"] is not None and param in error["param"], error


def test_chat_errors_are_400(fake_app: InProcessApp) -> None:
    assert_error(fake_app.post("/v1/chat/completions", {"messages": []}), 400)
    bad_role = {"messages": [{"role": "robot", "content": "x"}]}
    assert_error(fake_app.post("/v1/chat/completions", bad_role), 400)
    bad_part = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert_error(fake_app.post("/v1/chat/completions", bad_part), 400)
    top_only = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert_error(fake_app.post("/v1/chat/completions", top_only), 400, "logprobs")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"chat_template": "{{ messages }}"}, "chat_template"),
    ],
)
def test_unimplemented_features_are_400_not_ignored(
    fake_app: InProcessApp, extra: dict[str, Any], param: str
) -> None:
    """They were ignored: a request for JSON got free text, with status 200."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    error = assert_error(fake_app.post("/v1/chat/completions", body), 400, param)
    assert error["param"] == param


_VLLM_EXTRAS = {  # vLLM request extras pagedserve does not implement: value, no-op value
    "request_id": ("mine-1", None),
    "return_tokens_as_token_ids": (True, False),
    "return_token_ids": (True, False),
    "prompt_embeds": ("AAAA", None),
    "kv_transfer_params": ({"do_remote_decode": True}, {}),
    "vllm_xargs": ({"x": 1}, {}),
    "mm_processor_kwargs": ({"num_crops": 4}, {}),
    "media_io_kwargs": ({"video": {"num_frames": 4}}, {}),
    "documents": ([{"title": "t", "text": "x"}], []),
    # OpenAI's fields, with what clients send by default
    "store": (True, False),
    "metadata": ({"user": "u"}, {}),
    "service_tier": ("flex", "auto"),
    "prediction": ({"type": "content", "content": "x"}, None),
    "modalities": (["text", "audio"], ["text"]),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "web_search_options": ({}, None),
    "reasoning_effort": ("low", None),
}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name", sorted(_VLLM_EXTRAS))
def test_unimplemented_vllm_extras_are_400_naming_them(
    fake_app: InProcessApp, route: str, name: str
) -> None:
    """vLLM users send these; they were silently ignored (status 200, the extra not applied).
    Their no-op values (what a client may send by default) still answer 200."""
    value, no_op = _VLLM_EXTRAS[name]
    base: dict[str, Any] = {"max_tokens": 2}
    if route == "/v1/completions":
        base["prompt"] = "x"
    else:
        base["messages"] = [{"role": "user", "content": "x"}]
    error = assert_error(fake_app.post(route, {**base, name: value}), 400, name)
    assert error["param"] == name
    assert fake_app.post(route, {**base, name: no_op}).status_code == 200


def test_chat_echo_is_400_naming_it(fake_app: InProcessApp) -> None:
    """vLLM's chat `echo` (prepend the last message to the answer) was silently ignored;
    false is fine, and completions implement echo."""
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for stream in (False, True):
        body = {**base, "echo": True, "stream": stream}
        error = assert_error(fake_app.post("/v1/chat/completions", body), 400, "echo")
        assert error["param"] == "echo"
    assert fake_app.post("/v1/chat/completions", {**base, "echo": False}).status_code == 200
    completion = {"prompt": "x", "max_tokens": 2, "echo": True}
    assert fake_app.post("/v1/completions", completion).json()["choices"][0]["text"][0] == "x"


def test_no_op_values_of_unimplemented_fields_are_fine(fake_app: InProcessApp) -> None:
    """What clients send by default asks for nothing and must keep working."""
    no_ops = {"response_format": {"type": "text"}, "tools": [], "logits_processors": []}
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **no_ops}
    assert fake_app.post("/v1/chat/completions", body).status_code == 200
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": body["messages"], "max_tokens": 2, "tools": tools, "tool_choice": "none"}
    assert fake_app.post("/v1/chat/completions", body).status_code == 200  # must not call them
    completion = {"prompt": "x", "max_tokens": 2, "response_format": {"type": "text"}}
    assert fake_app.post("/v1/completions", completion).status_code == 200
    bad = {"prompt": "x", "max_tokens": 2, "guided_regex": "[a-z"}  # does not parse
    assert assert_error(fake_app.post("/v1/completions", bad), 400)["param"] == "guided_regex"


def test_megabyte_prompts_are_400_before_tokenizing(fake_app: InProcessApp) -> None:
    """The fake_app tokenizes prompts itself, so it needs the character bound too (a 20 MB
    prompt took 17 s of tokenizing before its 400)."""
    huge = "ab" * 1_000_000
    error = assert_error(fake_app.post("/v1/completions", {"prompt": huge}), 400, "characters")
    assert error["param"] == "prompt"
    chat = {"messages": [{"role": "user", "content": huge}]}
    error = assert_error(fake_app.post("/v1/chat/completions", chat), 400, "characters")
    assert error["param"] == "messages"


def test_chat_400s_name_chat_fields(fake_app: InProcessApp) -> None:
    messages = [{"role": "user", "content": "x"}]
    for field in ("max_tokens", "max_completion_tokens"):
        body = {"messages": messages, field: 5000}
        assert assert_error(fake_app.post("/v1/chat/completions", body), 400)["param"] == field


def test_too_long_is_400_naming_both_numbers(fake_app: InProcessApp) -> None:
    num_prompt_tokens = len(fake_app.tokenize(prompt="Once upon a time"))
    max_tokens = 1024 - num_prompt_tokens + 1  # one token too many
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens}
    response = fake_app.post("/v1/completions", body)
    assert_error(response, 400, f"({num_prompt_tokens} tokens)", f"({max_tokens})", "1024")
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}
    assert_error(fake_app.post("/v1/chat/completions", chat), 400, "5000", "1024")
    with pytest.raises(openai.BadRequestError):
        fake_app.client().completions.create(model=fake_app.model, prompt="x", max_tokens=2000)


def test_unknown_model_is_404(fake_app: InProcessApp) -> None:
    error = assert_error(fake_app.post("/v1/completions", {"prompt": "x", "model": "gpt-5"}), 404)
    assert error["param"] == "model" and "gpt-5" in error["message"]
    with pytest.raises(openai.NotFoundError):
        fake_app.client().chat.completions.create(
            model="gpt-5", messages=[{"role": "user", "content": "x"}]
        )


def test_unknown_route_is_openai_shaped_404(fake_app: InProcessApp) -> None:
    assert_error(fake_app.get("/v1/nothing"), 404)


def test_bad_request_inside_a_stream_request_is_a_plain_400(fake_app: InProcessApp) -> None:
    body = {"prompt": "x", "max_tokens": 5000, "stream": True}
    assert_error(fake_app.post("/v1/completions", body), 400, "5000")


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_to_decode_one_request_is_a_500_and_the_engine_goes_on(
    app_loop: Any, real_engine: Any, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """An internal error while detokenizing a request's output ends that request with a 500
    (OpenAI's error body; not 499, which is for a client that left, and not a dead engine's
    503); the next request is served."""
    from pagedserve.engine.detokenizer import IncrementalDetokenizer

    app = InProcessApp(app_loop, real_engine, "m")
    body = {"model": "m", "prompt": "Once", "max_tokens": 3, "stream": stream}

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("cannot decode")

    with monkeypatch.context() as patch:
        patch.setattr(IncrementalDetokenizer, "update", fail)
        response = app.post("/v1/completions", body)
    if stream:
        assert response.status_code == 200  # the headers went before the failure
        error = json.loads(response.text.split("data: ", 1)[1].split("\n\n", 1)[0])["error"]
    else:
        assert response.status_code == 500, response.text
        error = response.json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "cannot decode" not in error["message"]  # the cause goes to the server log only
    after = app.post("/v1/completions", {**body, "stream": False})
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["finish_reason"] == "length"
