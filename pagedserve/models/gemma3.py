"""Gemma 3 (text only, Gemma3ForCausalLM): Gemma 2 plus q/k RMSNorms, no attention soft cap,
five local layers per global one, and a RoPE per layer kind (local: `rope_local_base_freq`,
unscaled; global: `rope_theta` with `rope_scaling`, e.g. linear x8 in the 4B model).

transformers >= 5 keeps the two RoPEs as `rope_parameters[layer_type]`; a config object
without that nesting (transformers 4 attributes) is read from `rope_local_base_freq`,
`rope_theta` and `rope_scaling`.
"""

from typing import Any, ClassVar

from pagedserve.layers.norm import GemmaRMSNorm, RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, get_rope
from pagedserve.models.gemma2 import (
    GLOBAL,
    LOCAL,
    Gemma2ForCausalLM,
    Gemma2Model,
    gemma_attention,
)
from pagedserve.models.llama import LlamaAttention
from pagedserve.models.qwen3 import Qwen3Attention
from pagedserve.quant_config import QuantizationConfig


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (q/k norms before RoPE) with Gemma's norms, scale and window. As in
    transformers, `attn_logit_softcapping` is not applied."""

    qk_norm_cls: ClassVar[type[RMSNorm]] = GemmaRMSNorm

    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        layer_type: str = GLOBAL,
    ) -> None:
        super().__init__(hf_config, rotary_emb, quant_config)
        self.attn = gemma_attention(self, hf_config, layer_type, None)


class Gemma3Model(Gemma2Model):
    """Gemma 2's model with Gemma 3's layer pattern and per-kind RoPE."""

    global_layer_period: ClassVar[int] = 6

    @classmethod
    def rotary_embeddings(cls, hf_config: Any, head_dim: int) -> dict[str, RotaryEmbedding]:
        nested = getattr(hf_config, "rope_parameters", None) or {}
        if all(isinstance(nested.get(kind), dict) for kind in (LOCAL, GLOBAL)):
            return {kind: get_rope(hf_config, head_dim, kind) for kind in (LOCAL, GLOBAL)}
        local_theta = float(getattr(hf_config, "rope_local_base_freq", 10000.0))
        return {
            LOCAL: RotaryEmbedding(head_dim, hf_config.max_position_embeddings, local_theta),
            GLOBAL: get_rope(hf_config, head_dim),
        }


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text model (the 1B checkpoint, or the language model of a larger one saved as
    Gemma3ForCausalLM); weights load as Gemma 2's, q_norm/k_norm keep their HF names."""

    attention_cls: ClassVar[type[LlamaAttention]] = Gemma3Attention
    model_cls: ClassVar[type[Gemma2Model]] = Gemma3Model
