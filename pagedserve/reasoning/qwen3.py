"""`--reasoning-parser qwen3` (Qwen3): vLLM's Qwen3ReasoningParser. The model writes
`<think>...</think>` then the answer (Qwen3 >= 2507 templates put the `<think>` in the
prompt); with `chat_template_kwargs={"enable_thinking": false}` the template writes an empty
thinking block into the prompt and the whole output is the answer."""

from typing import Any

from pagedserve.reasoning.base import register_reasoning_parser
from pagedserve.reasoning.think_tags import ThinkTagReasoningParser


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """See ThinkTagReasoningParser. kwargs: `chat_template_kwargs` (a dict or None) of the
    request; its `enable_thinking` (default True, as Qwen3's template) says whether the
    output thinks. Without thinking the whole output is the answer (vLLM splits at a stray
    `</think>` in a whole output but not in a stream; here both give the answer)."""

    name = "qwen3"

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        chat_template_kwargs = kwargs.get("chat_template_kwargs") or {}
        self.thinking_enabled = bool(chat_template_kwargs.get("enable_thinking", True))

    def thinks(self) -> bool:
        return self.thinking_enabled
