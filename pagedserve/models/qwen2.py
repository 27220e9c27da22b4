"""Qwen2: the Llama architecture with a bias on q/k/v (not on o_proj)."""

from typing import Any, ClassVar

from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    """Llama attention with qkv bias always on and no o_proj bias."""

    @classmethod
    def projection_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM; weights load exactly as Llama's."""

    attention_cls: ClassVar[type[LlamaAttention]] = Qwen2Attention
