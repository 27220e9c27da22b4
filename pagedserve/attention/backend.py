"""The attention backend interface and the function that picks one."""

from typing import Protocol

import torch

from pagedserve.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Writes a layer's new K/V into the paged cache and attends over it.

    KV cache layout of one layer (shared by every backend):
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    index 0 holds keys, 1 values; slot s lives at block s // block_size, offset s % block_size.
    The cache is in the model's dtype, or in fp8 (`--kv-cache-dtype fp8`): then it holds
    K / k_scale and V / v_scale, clamped to the format's range (`attention.kv_quant`), and
    the backend scales them back when it reads them. k_scale and v_scale are device tensors
    (read inside the kernels, so a CUDA graph sees their current values); None means 1.0.
    `sliding_window` and `logits_soft_cap` are the layer's (see `layers.attention.Attention`);
    None means full causal attention and raw scores.
    """

    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
        v_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Return the backend called `name` ("torch", "triton" or "auto").

    "auto" picks Triton on CUDA devices when Triton imports, else the torch reference.
    Raises ValueError for an unknown name or a backend that cannot run on `device`.
    """
    from pagedserve.attention.torch_backend import TorchAttentionBackend

    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention backend 'triton' needs a CUDA device; use 'torch' on CPU")
        from pagedserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch' or 'triton'")


def _triton_available() -> bool:
    try:
        import pagedserve.attention.triton_backend  # noqa: F401
    except ImportError:
        return False
    return True
