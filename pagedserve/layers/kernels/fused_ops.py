"""Fused RMSNorm(+residual), SiLU-and-mul and rotary embedding kernels for half precision.

Each replaces a chain of small PyTorch ops (a decode step otherwise launches ~25 kernels per
layer just for these) with one kernel that reads its inputs once. Float32 stays on the
PyTorch path, which the CPU tests compare with transformers bit for bit.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import torch
import triton
import triton.language as tl

from pagedserve.gdc import launch_dependents, pdl_launch, pdl_trigger, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, residual_out_ptr, out_ptr, weight_ptr,
    stride_x, stride_residual, stride_out,
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    if PDL:  # launched with PDL (gdc.py): the previous kernel's output is x
        wait_for_previous()
        launch_dependents()  # the next linear may start streaming its weights
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype first, as `x + residual` is in PyTorch.
        x = x + tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * stride_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden_size
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if UNIT_OFFSET:  # Gemma: (x * (1 + w)) in float32, cast once
        out = x32 * tl.rsqrt(variance + eps) * (1.0 + weight.to(tl.float32))
    else:  # Llama: the normed x is cast before the scale
        out = (x32 * tl.rsqrt(variance + eps)).to(x.dtype) * weight
    tl.store(out_ptr + row * stride_out + cols, out.to(x.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_rows, hidden_size] half
    weight: torch.Tensor,  # [hidden_size], dtype of x
    eps: float,
    residual: torch.Tensor | None = None,  # [num_rows, hidden_size], dtype of x
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # 2 x [num_rows, hidden_size], dtype of x
    """RMSNorm of x, or of s = x + residual; returns (normed, s or None). `unit_offset`
    scales by (1 + weight) in float32 (Gemma's norm) instead of by weight after the cast."""
    num_rows, hidden_size = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    if num_rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x,
        residual_out if residual_out is not None else x, out, weight,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        hidden_size, eps,
        HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block,
        PDL=pdl_trigger(x.device), num_warps=min(max(block // 256, 1), 16),
        **pdl_launch(x.device),
    )  # fmt: skip
    return out, residual_out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr,
    PDL_TRIGGER: tl.constexpr = False,
):  # fmt: skip
    if PDL_TRIGGER:  # the down projection may start streaming its weights (gdc.py)
        launch_dependents()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * intermediate_size] half, [gate | up]
) -> torch.Tensor:  # [num_tokens, intermediate_size], dtype of x
    num_tokens, double = x.shape
    size = double // 2
    out = torch.empty(num_tokens, size, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = 1024
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
        x, out, x.stride(0), out.stride(0), size, BLOCK=block,
        PDL_TRIGGER=pdl_trigger(x.device), num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_q, stride_k, stride_cos_sin,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + dims, mask=dim_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF + dims, mask=dim_mask, other=0.0)
    heads = tl.arange(0, BLOCK_H)
    for start in range(0, num_q_heads + num_k_heads, BLOCK_H):
        head = start + heads
        is_q = head < num_q_heads
        is_k = (head >= num_q_heads) & (head < num_q_heads + num_k_heads)
        q_offsets = token * stride_q + head[:, None] * (2 * HALF) + dims[None, :]
        k_offsets = token * stride_k + (head - num_q_heads)[:, None] * (2 * HALF) + dims[None, :]
        q_mask = is_q[:, None] & dim_mask[None, :]
        k_mask = is_k[:, None] & dim_mask[None, :]
        x1 = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
        x1 += tl.load(k_ptr + k_offsets, mask=k_mask, other=0.0)
        x2 = tl.load(q_ptr + q_offsets + HALF, mask=q_mask, other=0.0)
        x2 += tl.load(k_ptr + k_offsets + HALF, mask=k_mask, other=0.0)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        out1 = (a * cos[None, :] - b * sin[None, :]).to(x1.dtype)
        out2 = (b * cos[None, :] + a * sin[None, :]).to(x1.dtype)
        tl.store(q_ptr + q_offsets, out1, mask=q_mask)
        tl.store(q_ptr + q_offsets + HALF, out2, mask=q_mask)
        tl.store(k_ptr + k_offsets, out1, mask=k_mask)
        tl.store(k_ptr + k_offsets + HALF, out2, mask=k_mask)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim] half; rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim] half; rotated in place
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] float32, [cos | sin]
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (x[i], x[i + head_dim/2] pairs) of q and k in one launch."""
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return query, key
    assert query.stride(1) == 1 and key.stride(1) == 1 and cos_sin_cache.is_contiguous()
    half = head_dim // 2
    num_q_heads, num_k_heads = query.shape[1] // head_dim, key.shape[1] // head_dim
    block_h = min(triton.next_power_of_2(num_q_heads + num_k_heads), 16)
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), key.stride(0), cos_sin_cache.stride(0),
        num_q_heads, num_k_heads,
        HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return query, key
