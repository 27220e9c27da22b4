"""The attention layer: owns its slice of the KV cache and calls the attention backend."""

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged multi-head attention with grouped-query support (arXiv:2305.13245).

    The model runner binds `kv_cache` (this layer's [2, num_blocks, block_size,
    num_kv_heads, head_dim] view) and `backend` before the first forward.

    `k_scale` and `v_scale` ([1] float32 buffers, 1.0 by default) are the per-tensor scales of
    an fp8 KV cache (vLLM's names): the model's `load_weights` fills them from a checkpoint's
    `self_attn.k_scale` / `v_scale` (or `k_proj.output_scale` / `v_proj.output_scale`)
    tensors (`pagedserve.models.kv_scales`); a cache in the model's dtype ignores them.

    `sliding_window` W (Mistral, Gemma 2/3 local layers): a query at position p sees only the
    keys at positions p - W + 1 .. p, as transformers' sliding-window mask and vLLM's
    `window_size=(W - 1, 0)`. `logits_soft_cap` c (Gemma 2): scores become
    c * tanh(scores / c) before the mask and softmax. None turns either off.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.k_scale: torch.Tensor
        self.v_scale: torch.Tensor
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32))

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        assert self.kv_cache is not None and self.backend is not None, "KV cache not bound"
        num_tokens = query.shape[0]
        out = self.backend.forward(
            query.view(num_tokens, self.num_heads, self.head_dim),
            key.view(num_tokens, self.num_kv_heads, self.head_dim),
            value.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            attn_metadata,
            self.scale,
            self.k_scale,
            self.v_scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
