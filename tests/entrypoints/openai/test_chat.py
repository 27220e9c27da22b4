"""/v1/chat/completions, /tokenize and /detokenize: in process on the fake engine (with the
Llama 3 tokenizer and its chat template), and chat, whole and streamed, on the real server."""

import re
from typing import Any

import pytest
import transformers

from .conftest import TOKENIZERS

MESSAGES = [
    {"role": "system", "content": "You are a poet. 你是诗人。"},
    {"role": "user", "content": "Write about the sea 🌊"},
]
GREEDY = {"temperature": 0.0}
FIXED_LENGTH = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(TOKENIZERS / "llama3")


def test_chat_prompt_tokenizes_like_transformers(fake_app: Any, hf_tokenizer: Any) -> None:
    expected = hf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert expected.count(hf_tokenizer.bos_token_id) == 1  # the template's BOS, once
    assert fake_app.tokenize(messages=MESSAGES) == expected
    result = fake_app.client().chat.completions.create(
        model=fake_app.model, messages=MESSAGES, max_tokens=3, **GREEDY
    )
    assert result.usage.prompt_tokens == len(expected)


def test_tokenize_and_detokenize(fake_app: Any, hf_tokenizer: Any) -> None:
    text = "Hello 世界 🎉"
    ids = fake_app.tokenize(prompt=text)
    assert ids == hf_tokenizer.encode(text)
    bare = fake_app.tokenize(prompt=text, add_special_tokens=False)
    assert bare == hf_tokenizer.encode(text, add_special_tokens=False)
    response = fake_app.post("/detokenize", {"tokens": bare})
    assert response.status_code == 200 and response.json() == {"prompt": text}
    body = fake_app.post("/tokenize", {"prompt": text}).json()
    assert body["count"] == len(ids) and body["max_model_len"] == 1024


def test_streamed_chat_equals_non_streamed(server: Any, sse: Any) -> None:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 20, **FIXED_LENGTH}
    full = server.post("/v1/chat/completions", {**body, **GREEDY}).json()
    assert full["object"] == "chat.completion"
    message = full["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    raw = server.post("/v1/chat/completions", {**body, **GREEDY, "stream": True}).text
    events = sse(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    deltas = [chunk["choices"][0] for chunk in chunks]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}  # role first, only there
    assert all("role" not in d["delta"] for d in deltas[1:])
    # A delta has only the fields it sets (OpenAI, vLLM): no null role, content, reasoning.
    assert all(None not in d["delta"].values() for d in deltas)
    lines = [line for line in raw.splitlines() if line.startswith("data: {")]
    assert len(lines) == len(chunks) and '"role":"assistant"' in lines[0]
    assert all('"role"' not in line for line in lines[1:])
    assert deltas[-1]["finish_reason"] == "length"  # finish reason last
    assert all(d["finish_reason"] is None for d in deltas[:-1])
    assert "".join(d["delta"].get("content") or "" for d in deltas) == message["content"]
    # and the same through the openai client
    stream = server.client().chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=20, stream=True,
        extra_body=FIXED_LENGTH, **GREEDY,
    )  # fmt: skip
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == message["content"]


def test_chat_include_usage(fake_app: Any) -> None:
    chunks = list(
        fake_app.client().chat.completions.create(
            model=fake_app.model, messages=MESSAGES, max_tokens=7, stream=True,
            stream_options={"include_usage": True}, extra_body=FIXED_LENGTH, **GREEDY,
        )
    )  # fmt: skip
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    assert chunks[-1].choices == []
    num_prompt_tokens = len(fake_app.tokenize(messages=MESSAGES))
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt_tokens, 7)


def test_chat_n_and_logprobs(fake_app: Any) -> None:
    result = fake_app.client().chat.completions.create(
        model=fake_app.model, messages=MESSAGES, max_completion_tokens=5, n=3, seed=1,
        logprobs=True, top_logprobs=3, extra_body=FIXED_LENGTH,
    )  # fmt: skip
    assert [choice.index for choice in result.choices] == [0, 1, 2]
    assert result.usage.completion_tokens == 15
    for choice in result.choices:
        content = choice.logprobs.content
        assert len(content) == 5
        # Token texts in context join to the content (issue 13 item 3); a token that ends
        # inside a character has the text "" and its raw bytes (item 4), as has the one that
        # completes the character (test_chat_logprob_bytes_of_split_characters); a token of
        # whole characters has their bytes.
        assert "".join(entry.token for entry in content) == choice.message.content
        for previous, entry in zip([None, *content], content, strict=False):
            assert entry.logprob <= 0.0
            whole = entry.token and "\ufffd" not in entry.token
            if whole and (previous is None or previous.token):
                assert entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 3
            top = [t.logprob for t in entry.top_logprobs]
            assert top == sorted(top, reverse=True) and entry.logprob <= top[0]


def test_chat_content_parts_and_max_tokens(fake_app: Any) -> None:
    parts = [{"type": "text", "text": "Write about"}, {"type": "text", "text": "the sea 🌊"}]
    as_parts = [MESSAGES[0], {"role": "user", "content": parts}]
    as_text = [MESSAGES[0], {"role": "user", "content": "Write about\nthe sea 🌊"}]
    assert fake_app.tokenize(messages=as_parts) == fake_app.tokenize(messages=as_text)
    result = fake_app.client().chat.completions.create(
        model=fake_app.model, messages=as_parts, max_tokens=4, extra_body=FIXED_LENGTH, **GREEDY
    )
    assert result.usage.completion_tokens == 4
    assert result.choices[0].finish_reason == "length"


def test_continue_final_message(fake_app: Any, hf_tokenizer: Any) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "The sea is"}]
    expected = hf_tokenizer.apply_chat_template(
        messages, continue_final_message=True, return_dict=True
    )["input_ids"]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert fake_app.tokenize(**body) == expected
    response = fake_app.post(
        "/v1/chat/completions",
        {"model": fake_app.model, **body, "max_tokens": 3, **GREEDY, **FIXED_LENGTH},
    )
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == len(
        expected
    )


def test_chat_logprob_bytes_of_split_characters(fake_app: Any, sse: Any) -> None:
    """Issue 13 item 4: "🎉龘" is five byte-level Llama 3 tokens, four of them parts of a
    character. Written in order by the fake engine, each such token's `bytes` are its raw bytes
    (not EF BF BD) and all entries' bytes concatenate to the content; the token texts join to
    it. The alternatives (the script's next tokens) are parts of characters too."""
    text = "🎉龘"
    token_ids = fake_app.tokenize(prompt=text, add_special_tokens=False)
    assert len(token_ids) == 5 and len(set(token_ids)) == 5
    fake_app.engine.write(token_ids)
    body = {
        "messages": MESSAGES, "max_tokens": 5, "logprobs": True, "top_logprobs": 2,
        **FIXED_LENGTH, **GREEDY,
    }  # fmt: skip
    choice = fake_app.post("/v1/chat/completions", body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == text
    assert [entry["token"] for entry in content] == ["", "", "🎉", "", "龘"]
    raw = [bytes(entry["bytes"]) for entry in content]
    assert all(raw) and b"".join(raw[:3]) == "🎉".encode() and b"".join(raw[3:]) == "龘".encode()
    for entry in content:  # alternatives: raw bytes too where they hold part of a character
        assert all(b"\xef\xbf\xbd" not in bytes(top["bytes"]) for top in entry["top_logprobs"])
    chunks = sse(fake_app.post("/v1/chat/completions", {**body, "stream": True}).text)
    streamed = [
        entry for chunk in chunks[:-1] for c in chunk["choices"] if c.get("logprobs")
        for entry in c["logprobs"]["content"]
    ]  # fmt: skip
    assert [bytes(entry["bytes"]) for entry in streamed] == raw


def test_start_up_says_what_it_is_doing(server: Any) -> None:
    """Start-up was silent for tens of seconds; its log names each phase, in order."""
    log = server.log_path.read_text()  # whole: log() keeps the last 5,000 characters
    phases = ["starting the engine for", "loading weights of",
              "Loading safetensors checkpoint shards", "loaded weights in",
              "engine start-up in", "serving"]  # fmt: skip
    positions = [log.find(phase) for phase in phases]
    assert all(p >= 0 for p in positions), log
    assert positions == sorted(positions), log
    # The breakdown's phases, and the time to ready from the process's start.
    breakdown = log[positions[-2] :].splitlines()[0]
    for phase in ("model load", "memory profiling", "KV cache, CUDA graphs and warm-up"):
        assert phase in breakdown, breakdown
    assert re.search(r"serving \S+ on \S+ \(\d+\.\d s after the process started\)", log), log
