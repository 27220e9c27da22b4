"""The reasoning parsers qwen3 and deepseek_r1 on outputs the models write, whole and
streamed token by token with the real Qwen3 tokenizer (whose <think> / </think> are tokens)."""

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import transformers

from pagedserve.reasoning import ReasoningParser, get_reasoning_parser

TOKENIZERS = Path(__file__).resolve().parents[2].parent / "shared" / "tokenizers"


@cache
def tokenizer(name: str) -> Any:
    return transformers.AutoTokenizer.from_pretrained(TOKENIZERS / name)


def stream(parser: ReasoningParser, text: str, tokenizer_name: str = "qwen3") -> tuple[str, str]:
    """(reasoning, content) joined from `extract_reasoning_streaming` over the text's tokens,
    decoded one more token at a time, then what the end releases (`..._partial(final)`)."""
    tok = tokenizer(tokenizer_name)
    ids = tok.encode(text, add_special_tokens=False)
    previous, reasoning, content = "", "", ""
    for i in range(1, len(ids) + 1):
        current = tok.decode(ids[:i])
        if current.endswith("\ufffd"):
            continue  # a character split over tokens: the detokenizer holds it back too
        delta = parser.extract_reasoning_streaming(
            previous, current, current[len(previous) :], ids[: i - 1], ids[:i], ids[i - 1 : i]
        )
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
        previous = current
    assert previous == text
    # The end releases only a held-back, cut-off marker; the rest was streamed already.
    last_reasoning, last_content = parser.extract_reasoning_partial(text, final=True)
    held_reasoning = (last_reasoning or "").removeprefix(reasoning)
    held_content = (last_content or "").removeprefix(content)
    assert len(held_reasoning) < len("</think>") and not held_content, (reasoning, content)
    return reasoning + held_reasoning, content + held_content


CASES = [
    # (parser, output, reasoning, content)
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n",
     "\n\nHello!"),
    ("qwen3", "Thinking without end", "Thinking without end", None),  # cut off by max_tokens
    ("qwen3", "\n<think>a</think>", "a", None),
    ("qwen3", "Pondering </thi", "Pondering </thi", None),  # a cut-off marker is reasoning
    ("deepseek_r1", "Let me think. 1+1=2.\n</think>\n\nThe answer is 2.",
     "Let me think. 1+1=2.\n", "\n\nThe answer is 2."),
    ("deepseek_r1", "<think>x</think>y", "x", "y"),
    ("deepseek_r1", "no end marker yet", "no end marker yet", None),
    ("deepseek_r1", "</think>only answer", None, "only answer"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "output", "reasoning", "content"), CASES)
def test_whole_and_streamed_outputs(
    name: str, output: str, reasoning: str | None, content: str | None
) -> None:
    parser = get_reasoning_parser(name, tokenizer("qwen3"))
    assert parser.extract_reasoning(output) == (reasoning, content)
    streamed = stream(get_reasoning_parser(name, tokenizer("qwen3")), output)
    assert streamed == (reasoning or "", content or "")


def test_stream_sends_reasoning_before_the_end_marker() -> None:
    """Reasoning is streamed as it is written, not held until </think>; a cut-off marker
    ("</thi") is held back until the next delta says what it is."""
    parser = get_reasoning_parser("deepseek_r1", tokenizer("qwen3"))
    delta = parser.extract_reasoning_streaming("", "Hmm, ", "Hmm, ", [], [], [])
    assert delta is not None and delta.reasoning == "Hmm, " and delta.content is None
    assert parser.extract_reasoning_streaming("Hmm, ", "Hmm, </thi", "</thi", [], [], []) is None
    delta = parser.extract_reasoning_streaming("Hmm, </thi", "Hmm, </think>ok", "nk>ok", [], [], [])
    assert delta is not None and delta.reasoning is None and delta.content == "ok"


def test_qwen3_without_thinking_is_all_content() -> None:
    """chat_template_kwargs enable_thinking=false: the template wrote an empty thinking
    block into the prompt, the output is the answer (vLLM's Qwen3ReasoningParser)."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    parser = get_reasoning_parser("qwen3", tokenizer("qwen3"), **off)
    assert parser.extract_reasoning("Hello there") == (None, "Hello there")
    assert stream(get_reasoning_parser("qwen3", tokenizer("qwen3"), **off), "Hi!") == ("", "Hi!")


def test_is_reasoning_end() -> None:
    tok = tokenizer("qwen3")
    for name in ("qwen3", "deepseek_r1"):
        parser = get_reasoning_parser(name, tok)
        ids = tok.encode("<think>a</think>b", add_special_tokens=False)
        assert parser.is_reasoning_end(ids)
        assert not parser.is_reasoning_end(ids[:-2])  # before </think>
        assert not parser.is_reasoning_end(tok.encode("a</think>b<think>c"))  # thinks again
        assert not parser.is_reasoning_end([])


def test_unknown_names_and_missing_markers() -> None:
    with pytest.raises(ValueError, match="valid names: \\['deepseek_r1', 'qwen3'\\]"):
        get_reasoning_parser("nope", tokenizer("qwen3"))
    with pytest.raises(ValueError, match="lacks \\['<think>', '</think>'\\]"):
        get_reasoning_parser("deepseek_r1", tokenizer("llama3"))
