"""The reasoning parser base class and its registry (re-exported by `pagedserve.reasoning`).

Source: vLLM's `vllm/reasoning/abs_reasoning_parsers.py` (`ReasoningParser`,
`ReasoningParserManager`). The engine uses `is_reasoning_end` to start a constrained answer
after the thinking; the server uses `extract_reasoning` (a whole output) and
`extract_reasoning_partial` / `extract_reasoning_streaming` (an output still growing) for the
message's `reasoning` field.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.config import REASONING_PARSERS


@dataclass(frozen=True, slots=True)
class DeltaReasoning:
    """What one streamed step adds: to the reasoning, to the answer (None: nothing)."""

    reasoning: str | None = None
    content: str | None = None


class ReasoningParser(ABC):
    """Finds the thinking part of a model's output (text and token ids).

    tokenizer: the model's Hugging Face tokenizer (the parser looks up its marker tokens,
    e.g. `<think>` / `</think>`, and raises ValueError naming them when absent).
    kwargs: the request's `chat_template_kwargs` as `chat_template_kwargs=` (vLLM passes them
    too: Qwen3's `enable_thinking=False` means the output holds no thinking).
    """

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the thinking is over in these output token ids (so far)."""

    @abstractmethod
    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output text; None for a part that is absent."""

    def extract_reasoning_partial(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) known for sure of an output that may still grow: each part is
        a prefix of what it will be once more text comes (so a stream can send the growth of
        each as deltas). With `final` (the output is complete) it is `extract_reasoning`.
        This default holds everything back until the end; parsers override it."""
        return self.extract_reasoning(text) if final else (None, None)

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaReasoning | None:
        """What `delta_text` adds to the reasoning and to the answer (vLLM's signature; None
        when it adds nothing yet, e.g. part of an end marker). The output is not known to be
        complete: a last, held-back part comes from `extract_reasoning_partial(text, True)`."""
        old_reasoning, old_content = self.extract_reasoning_partial(previous_text, False)
        reasoning, content = self.extract_reasoning_partial(current_text, False)
        reasoning_delta = (reasoning or "")[len(old_reasoning or "") :]
        content_delta = (content or "")[len(old_content or "") :]
        if not reasoning_delta and not content_delta:
            return None
        return DeltaReasoning(reasoning_delta or None, content_delta or None)


_REGISTRY: dict[str, Callable[..., ReasoningParser]] = {}


def register_reasoning_parser(
    name: str,
) -> Callable[[Callable[..., ReasoningParser]], Callable[..., ReasoningParser]]:
    """Class decorator registering a parser under `name` (one of config.REASONING_PARSERS;
    raises ValueError otherwise, so that the CLI's choices and the registry agree)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"{name!r} is not in config.REASONING_PARSERS {REASONING_PARSERS}")

    def register(cls: Callable[..., ReasoningParser]) -> Callable[..., ReasoningParser]:
        _REGISTRY[name] = cls
        return cls

    return register


def get_reasoning_parser(name: str, tokenizer: Any, **kwargs: Any) -> ReasoningParser:
    """The parser `name` for `tokenizer` (kwargs: see ReasoningParser). Raises ValueError
    listing the valid names, or naming the marker tokens the tokenizer lacks."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reasoning parser {name!r}; valid names: {sorted(_REGISTRY)}")
    return _REGISTRY[name](tokenizer, **kwargs)


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` without being all of it: the
    characters a stream holds back, since the next delta may complete the marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
