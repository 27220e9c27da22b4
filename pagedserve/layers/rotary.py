"""Rotary position embedding (RoPE, arXiv:2104.09864) in HF's rotate-half layout, with scaling."""

import math
from typing import Any

import torch
from torch import nn

from pagedserve.layers.kernels import use_fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def read_rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from an HF config, old or new style.

    transformers < 5 keeps `rope_theta` and `rope_scaling` (with "type" or "rope_type") as
    attributes; transformers >= 5 puts both into the `rope_parameters` dict (and aliases
    `rope_scaling` to it). Returns rope_scaling None for plain RoPE.
    """
    parameters = dict(getattr(hf_config, "rope_scaling", None) or {})
    parameters.update(getattr(hf_config, "rope_parameters", None) or {})
    rope_theta = float(parameters.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    return rope_theta, {**parameters, "rope_type": rope_type}


def _inverse_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:  # [head_dim // 2] float32
    """Per-pair rotation frequencies, scaled as HF's ROPE_INIT_FUNCTIONS do."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = rope_scaling["rope_type"] if rope_scaling else "default"
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":  # positions / factor, applied to the frequencies instead
        return inv_freq / factor
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band
        # between the two cut-offs is interpolated smoothly.
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Rotates each head's (x[i], x[i + head_dim/2]) pairs by position * inv_freq[i].

    cos/sin are precomputed in float32 for positions [0, max_position_embeddings) and cast to
    the query dtype before use, as HF does. One instance can be shared by every layer.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq = _inverse_frequencies(head_dim, rope_theta, rope_scaling)
        positions = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position_embeddings, head_dim // 2]
        cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, head_dim] f32
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        self.cos_sin_cache: torch.Tensor

    def _rotate(
        self,
        x: torch.Tensor,  # [num_tokens, num_heads * head_dim] float
        cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2], dtype of x
        sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2], dtype of x
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim], dtype of x
        num_tokens = x.shape[0]
        x1, x2 = x.view(num_tokens, -1, self.head_dim).chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return rotated.view(num_tokens, -1)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads * head_dim] float
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] float
    ) -> tuple[torch.Tensor, torch.Tensor]:  # shapes and dtypes of query and key
        if use_fused_ops(query):
            from pagedserve.layers.kernels.fused_ops import rotary_embedding

            return rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_dim)
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


def get_rope(hf_config: Any, head_dim: int) -> RotaryEmbedding:
    """The RotaryEmbedding an HF config describes (rope_theta, rope_scaling, context length)."""
    rope_theta, rope_scaling = read_rope_parameters(hf_config)
    return RotaryEmbedding(head_dim, hf_config.max_position_embeddings, rope_theta, rope_scaling)
