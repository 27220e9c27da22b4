"""Triton kernel that writes new tokens' K and V into the paged KV cache at their slots
(quantizing them for an fp8 cache)."""

# @triton.jit functions take Triton's own (untyped) tensors and constexprs.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    k_scale_ptr,  # [1] float32 (read only when FP8_MAX > 0 and KV_SCALED)
    v_scale_ptr,  # [1] float32
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # kv heads per program (power of two)
    FP8_MAX: tl.constexpr,  # the fp8 cache format's largest value; 0.0: not an fp8 cache
    KV_SCALED: tl.constexpr,  # fp8: divide by k_scale / v_scale (else scale 1)
):
    """Grid (num_tokens, cdiv(num_kv_heads, BLOCK_H)): one token's K and V rows for BLOCK_H
    heads. Slot s lives at block s // BLOCK_SIZE, offset s % BLOCK_SIZE; a slot of -1 (padding
    token, e.g. in a CUDA graph's padded batch) writes nothing. An fp8 cache gets
    clamp(x / scale, -FP8_MAX, FP8_MAX) in float32 (IEEE division: the bytes equal
    `kv_quant.quantize_kv`'s), rounded to nearest even."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]

    dst = (
        kv_cache_ptr
        + block * stride_cache_block
        + offset * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + offs_d[None, :]
    )
    cache_dtype = kv_cache_ptr.dtype.element_ty
    token64 = token.to(tl.int64)
    key = tl.load(
        key_ptr + token64 * stride_k_token + heads[:, None] * stride_k_head + offs_d[None, :],
        mask=mask,
    )
    tl.store(dst, _to_cache(key, k_scale_ptr, cache_dtype, FP8_MAX, KV_SCALED), mask=mask)
    value = tl.load(
        value_ptr + token64 * stride_v_token + heads[:, None] * stride_v_head + offs_d[None, :],
        mask=mask,
    )
    value = _to_cache(value, v_scale_ptr, cache_dtype, FP8_MAX, KV_SCALED)
    tl.store(dst + stride_cache_kv, value, mask=mask)


@triton.jit
def _to_cache(x, scale_ptr, cache_dtype, FP8_MAX: tl.constexpr, KV_SCALED: tl.constexpr):
    """x as stored: cast to the cache's dtype; for fp8, x / scale in float32 clamped to
    +-FP8_MAX first (the cast does not saturate), then rounded to nearest even."""
    if FP8_MAX > 0:
        x = x.to(tl.float32)
        if KV_SCALED:
            x = tl.div_rn(x, tl.load(scale_ptr))
        x = tl.clamp(x, -FP8_MAX, FP8_MAX)
        return x.to(cache_dtype, fp_downcast_rounding="rtne")
    return x.to(cache_dtype)
