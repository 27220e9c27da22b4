"""Triton kernel that writes new tokens' K and V into the paged KV cache at their slots."""

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
):
    """Grid (num_tokens, cdiv(num_kv_heads, BLOCK_H)): one token's K and V rows for BLOCK_H
    heads. Slot s lives at block s // BLOCK_SIZE, offset s % BLOCK_SIZE; a slot of -1 (padding
    token, e.g. in a CUDA graph's padded batch) writes nothing."""
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
    tl.store(dst, key.to(cache_dtype), mask=mask)
    value = tl.load(
        value_ptr + token64 * stride_v_token + heads[:, None] * stride_v_head + offs_d[None, :],
        mask=mask,
    )
    tl.store(dst + stride_cache_kv, value.to(cache_dtype), mask=mask)
