"""`--reasoning-parser deepseek_r1` (DeepSeek-R1 and its distills): vLLM's
DeepSeekR1ReasoningParser. The template ends the prompt with `<think>\\n`, so the output is
thinking up to `</think>`, then the answer; an output without `</think>` is all thinking."""

from pagedserve.reasoning.base import register_reasoning_parser
from pagedserve.reasoning.think_tags import ThinkTagReasoningParser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """`<think>` / `</think>` thinking, always on (see ThinkTagReasoningParser)."""

    name = "deepseek_r1"
