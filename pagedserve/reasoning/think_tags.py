"""Thinking between `<think>` and `</think>` (vLLM's BaseThinkingReasoningParser): the base of
the qwen3 and deepseek_r1 parsers."""

from collections.abc import Sequence
from typing import Any

from pagedserve.reasoning.base import ReasoningParser, partial_marker_len


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning is the text before `</think>`, the answer the text after it. A `<think>` at
    the start of the output (after whitespace) is dropped: templates that put `<think>` in
    the prompt (DeepSeek-R1, Qwen3 >= 2507) leave the model only the end marker to write.

    Unlike vLLM, which drops whatever comes before a `<think>` anywhere in the output, only a
    leading one counts here, so that a stream (which cannot take text back) and the whole
    output agree. Raises ValueError when the tokenizer has not both markers as tokens.
    """

    name = "think-tag"
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        vocab = tokenizer.get_vocab()
        missing = [t for t in (self.start_token, self.end_token) if t not in vocab]
        if missing:
            raise ValueError(
                f"the {self.name} reasoning parser needs the tokens {self.start_token!r} and "
                f"{self.end_token!r} in the tokenizer's vocabulary; it lacks {missing}"
            )
        self.start_token_id: int = vocab[self.start_token]
        self.end_token_id: int = vocab[self.end_token]

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True when the last marker among `token_ids` is `</think>` (vLLM's rule)."""
        for token_id in reversed(token_ids):
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    def thinks(self) -> bool:
        """Whether the output holds thinking at all (Qwen3 without thinking holds none)."""
        return True

    def _after_start(self, text: str) -> str | None:
        """The output after a leading `<think>`; None while it may still be arriving."""
        stripped = text.lstrip()
        if stripped.startswith(self.start_token):
            return stripped[len(self.start_token) :]
        if self.start_token.startswith(stripped):  # "", "<", "<th", ...: wait for more
            return None
        return text

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer). No `</think>`: the output stopped while thinking (max_tokens),
        so all of it is reasoning. None for an empty part."""
        if not self.thinks():
            return None, text
        body = self._after_start(text)
        if body is None:  # only whitespace, or a cut-off "<thi"
            body = text
        reasoning, marker, content = body.partition(self.end_token)
        if not marker:
            return body or None, None
        return reasoning or None, content or None

    def extract_reasoning_partial(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if final or not self.thinks():
            return self.extract_reasoning(text)
        body = self._after_start(text)
        if body is None:
            return None, None
        reasoning, marker, content = body.partition(self.end_token)
        if marker:
            return reasoning, content
        # Hold back a "</thi" at the end: the next delta may complete the marker.
        return body[: len(body) - partial_marker_len(body, self.end_token)], None
