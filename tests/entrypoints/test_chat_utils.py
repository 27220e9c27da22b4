"""chat_utils: the message normalisation and chat rendering that `LLM.chat` and the server
share, on real tokenizers (no model)."""

from pathlib import Path
from typing import Any

import pytest
import transformers

from pagedserve.entrypoints.chat_utils import normalize_messages, render_chat, takes_content_parts
from pagedserve.errors import InvalidRequestError

TOKENIZERS = Path(__file__).resolve().parents[3] / "shared" / "tokenizers"


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    return {
        name: transformers.AutoTokenizer.from_pretrained(TOKENIZERS / name)
        for name in ("qwen3", "llama3", "gpt2", "sentencepiece-32k")
    }


def test_text_parts_render_like_a_string(tokenizers: dict[str, Any]) -> None:
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    for name in ("qwen3", "llama3"):
        rendered = render_chat(tokenizers[name], [{"role": "user", "content": parts}])
        expected = render_chat(tokenizers[name], [{"role": "user", "content": "Hi\nthere"}])
        assert rendered == expected and "Hi\nthere" in rendered[0]


def test_message_shapes() -> None:
    messages = [
        {"role": "developer", "content": "Be brief", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert normalize_messages(messages) == [
        {"role": "system", "content": "Be brief", "name": "ops"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([], "non-empty list"),
        ("Hi", "non-empty list"),
        (["Hi"], r"messages\[0\] must be a dict"),
        ([{"content": "Hi"}], r"messages\[0\] needs a 'role'"),
        ([{"role": "user", "content": 3}], "content must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"content\[0\] has type 'image_url', which pagedserve does not support",
        ),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "'input_audio'"),
        ([{"role": "user", "content": ["Hi"]}], r"content\[0\] has type str"),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], "text must be a str"),
    ],
)
def test_bad_messages_are_invalid_requests(messages: Any, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as error:
        normalize_messages(messages)
    assert error.value.param == "messages"


def test_add_special_tokens_adds_them_on_top_of_the_template(tokenizers: dict[str, Any]) -> None:
    """vLLM's chat `add_special_tokens`: the tokenizer's special tokens are added when the
    rendered text is encoded. A SentencePiece tokenizer adds BOS, so with a template that
    holds one True doubles it (which is why the default is False); tokenizers that add
    nothing (Qwen3, this Llama 3) give the same ids either way."""
    messages = [{"role": "user", "content": "Hi"}]
    sentencepiece = tokenizers["sentencepiece-32k"]
    template = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"
    _, plain = render_chat(sentencepiece, messages, template)
    assert plain.count(sentencepiece.bos_token_id) == 1 and plain[0] == sentencepiece.bos_token_id
    _, doubled = render_chat(sentencepiece, messages, template, add_special_tokens=True)
    assert doubled == [sentencepiece.bos_token_id, *plain]
    for name in ("qwen3", "llama3"):
        tokenizer = tokenizers[name]
        _, ids = render_chat(tokenizer, messages)
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert ids == expected["input_ids"]
        assert render_chat(tokenizer, messages, add_special_tokens=True)[1] == ids


def test_template_errors_are_invalid_requests(tokenizers: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError, match="no chat template") as error:
        render_chat(tokenizers["gpt2"], [{"role": "user", "content": "Hi"}])
    assert error.value.param == "messages"
    failing = "{{ raise_exception('no system messages') }}"
    with pytest.raises(InvalidRequestError, match="template refused.*no system messages"):
        render_chat(tokenizers["gpt2"], [{"role": "user", "content": "Hi"}], failing)
    # Other failures name internals: a general message, the details in __cause__.
    with pytest.raises(InvalidRequestError, match="could not render") as error:
        render_chat(tokenizers["gpt2"], [{"role": "user", "content": "Hi"}], "{{ x.y.z }}")
    assert error.value.__cause__ is not None
    with pytest.raises(InvalidRequestError, match="continue_final_message") as error:
        render_chat(
            tokenizers["qwen3"], [{"role": "user", "content": "Hi"}], continue_final_message=True
        )
    assert error.value.param == "continue_final_message"


@pytest.mark.parametrize(
    ("template", "takes_parts"),
    [
        ("{% for message in messages %}{{ message['content'] }}{% endfor %}", False),
        ("{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}", True),
        ("{% for p in message['content'] | selectattr('type', 'equalto', 'image') %}", True),
        ("{% for p in message.content %}{{ p }}{% endfor %}", True),
        (None, False),
    ],
)
def test_content_format_of_a_template(template: str | None, takes_parts: bool) -> None:
    """A template that iterates over (or filters) a message's content gets content parts
    (vLLM's "openai" content format); one that prints it gets a string."""
    assert takes_content_parts(template) is takes_parts
