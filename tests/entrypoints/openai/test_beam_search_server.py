"""Beam search through the server (`use_beam_search`, vLLM's extra): the choices equal
`LLM.beam_search` on the same model, in completions and chat; what beam search does not
apply is a 400 naming it. Served in-process by the real engine of conftest (stories260k)."""

from collections.abc import Iterator
from typing import Any

import pytest

from pagedserve import LLM
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.sampling_params import BeamSearchParams

from .conftest import REAL_MAX_MODEL_LEN
from .in_process import AppLoop, InProcessApp

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def app(app_loop: AppLoop, real_engine: AsyncLLMEngine) -> InProcessApp:
    return InProcessApp(app_loop, real_engine, "stories", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    llm = LLM(device="cpu", max_model_len=REAL_MAX_MODEL_LEN, kv_cache_memory_bytes=8 * 2**20)
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()


def offline_texts(llm: LLM, prompt_token_ids: list[int], width: int, **kwargs: Any) -> list[str]:
    """The generated text of each of LLM.beam_search's sequences, best first (a final EOS left
    out of the text, as vLLM's server does)."""
    [output] = llm.beam_search(
        [{"prompt_token_ids": prompt_token_ids}], BeamSearchParams(width, **kwargs)
    )
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    texts = []
    for sequence in output.sequences:
        generated = sequence.tokens[len(prompt_token_ids) :]
        if generated and generated[-1] == eos:
            generated = generated[:-1]
        texts.append(tokenizer.decode(generated, skip_special_tokens=True))
    return texts


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_completion_beams_equal_offline_beam_search(
    app: InProcessApp, offline: LLM, length_penalty: float
) -> None:
    body = {
        "prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 12, "temperature": 0,
        "length_penalty": length_penalty,
    }  # fmt: skip
    response = app.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    prompt_ids = offline.get_tokenizer().encode(PROMPT)
    expected = offline_texts(offline, prompt_ids, 3, max_tokens=12, length_penalty=length_penalty)
    assert [c["text"] for c in choices] == expected
    assert len(set(expected)) == 3  # three different beams, not one answer three times
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)


def test_two_prompts_and_chat_beams_equal_offline(app: InProcessApp, offline: LLM) -> None:
    tokenizer = offline.get_tokenizer()
    prompts = [PROMPT, "The little dog"]
    body = {"prompt": prompts, "use_beam_search": True, "n": 2, "max_tokens": 6}
    response = app.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    texts = [c["text"] for c in response.json()["choices"]]
    expected = [
        text
        for p in prompts
        for text in offline_texts(offline, tokenizer.encode(p), 2, max_tokens=6, temperature=1.0)
    ]
    assert texts == expected
    chat = {
        "messages": [{"role": "user", "content": PROMPT}], "use_beam_search": True, "n": 2,
        "max_tokens": 6,
    }  # fmt: skip
    response = app.post("/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    chat_ids = tokenizer.encode(PROMPT + "\n", add_special_tokens=False)
    contents = [c["message"]["content"] for c in response.json()["choices"]]
    assert contents == offline_texts(offline, chat_ids, 2, max_tokens=6)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"top_p": 0.5}, "top_p"),
        ({"logprobs": 1}, "logprobs"),
        ({"stop": ["."]}, "stop"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"seed": 3}, "seed"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"n": 11}, "n"),  # 2 * 11 logprobs per step > max_logprobs (20)
        ({"best_of": 4}, "best_of"),
    ],
)
def test_what_beam_search_does_not_apply_is_400(
    app: InProcessApp, extra: dict[str, Any], param: str
) -> None:
    body = {"prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 4, **extra}
    response = app.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    # Their no-op values and a request without beam search are fine.
    no_ops = {"top_p": 1.0, "stop": [], "seed": None, "stream": False, "logprobs": None}
    ok = {"prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 4, **no_ops}
    assert app.post("/v1/completions", ok).status_code == 200


def test_length_penalty_without_beam_search_is_400(app: InProcessApp) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "length_penalty": 0.5}
    response = app.post("/v1/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "length_penalty"
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "length_penalty": 2}
    assert app.post("/v1/chat/completions", chat).json()["error"]["param"] == "length_penalty"
    body["length_penalty"] = 1.0
    assert app.post("/v1/completions", body).status_code == 200


def test_truncate_prompt_tokens_applies_to_beam_search(app: InProcessApp, offline: LLM) -> None:
    """The beams continue the prompt's last k tokens, as other requests' truncation (it was
    silently ignored: the beams continued the whole prompt)."""
    prompt_ids = offline.get_tokenizer().encode(PROMPT)
    body = {
        "prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 4,
        "truncate_prompt_tokens": 2,
    }  # fmt: skip
    response = app.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 2
    texts = [c["text"] for c in response.json()["choices"]]
    assert texts == offline_texts(offline, prompt_ids[-2:], 2, max_tokens=4, temperature=1.0)
    body["truncate_prompt_tokens"] = REAL_MAX_MODEL_LEN + 1
    response = app.post("/v1/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_explicit_max_tokens_that_does_not_fit_is_400(app: InProcessApp) -> None:
    """As for other requests (it was silently capped: a max_tokens of a million ran beam
    search to the end of the context); a default max_tokens is still capped."""
    body = {
        "prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": REAL_MAX_MODEL_LEN,
    }  # fmt: skip
    response = app.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "max_tokens"
    assert "exceeds max_model_len" in response.json()["error"]["message"]
    messages = [{"role": "user", "content": PROMPT}]
    chat = {"messages": messages, "use_beam_search": True, "n": 2, "max_completion_tokens": 10**6}
    response = app.post("/v1/chat/completions", chat)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "max_completion_tokens"
    long_prompt = {"prompt": [1] * REAL_MAX_MODEL_LEN, "use_beam_search": True, "n": 2}
    assert app.post("/v1/completions", long_prompt).json()["error"]["param"] == "prompt"
    default = {"prompt": [1] * (REAL_MAX_MODEL_LEN - 2), "use_beam_search": True, "n": 2}
    response = app.post("/v1/completions", default)  # max_tokens 16 left out: capped to 2
    assert response.status_code == 200, response.text
    assert all(len(c["text"]) > 0 for c in response.json()["choices"])


def test_skip_special_tokens_false_keeps_them_in_beam_text(fake_app: InProcessApp) -> None:
    """skip_special_tokens was ignored by beam search (its text always left them out). On the
    fake engine, whose script here is EOS only, each beam is EOS tokens (ignore_eos)."""
    tokenizer = fake_app.engine.get_tokenizer()
    fake_app.engine.write([tokenizer.eos_token_id])
    eos_text = tokenizer.decode([tokenizer.eos_token_id])
    body = {"prompt": "x", "use_beam_search": True, "n": 1, "ignore_eos": True, "max_tokens": 3}
    response = fake_app.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == ""
    response = fake_app.post("/v1/completions", {**body, "skip_special_tokens": False})
    assert response.json()["choices"][0]["text"] == 3 * eos_text, response.text
