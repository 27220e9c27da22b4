"""Reasoning parsers: split a thinking model's output into its reasoning and its answer.

Source: vLLM's `vllm/reasoning` (`ReasoningParser`, `--reasoning-parser NAME`). The engine
uses `is_reasoning_end` to start a constrained answer after the thinking; the server uses
`extract_reasoning` / `extract_reasoning_streaming` for the message's `reasoning_content`.
Each name of `pagedserve.config.REASONING_PARSERS` is registered here by its module.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.config import REASONING_PARSERS


class ReasoningParser(ABC):
    """Finds the thinking part of a model's output (text and token ids).

    tokenizer: the model's Hugging Face tokenizer (the parser looks up its marker tokens,
    e.g. `<think>` / `</think>`, and raises ValueError naming them when absent).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the thinking is over in these output token ids (so far)."""

    @abstractmethod
    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output text; None for a part that is absent."""


_REGISTRY: dict[str, Callable[[Any], ReasoningParser]] = {}


def register_reasoning_parser(
    name: str,
) -> Callable[[Callable[[Any], ReasoningParser]], Callable[[Any], ReasoningParser]]:
    """Class decorator registering a parser under `name` (one of config.REASONING_PARSERS;
    raises ValueError otherwise, so that the CLI's choices and the registry agree)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"{name!r} is not in config.REASONING_PARSERS {REASONING_PARSERS}")

    def register(cls: Callable[[Any], ReasoningParser]) -> Callable[[Any], ReasoningParser]:
        _REGISTRY[name] = cls
        return cls

    return register


def get_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser `name` for `tokenizer`. Raises ValueError listing the valid names."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reasoning parser {name!r}; valid names: {sorted(_REGISTRY)}")
    return _REGISTRY[name](tokenizer)
