"""Qwen3: the Llama architecture with per-head RMSNorm on q and k before RoPE."""

from typing import Any, ClassVar

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM
from pagedserve.quant_config import QuantizationConfig


class Qwen3Attention(LlamaAttention):
    """Llama attention plus q_norm/k_norm, each an RMSNorm over head_dim shared by all heads."""

    qk_norm_cls: ClassVar[type[RMSNorm]] = RMSNorm  # Gemma 3: GemmaRMSNorm

    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(hf_config, rotary_emb, quant_config)
        self.q_norm = self.qk_norm_cls(self.head_dim, hf_config.rms_norm_eps)
        self.k_norm = self.qk_norm_cls(self.head_dim, hf_config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        q, k, v = self.split_qkv(self.qkv_proj(hidden_states))
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q.view(num_tokens, -1), k.view(num_tokens, -1))
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, attn_metadata))
        return out


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM; weights load as Llama's (q_norm/k_norm keep their HF names)."""

    attention_cls: ClassVar[type[LlamaAttention]] = Qwen3Attention
