"""FP8 KV cache (`--kv-cache-dtype fp8`): the cache's torch dtype and the per-tensor scaling
of K and V on their way into and out of it, as vLLM does.

Each attention layer has one float32 `k_scale` and one `v_scale` (per tensor, the same on every
tensor-parallel rank; 1.0 unless the checkpoint gives them). A key is stored as

    k_fp8 = clamp(k / k_scale, -max, max).to(fp8)      (max = 448 for e4m3, 57344 for e5m2)

and read back as `k = k_fp8.to(float) * k_scale`; values alike with `v_scale`. The clamp is
needed because a cast to fp8 does not saturate (e5m2 overflows to inf, e4m3fn to NaN on the
GPU). The quotient is computed in float32 whatever the input's dtype, the same arithmetic as
the Triton store kernel, so both write the same bytes.
"""

import torch

from pagedserve.config import KV_CACHE_DTYPES

# `--kv-cache-dtype` values (pagedserve.config.KV_CACHE_DTYPES) that quantize, as vLLM reads
# them: "fp8" is e4m3 (OCP float8_e4m3fn, the format of NVIDIA's FP8 tensor cores).
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV cache tensors: the model's for "auto", else the fp8 format named.
    Raises ValueError for any other name."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return FP8_KV_CACHE_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds scaled fp8 values."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448.0 for e4m3fn, 57344.0 for e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize_kv(
    x: torch.Tensor,  # [..., head_dim] float (any precision)
    scale: torch.Tensor | None,  # [1] or [] float32; None = 1.0
    dtype: torch.dtype,  # float8_e4m3fn or float8_e5m2
) -> torch.Tensor:  # x's shape, in `dtype`
    """clamp(x / scale, -max, max) cast to `dtype` (round to nearest even), in float32."""
    scaled = x.float() if scale is None else x.float() / scale.float()
    limit = fp8_max(dtype)
    return scaled.clamp(-limit, limit).to(dtype)


def dequantize_kv(
    x: torch.Tensor,  # [..., head_dim] fp8
    scale: torch.Tensor | None,  # [1] or [] float32; None = 1.0
    dtype: torch.dtype,  # the dtype wanted (the query's)
) -> torch.Tensor:  # x's shape, in `dtype`
    """x * scale in `dtype`, computed in float32 (float64 when `dtype` is: exact there)."""
    compute = torch.promote_types(dtype, torch.float32)
    out = x.to(compute)
    if scale is not None:
        out = out * scale.to(compute)
    return out.to(dtype)
