"""Logprob texts, bytes and prompt logprobs through the HTTP API (issue 13 items 3, 4, 6): the
app of build_app() served in-process (httpx over ASGI) by the real AsyncLLMEngine of conftest
(`real_engine`) running the bundled stories260k model, whose SentencePiece pieces carry their
leading space ("▁there")."""

from typing import Any

import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine

from .in_process import AppLoop, InProcessApp

# A template for the bundled model, which has none: the messages' text, one per line.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
ISSUE_REQUEST = {
    "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
    "logprobs": 1,
}  # fmt: skip
CHAT = {
    "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 8,
    "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
}  # fmt: skip


@pytest.fixture(scope="module")
def app(app_loop: AppLoop, real_engine: AsyncLLMEngine) -> InProcessApp:
    return InProcessApp(app_loop, real_engine, "stories", chat_template=CHAT_TEMPLATE)


def streamed_chunks(app: InProcessApp, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed answer ([DONE] checked and left out)."""
    events = app.stream_events(path, body)
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_completion_tokens_keep_their_spaces(app: InProcessApp) -> None:
    """The issue's request: tokens were [",", "there", "was", ...] for ", there was ..."."""
    for stream in (False, True):
        if stream:
            chunks = streamed_chunks(app, "/v1/completions", ISSUE_REQUEST)
            choices = [chunk["choices"][0] for chunk in chunks]
            text = "".join(choice["text"] for choice in choices)
            tokens = [
                t for choice in choices if choice["logprobs"] for t in choice["logprobs"]["tokens"]
            ]
        else:
            response = app.post("/v1/completions", ISSUE_REQUEST)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            text, tokens = choice["text"], choice["logprobs"]["tokens"]
        assert text == ", there was a little girl"
        assert tokens == [",", " there", " was", " a", " little", " g", "ir", "l"]
        assert "".join(tokens) == text


def test_echo_tokens_and_text_offset_index_the_text(app: InProcessApp) -> None:
    body = {**ISSUE_REQUEST, "echo": True, "logprobs": 2}
    choice = app.post("/v1/completions", body).json()["choices"][0]
    logprobs = choice["logprobs"]
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert choice["text"] == "Once upon a time, there was a little girl"
    # "<s>" is not in the echoed text (skip_special_tokens): its token text is "".
    assert tokens[:6] == ["", "Once", " upon", " a", " time", ","]
    assert "".join(tokens) == choice["text"]
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    # Alternatives are spelled in the sampled token's context too (a leading space).
    for top in logprobs["top_logprobs"][1:]:
        assert all(not t.startswith("▁") for t in top)
    assert any(t.startswith(" ") and t.strip() for top in logprobs["top_logprobs"][6:] for t in top)


def test_chat_tokens_and_bytes_make_the_content(app: InProcessApp) -> None:
    for stream in (False, True):
        if stream:
            chunks = streamed_chunks(app, "/v1/chat/completions", CHAT)
            choices = [chunk["choices"][0] for chunk in chunks]
            content_text = "".join(choice["delta"].get("content") or "" for choice in choices)
            content = [e for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
        else:
            choice = app.post("/v1/chat/completions", CHAT).json()["choices"][0]
            content_text, content = choice["message"]["content"], choice["logprobs"]["content"]
        assert len(content) == 8 and content_text
        assert "".join(entry["token"] for entry in content) == content_text
        assert b"".join(bytes(entry["bytes"]) for entry in content).decode() == content_text
        for entry in content:
            for top in entry["top_logprobs"]:
                assert bytes(top["bytes"]) == top["token"].encode()


def _check_prompt_logprobs(prompt_logprobs: Any, prompt_ids: list[int], text: str) -> None:
    """vLLM's form: None first, then {"<token id>": {"logprob", "rank", "decoded_token"}};
    `text`: what the tokens after the first one add."""
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_ids)
    texts = []
    for token_id, position in zip(prompt_ids[1:], prompt_logprobs[1:], strict=True):
        entry = position[str(token_id)]
        assert set(entry) == {"logprob", "rank", "decoded_token"}
        assert entry["logprob"] <= 0.0 and entry["rank"] >= 1
        assert len(position) <= 3  # the prompt token and the top 2
        texts.append(entry["decoded_token"])
    assert "".join(texts) == text


def test_prompt_logprobs_are_returned(app: InProcessApp) -> None:
    prompt_ids = app.post("/tokenize", {"prompt": "Once upon a time"}).json()["tokens"]
    body = {"prompt": "Once upon a time", "max_tokens": 2, "prompt_logprobs": 2}
    for _ in range(2):  # the second time the prompt's blocks are in the prefix cache
        choice = app.post("/v1/completions", body).json()["choices"][0]
        _check_prompt_logprobs(
            choice["prompt_logprobs"], prompt_ids, "Once upon a time"
        )  # after <s>
    chat = {**CHAT, "prompt_logprobs": 2}
    response = app.post("/v1/chat/completions", chat).json()
    chat_ids = app.post("/tokenize", {"messages": CHAT["messages"]}).json()["tokens"]
    _check_prompt_logprobs(response["prompt_logprobs"], chat_ids, " upon a time\n")  # no BOS
    assert "prompt_logprobs" not in response["choices"][0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_with_stream_are_refused(app: InProcessApp, path: str) -> None:
    body = {**(CHAT if "chat" in path else ISSUE_REQUEST), "stream": True, "prompt_logprobs": 1}
    response = app.post(path, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"
