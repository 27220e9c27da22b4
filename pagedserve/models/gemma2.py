"""Gemma 2: local (sliding-window) and global attention layers, attention and final logit
soft-capping, GeGLU MLP, (1 + weight) RMSNorms around both sublayers, scaled embeddings.

Follows transformers' modeling_gemma2 (5.x): the per-layer attention kind comes from
`config.layer_types` (default: even layers local, odd layers global), the attention scale is
`query_pre_attn_scalar ** -0.5`, and the LM head is tied to the embedding.
"""

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.layers.attention import Attention
from pagedserve.layers.embedding import VocabParallelEmbedding
from pagedserve.layers.norm import GemmaRMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, get_rope
from pagedserve.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    get_head_dim,
    pre_norm_attention,
)
from pagedserve.quant_config import QuantizationConfig

LOCAL = "sliding_attention"  # transformers' layer_types names
GLOBAL = "full_attention"


def gemma_layer_types(hf_config: Any, period: int) -> list[str]:
    """Each layer's attention kind: `config.layer_types` as transformers 5 sets it, else (a
    config object without it) transformers' default pattern: every `period`-th layer global.

    Raises NotImplementedError for a layer kind other than sliding/full attention, and for
    bidirectional attention (`use_bidirectional_attention`, embedding models).
    """
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise NotImplementedError("use_bidirectional_attention=True is not supported")
    num_layers = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        types = [LOCAL if (i + 1) % period else GLOBAL for i in range(num_layers)]
    unknown = sorted(set(types[:num_layers]) - {LOCAL, GLOBAL})
    if unknown:
        raise NotImplementedError(
            f"layer_types {unknown} are not supported; supported: {LOCAL}, {GLOBAL}"
        )
    return list(types[:num_layers])


def gemma_attention(
    attention: LlamaAttention, hf_config: Any, layer_type: str, logits_soft_cap: float | None
) -> Attention:
    """The paged attention of a Gemma layer: scale query_pre_attn_scalar ** -0.5, the
    config's sliding window on local layers, the given logit soft cap."""
    return Attention(
        attention.num_heads,
        attention.head_dim,
        float(hf_config.query_pre_attn_scalar) ** -0.5,
        attention.num_kv_heads,
        sliding_window=hf_config.sliding_window if layer_type == LOCAL else None,
        logits_soft_cap=logits_soft_cap,
    )


class Gemma2Attention(LlamaAttention):
    """Llama's attention (fused qkv, RoPE) with Gemma's scale, window and logit soft cap
    (`attn_logit_softcapping`)."""

    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        layer_type: str = GLOBAL,
    ) -> None:
        super().__init__(hf_config, rotary_emb, quant_config)
        soft_cap = getattr(hf_config, "attn_logit_softcapping", None)
        self.attn = gemma_attention(self, hf_config, layer_type, soft_cap)


class GemmaDecoderLayer(nn.Module):
    """Gemma 2/3 block: RMSNorm before and after both attention and MLP (four norms).

    x + post_attention_norm(attn(input_norm(x))), then the same with the two feed-forward norms
    around the MLP; the residual stream is carried separately as in `LlamaDecoderLayer`.
    """

    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        attention_cls: Callable[..., LlamaAttention],
        quant_config: QuantizationConfig | None,
        layer_type: str,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(hf_config, rotary_emb, quant_config, layer_type)
        self.mlp = LlamaMLP(hf_config, quant_config, hidden_act=hf_config.hidden_activation)
        size, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
        residual: torch.Tensor | None,  # [num_tokens, hidden_size] float; None in layer 0
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (hidden_states, residual), both [T, hidden_size]
        hidden_states, residual = pre_norm_attention(
            self.input_layernorm, self.self_attn, positions, hidden_states, residual, attn_metadata
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma2Model(nn.Module):
    """Scaled embedding, Gemma decoder layers and final norm (HF's `model.` prefix)."""

    # transformers' default layer pattern when a config lists no layer_types: every
    # `global_layer_period`-th layer is global.
    global_layer_period: ClassVar[int] = 2

    def __init__(
        self,
        hf_config: Any,
        attention_cls: Callable[..., LlamaAttention],
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        # sqrt(hidden_size) rounded to the model dtype, as transformers multiplies it.
        self.embed_scale: torch.Tensor
        self.register_buffer(
            "embed_scale", torch.tensor(hf_config.hidden_size**0.5), persistent=False
        )
        layer_types = gemma_layer_types(hf_config, self.global_layer_period)
        rotary_embs = self.rotary_embeddings(hf_config, get_head_dim(hf_config))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(hf_config, rotary_embs[kind], attention_cls, quant_config, kind)
            for kind in layer_types
        )
        self.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    @classmethod
    def rotary_embeddings(cls, hf_config: Any, head_dim: int) -> dict[str, RotaryEmbedding]:
        """The RoPE of each layer kind; Gemma 2 shares one."""
        rotary_emb = get_rope(hf_config, head_dim)
        return {LOCAL: rotary_emb, GLOBAL: rotary_emb}

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        normed: torch.Tensor = self.norm(hidden_states, residual)[0]
        return normed


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 for paged inference; checkpoint names load as Llama's (q/k/v and gate/up fused),
    the four norms and the tied LM head keep their HF names.

    Final logits are soft-capped, cap * tanh(logits / cap) with `final_logit_softcapping`,
    computed on the float32 logits (transformers: in the model dtype; equal in float32).
    """

    attention_cls: ClassVar[type[LlamaAttention]] = Gemma2Attention
    model_cls: ClassVar[type[Gemma2Model]] = Gemma2Model
    supports_pp: ClassVar[bool] = False  # Gemma2Model builds every layer

    def build_model(self, hf_config: Any, quant_config: QuantizationConfig | None) -> nn.Module:
        return self.model_cls(hf_config, self.attention_cls, quant_config)

    def compute_logits(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
    ) -> torch.Tensor:  # [num_tokens, vocab_size] float32
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
