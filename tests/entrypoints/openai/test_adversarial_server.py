"""Adversarial requests to the real server: each case was a 500, or killed the engine core so
that every later request got a 503."""

import json
from typing import Any

import httpx
import pytest
import transformers

CHAT = [{"role": "user", "content": "Hello"}]


def assert_400(response: httpx.Response, param: str | None, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)
    for word in words:
        assert word in error["message"], (word, error["message"])


@pytest.fixture(autouse=True)
def engine_survives_and_is_idle(server: Any) -> Any:
    yield
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    server.wait_metrics(
        lambda m: (
            m["pagedserve:num_requests_running"] == 0 and m["pagedserve:kv_cache_usage_perc"] == 0
        )
    )


@pytest.mark.parametrize("stream", [False, True])
def test_every_token_banned_does_not_kill_the_engine(server: Any, stream: bool) -> None:
    """Only EOS allowed, but EOS banned before min_tokens: the softmax was NaN, the sampled id
    fell outside the vocabulary and the engine core died (503 for everyone after)."""
    eos = transformers.AutoTokenizer.from_pretrained(server.model).eos_token_id
    body = {
        "prompt": "Hi",
        "max_tokens": 4,
        "allowed_token_ids": [eos],
        "min_tokens": 2,
        "stream": stream,
    }
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert "error" not in response.text


def test_infinite_logits_do_not_kill_the_engine(server: Any) -> None:
    body = {"messages": CHAT, "max_tokens": 3, "repetition_penalty": 2e-38, "logprobs": True}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    body["repetition_penalty"] = 1e-40  # 0 in float32: banned tokens became NaN, then likely
    assert_400(server.post("/v1/chat/completions", body), "repetition_penalty", "float32")


@pytest.mark.parametrize("stream", [False, True])
def test_top_p_below_float32_does_not_kill_the_engine(server: Any, stream: bool) -> None:
    """top_p = 1e-46 is 0 in float32: the nucleus kept no token, the sampler indexed -1 and
    the engine core died (503 for every request after, with the traceback in the body)."""
    body = {"prompt": "Hi", "max_tokens": 3, "top_p": 1e-46, "temperature": 1.0, "stream": stream}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert "error" not in response.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "top_k": 2**63}, "top_k"),
        ("/v1/completions", {"prompt": "Hi", "top_k": 2**70}, "top_k"),
        ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 2**64}, "min_tokens"),
    ],
)
def test_ints_beyond_64_bits_are_400(server: Any, path: str, body: dict, param: str) -> None:
    """They overflowed the sampler's int64 tables in the engine core, which died."""
    assert_400(server.post(path, body), param, "64 bits")


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", '"prompt": "a\\ud800b"', "prompt"),
        ("/v1/completions", '"prompt": ["ok", "\\udfff"]', "prompt"),
        ("/v1/completions", '"prompt": "Hi", "stop": ["\\ud800"]', "stop"),
        ("/v1/completions", '"prompt": "Hi", "bad_words": ["\\ud800"]', "bad_words"),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": "\\ud800"}]',
         "messages.0.content"),
        ("/tokenize", '"prompt": "\\ud800"', None),
    ],
)  # fmt: skip
def test_lone_surrogates_are_400(server: Any, path: str, fields: str, param: str | None) -> None:
    """JSON can spell a lone surrogate; the tokenizer and msgpack refused it with a 500."""
    headers = {**server.headers, "Content-Type": "application/json"}
    response = httpx.post(
        f"{server.url}{path}", content="{" + fields + "}", headers=headers, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    if param is not None:
        assert error["param"] == param and "surrogate" in error["message"]


def test_surrogate_pairs_are_fine(server: Any) -> None:
    headers = {**server.headers, "Content-Type": "application/json"}
    body = json.dumps({"prompt": "smile \U0001f600", "max_tokens": 2})  # ASCII: "\\ud83d\\ude00"
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 200, response.text


def test_max_completion_tokens_0_is_400(server: Any) -> None:
    """It was read as "unset" (`or`) and generated up to the rest of the context."""
    body = {"messages": CHAT, "max_completion_tokens": 0}
    assert_400(server.post("/v1/chat/completions", body), "max_tokens", "at least 1")


def test_wrong_method_is_not_an_internal_error(server: Any) -> None:
    response = server.get("/v1/completions")
    assert response.status_code == 405
    assert response.json()["error"]["type"] != "InternalServerError"
