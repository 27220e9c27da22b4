"""Rotary position embedding (RoPE, arXiv:2104.09864) in HF's rotate-half layout, with scaling."""

import math
from typing import Any

import torch
from torch import nn

from pagedserve.layers.kernels import use_fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def read_rope_parameters(
    hf_config: Any, layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from an HF config, old or new style.

    transformers < 5 keeps `rope_theta` and `rope_scaling` (with "type" or "rope_type") as
    attributes; transformers >= 5 puts both into the `rope_parameters` dict (and aliases
    `rope_scaling` to it). Models with per-layer-type RoPE (Gemma 3) nest one such dict per
    `layer_type` ("sliding_attention", "full_attention") in `rope_parameters`; pass the
    layer type to read its own. Returns rope_scaling None for plain RoPE. Phi-3's old names
    "su" and "yarn" read as "longrope", as transformers' Phi3Config does.
    """
    nested = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(nested.get(layer_type), dict):
        parameters = dict(nested[layer_type])
    else:
        parameters = dict(getattr(hf_config, "rope_scaling", None) or {})
        parameters.update(nested)
    rope_theta = float(parameters.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type in ("su", "yarn") and "short_factor" in parameters:
        rope_type = "longrope"
    if rope_type == "default":
        return rope_theta, None
    return rope_theta, {**parameters, "rope_type": rope_type}


def _inverse_frequencies(
    head_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
    max_model_len: int,
) -> tuple[torch.Tensor, float]:  # [head_dim // 2] float32, cos/sin scale
    """Per-pair rotation frequencies and the factor cos/sin are multiplied by, scaled as HF's
    ROPE_INIT_FUNCTIONS do."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = rope_scaling["rope_type"] if rope_scaling else "default"
    if rope_type == "default":
        return inv_freq, 1.0
    assert rope_scaling is not None
    if rope_type == "longrope":
        return _longrope(
            rope_scaling, rope_theta, exponents, max_position_embeddings, max_model_len
        )
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":  # positions / factor, applied to the frequencies instead
        return inv_freq / factor, 1.0
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
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _longrope(
    rope_scaling: dict[str, Any],
    rope_theta: float,
    exponents: torch.Tensor,  # [head_dim // 2] float32, 2i / head_dim
    max_position_embeddings: int,
    max_model_len: int,
) -> tuple[torch.Tensor, float]:  # [head_dim // 2] float32, cos/sin scale
    """LongRoPE (arXiv:2402.13753; Phi-3): each frequency divided by its own rescale factor
    (`long_factor` or `short_factor`) and cos/sin scaled by the attention factor
    sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings / original (or `factor`).

    transformers picks the factor set per forward call (long once the sequence passes
    `original_max_position_embeddings`), which re-rotates nothing already cached; like vLLM
    we fix the set once: long factors when max_model_len exceeds the original context, short
    ones otherwise (greedy outputs equal transformers' for prompts beyond the original
    context with long factors, and for whole sequences within it with short ones).
    """
    original = int(rope_scaling["original_max_position_embeddings"])
    factor = rope_scaling.get("factor") or max_position_embeddings / original
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    rescale = rope_scaling["long_factor" if max_model_len > original else "short_factor"]
    if len(rescale) != exponents.numel():
        raise ValueError(
            f"longrope factors have {len(rescale)} entries, expected head_dim / 2 = "
            f"{exponents.numel()}"
        )
    inv_freq = 1.0 / (torch.tensor(rescale, dtype=torch.float32) * rope_theta**exponents)
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotates each head's (x[i], x[i + head_dim/2]) pairs by position * inv_freq[i].

    cos/sin are precomputed in float32 for positions [0, max_position_embeddings) and cast to
    the query dtype before use, as HF does. One instance can be shared by every layer.
    LongRoPE's table depends on the served context length: `fit_to_max_model_len` (the loader
    calls it) picks its factor set; until then it assumes max_position_embeddings.
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
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.register_buffer(
            "cos_sin_cache", self._cos_sin_table(max_position_embeddings), persistent=False
        )
        self.cos_sin_cache: torch.Tensor

    def _cos_sin_table(
        self, max_model_len: int, device: torch.device | None = None
    ) -> torch.Tensor:  # [max_position_embeddings, head_dim] float32, [cos | sin]
        inv_freq, scale = _inverse_frequencies(
            self.head_dim,
            self.rope_theta,
            self.rope_scaling,
            self.max_position_embeddings,
            max_model_len,
        )
        positions = torch.arange(self.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position_embeddings, head_dim // 2]
        return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale).to(device)

    def fit_to_max_model_len(self, max_model_len: int) -> None:
        """Rebuild the table for a served context of `max_model_len` tokens where the scaling
        depends on it (LongRoPE's long or short factors); other RoPE types keep theirs."""
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":
            self.cos_sin_cache = self._cos_sin_table(max_model_len, self.cos_sin_cache.device)

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


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (M-RoPE, Qwen2-VL arXiv:2409.12191, transformers'
    Qwen2_5_VLRotaryEmbedding, vLLM's MRotaryEmbedding): each token has three positions
    (temporal, height, width); the head's first `mrope_section[0]` frequency pairs rotate by
    the temporal position, the next `mrope_section[1]` by the height, the last by the width.
    Text tokens have three equal positions, which is plain RoPE.

    Takes positions [3, num_tokens]; [num_tokens] ones are plain RoPE (the base class).
    Raises ValueError when the sections do not add up to head_dim / 2.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        rope_theta: float,
        mrope_section: list[int],
    ) -> None:
        super().__init__(head_dim, max_position_embeddings, rope_theta)
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"rope_scaling mrope_section {mrope_section} must be 3 sizes adding up to "
                f"head_dim / 2 = {head_dim // 2}"
            )
        self.mrope_section = list(mrope_section)
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        # Column j of the [cos | sin] table reads the position of axis `axes[j]`.
        self.register_buffer("axes", torch.cat([axis, axis]), persistent=False)
        self.axes: torch.Tensor

    def forward(
        self,
        positions: torch.Tensor,  # [3, num_tokens] or [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads * head_dim] float
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] float
    ) -> tuple[torch.Tensor, torch.Tensor]:  # shapes and dtypes of query and key
        if positions.ndim == 1:
            return super().forward(positions, query, key)
        num_tokens = positions.shape[1]
        table = self.cos_sin_cache[positions]  # [3, num_tokens, head_dim]
        index = self.axes.view(1, 1, -1).expand(1, num_tokens, -1)
        cos_sin = table.gather(0, index)[0]  # [num_tokens, head_dim], each column's axis
        if use_fused_ops(query):
            from pagedserve.layers.kernels.fused_ops import rotary_embedding

            # The kernel reads row positions[i] of its table: here row i, the token's own.
            rows = torch.arange(num_tokens, device=positions.device)
            return rotary_embedding(rows, query, key, cos_sin.contiguous(), self.head_dim)
        cos, sin = cos_sin.to(query.dtype).unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


def get_rope(hf_config: Any, head_dim: int, layer_type: str | None = None) -> RotaryEmbedding:
    """The RotaryEmbedding an HF config describes (rope_theta, rope_scaling, context length);
    `layer_type` selects per-layer-type parameters (see `read_rope_parameters`).

    Raises NotImplementedError for partial rotary embeddings (`partial_rotary_factor` < 1,
    e.g. Phi-4-mini), which rotate only part of each head.
    """
    rope_theta, rope_scaling = read_rope_parameters(hf_config, layer_type)
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    partial = parameters.get(
        "partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1)
    )
    if float(partial) != 1.0:
        raise NotImplementedError(
            f"partial_rotary_factor={partial} (rotary embedding on part of each head) is not "
            "supported yet"
        )
    if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
        # transformers >= 5 copies it into rope_parameters; older configs keep it on top.
        rope_scaling.setdefault(
            "original_max_position_embeddings", hf_config.original_max_position_embeddings
        )
    return RotaryEmbedding(head_dim, hf_config.max_position_embeddings, rope_theta, rope_scaling)
