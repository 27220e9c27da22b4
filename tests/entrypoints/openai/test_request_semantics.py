"""Request semantics of the server, in process (httpx over ASGI against `build_app` with the
real AsyncLLMEngine of conftest, `real_engine`: the bundled model, max_model_len 128): the
default max_tokens near the context limit, empty prompts, chat content parts and
`add_special_tokens` (issue 13)."""

import json
from typing import Any

import httpx
import pytest

from pagedserve import SamplingParams
from pagedserve.engine.async_engine import AsyncLLMEngine

from .conftest import REAL_MAX_MODEL_LEN
from .in_process import AppLoop, InProcessApp

MAX_MODEL_LEN = REAL_MAX_MODEL_LEN  # 128
BOS = 1  # stories260k's SentencePiece tokenizer adds it
# A template without BOS, so that add_special_tokens shows as one more token.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def server(app_loop: AppLoop, real_engine: AsyncLLMEngine) -> InProcessApp:
    return InProcessApp(app_loop, real_engine, "stories", chat_template=TEMPLATE)


def prompt_of(server: InProcessApp, num_tokens: int) -> str:
    """A text of exactly `num_tokens` tokens (BOS included)."""
    words = "Once upon a time there was a little girl named Lily who liked to play outside."
    for repeat in range(1, 100):
        ids = server.tokenize(prompt=" ".join([words] * repeat))
        if len(ids) >= num_tokens:
            text = server.post("/detokenize", {"tokens": ids[1:num_tokens]}).json()["prompt"]
            assert len(server.tokenize(prompt=text)) == num_tokens
            return str(text)
    raise AssertionError("no text long enough")


def error_of(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def stream_usage(response: httpx.Response) -> dict[str, int]:
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage: dict[str, int] = json.loads(events[-2])["usage"]
    return usage


def test_left_out_max_tokens_is_capped_to_the_context(server: InProcessApp) -> None:
    """120 prompt tokens of 128: the default 16 becomes 8; a sent max_tokens must fit."""
    prompt = prompt_of(server, 120)
    body = {"prompt": prompt, "ignore_eos": True, "temperature": 0}
    usage = server.post("/v1/completions", body).json()["usage"]
    assert usage == {"prompt_tokens": 120, "completion_tokens": 8, "total_tokens": 128}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    assert stream_usage(server.post("/v1/completions", streamed))["total_tokens"] == 128
    ids = server.tokenize(prompt=prompt)
    usage = server.post("/v1/completions", {**body, "prompt": [ids, ids[:10]]}).json()["usage"]
    assert usage["completion_tokens"] == 8 + 16  # each prompt its own cap
    # Sent, even as the default's value, it must fit: 400 as before.
    message = error_of(server.post("/v1/completions", {**body, "max_tokens": 16}), "max_tokens")
    assert "(120 tokens) + max_tokens (16)" in message
    # Far from the limit the default stays 16.
    short = server.post("/v1/completions", {**body, "prompt": "Once upon a time"}).json()
    assert short["usage"]["completion_tokens"] == 16


def test_left_out_chat_max_tokens_fills_the_context(server: InProcessApp) -> None:
    content = prompt_of(server, 110)
    body = {"messages": [{"role": "user", "content": content}], "ignore_eos": True}
    usage = server.post("/v1/chat/completions", body).json()["usage"]
    assert usage["prompt_tokens"] > 110 and usage["total_tokens"] == MAX_MODEL_LEN
    for field in ("max_tokens", "max_completion_tokens"):
        too_many = {**body, field: MAX_MODEL_LEN}
        error_of(server.post("/v1/chat/completions", too_many), field)


def test_async_engine_default_max_tokens_and_empty_text(server: InProcessApp) -> None:
    prompt = {"prompt_token_ids": [BOS] + [300] * 119}
    params = SamplingParams(ignore_eos=True, temperature=0)

    async def final(prompt: Any, params: SamplingParams, request_id: str) -> Any:
        outputs = [o async for o in server.engine.generate(prompt, params, request_id)]
        return outputs[-1]

    output = server.run(final(prompt, params, "default-cap"))
    assert output.finished and len(output.outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match=r"max_tokens \(16\)"):
        server.run(final(prompt, SamplingParams(max_tokens=16), "explicit"))
    empty = server.run(final("", SamplingParams(max_tokens=2), "empty"))
    assert empty.prompt_token_ids == [BOS] and empty.finished


def test_empty_prompt_is_one_bos_token(server: InProcessApp) -> None:
    assert server.tokenize(prompt="") == [BOS]
    body = {"prompt": "", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == {
        "prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5
    }  # fmt: skip
    listed = server.post("/v1/completions", {**body, "prompt": ["", "Once"]}).json()
    assert [c["index"] for c in listed["choices"]] == [0, 1]
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    assert stream_usage(server.post("/v1/completions", streamed))["prompt_tokens"] == 1
    # Without the BOS nothing is left: refused, as a prompt of no token ids is.
    bare = {**body, "add_special_tokens": False}
    assert "empty" in error_of(server.post("/v1/completions", bare), "prompt")
    assert "empty" in error_of(server.post("/v1/completions", {"prompt": [[]]}), "prompt")


def test_chat_add_special_tokens(server: InProcessApp) -> None:
    """vLLM's definition: special tokens (BOS) added on top of the template's when encoding
    the rendered text; chat and /tokenize default to False."""
    messages = [{"role": "user", "content": "Hi"}]
    plain = server.tokenize(messages=messages)
    assert plain[0] != BOS
    assert server.tokenize(messages=messages, add_special_tokens=True) == [BOS, *plain]
    body = {"messages": messages, "max_tokens": 2}
    usage = server.post("/v1/chat/completions", body).json()["usage"]
    assert usage["prompt_tokens"] == len(plain)
    with_bos = server.post("/v1/chat/completions", {**body, "add_special_tokens": True}).json()
    assert with_bos["usage"]["prompt_tokens"] == len(plain) + 1


def test_chat_content_parts_and_other_shapes(server: InProcessApp) -> None:
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    as_parts = server.tokenize(messages=[{"role": "user", "content": parts}])
    assert as_parts == server.tokenize(messages=[{"role": "user", "content": "Hi\nthere"}])
    developer = server.tokenize(messages=[{"role": "developer", "content": "Be kind"}])
    assert developer == server.tokenize(messages=[{"role": "system", "content": "Be kind"}])
    empty = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    assert server.tokenize(messages=empty, add_generation_prompt=False)
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {"messages": [{"role": "user", "content": [parts[0], image]}], "max_tokens": 2}
        message = error_of(server.post(path, body), "messages[0].content[1]")
        assert "is an image, but this model is text-only" in message


def test_a_request_chat_template_is_refused_on_tokenize_too(server: InProcessApp) -> None:
    """/tokenize used the server's template silently; chat refused the field with a 400."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ 'x' }}"}
    for path in ("/v1/chat/completions", "/tokenize"):
        assert "not accepted" in error_of(server.post(path, body), "chat_template")
