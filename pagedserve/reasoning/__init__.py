"""Reasoning parsers: split a thinking model's output into its reasoning and its answer.

Source: vLLM's `vllm/reasoning` (`ReasoningParser`, `--reasoning-parser NAME`). The engine
uses `is_reasoning_end` to start a constrained answer after the thinking; the server uses
`extract_reasoning` / `extract_reasoning_streaming` for the message's `reasoning` field.
Each name of `pagedserve.config.REASONING_PARSERS` is registered by its module, imported
here (the base class and the registry live in `base`, so that the modules import no circle).
"""

from pagedserve.reasoning import deepseek_r1, qwen3
from pagedserve.reasoning.base import (
    DeltaReasoning,
    ReasoningParser,
    get_reasoning_parser,
    register_reasoning_parser,
)

__all__ = [
    "DeltaReasoning",
    "ReasoningParser",
    "deepseek_r1",
    "get_reasoning_parser",
    "qwen3",
    "register_reasoning_parser",
]
