"""Triton device functions of `quant_gemm`'s kernels that dequantize GPTQ / AWQ packed int32
words in registers: a group's scales and zero points, one value of each word, a whole K block
of W^T in row order (tensor-core path), and the M = 1 CUDA-core products (`gemv_words`).

Every weight is exactly (q - zero) * scale in fp32 (see `dequant`); the layout of the words is
`PackedWeights`' (pagedserve/layers/quantization/packed.py).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import triton
import triton.language as tl


@triton.jit
def group_params(
    scales_ptr, zeros_ptr, groups, offs_n, mask,
    stride_sg, stride_sn, stride_zg, stride_zn, zero_value,
    HAS_ZEROS: tl.constexpr, SCALAR: tl.constexpr,
):  # fmt: skip
    """(scale, 2**23 + zero) in fp32 of rows in `groups` (a scalar when SCALAR: [1, BLOCK_N],
    else [R]: [R, BLOCK_N]); `mask` masks the loads ([BLOCK_N] or [R, BLOCK_N])."""
    if SCALAR:
        offs = groups * stride_sg + offs_n * stride_sn
        zoffs = groups * stride_zg + offs_n * stride_zn
    else:
        offs = groups[:, None] * stride_sg + offs_n[None, :] * stride_sn
        zoffs = groups[:, None] * stride_zg + offs_n[None, :] * stride_zn
    scales = tl.load(scales_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        offset = tl.load(zeros_ptr + zoffs, mask=mask, other=0).to(tl.float32) + 8388608.0
    else:
        offset = zero_value + 8388608.0
    if SCALAR:
        scales = scales[None, :]
        if HAS_ZEROS:
            offset = offset[None, :]
    return scales, offset


@triton.jit
def dequant(words, j, scales, offset, BITS: tl.constexpr):
    """Value j of each packed word, dequantized to fp32: exactly (q - zero) * scale.

    0x4B000000 is 2**23 as float32 bits: OR-ing q < 2**23 into the mantissa gives the float
    2**23 + q, so q - zero = that float - (2**23 + zero) (`offset`) exactly, with no
    int -> float conversion (a quarter-rate instruction on the GPU) per weight."""
    q = (words >> (j * BITS)) & ((1 << BITS) - 1)
    return ((q | 0x4B000000).to(tl.float32, bitcast=True) - offset) * scales


@triton.jit
def block_group_params(
    scales_ptr, zeros_ptr, offs_kp, offs_n, mask_kp, mask_n, k_start,
    stride_sg, stride_sn, stride_zg, stride_zn, group_size, zero_value,
    PACK: tl.constexpr, HAS_ZEROS: tl.constexpr, ONE_GROUP_PER_BLOCK: tl.constexpr,
):  # fmt: skip
    """Scales and offsets of a K block without g_idx: row i*PACK + j is in group
    (i*PACK) // group_size for every j (group_size is a multiple of PACK)."""
    # One return statement: Triton < 3.9 checks every return of a function for one type,
    # even one in a constexpr branch not taken.
    if ONE_GROUP_PER_BLOCK:
        scales, offset = group_params(
            scales_ptr, zeros_ptr, k_start // group_size, offs_n, mask_n,
            stride_sg, stride_sn, stride_zg, stride_zn, zero_value, HAS_ZEROS, True,
        )  # fmt: skip
    else:
        scales, offset = group_params(
            scales_ptr, zeros_ptr, (offs_kp * PACK) // group_size, offs_n,
            mask_kp[:, None] & mask_n[None, :],
            stride_sg, stride_sn, stride_zg, stride_zn, zero_value, HAS_ZEROS, False,
        )  # fmt: skip
    return scales, offset


@triton.jit
def dequant_tile(
    words, shifts, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr, offs_n, mask_n, k_block, K,
    stride_sg, stride_sn, stride_zg, stride_zn, group_size, zero_value,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    HAS_PERM: tl.constexpr, ONE_GROUP_PER_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One K block of W^T as fp32 [BLOCK_K, BLOCK_N], exactly (q - zero) * scale (see
    `dequant`), with x's columns for its rows (through the act-order permutation) and their
    mask.

    Each int32 of `words` [BLOCK_K / PACK, BLOCK_N] is unpacked into its PACK rows
    i*PACK + j: the whole tile in row order, so x's tile is one contiguous (coalesced) load
    and one dot covers BLOCK_K (tensor-core path; M = 1 uses `gemv_words`, which measured
    faster without the reshape: BENCHMARKS.md)."""
    offs_k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    q = tl.reshape(q, (BLOCK_K, BLOCK_N))
    if ONE_GROUP_PER_BLOCK:
        scales, offset = group_params(
            scales_ptr, zeros_ptr, (k_block * BLOCK_K) // group_size, offs_n, mask_n,
            stride_sg, stride_sn, stride_zg, stride_zn, zero_value, HAS_ZEROS, True,
        )  # fmt: skip
    else:
        if HAS_G_IDX:  # sorted rows in uneven groups: each row's own group
            groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        else:
            groups = offs_k // group_size
        scales, offset = group_params(
            scales_ptr, zeros_ptr, groups, offs_n, mask_k[:, None] & mask_n[None, :],
            stride_sg, stride_sn, stride_zg, stride_zn, zero_value, HAS_ZEROS, False,
        )  # fmt: skip
    w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - offset) * scales
    # act-order: kernel row k is x's column perm[k]
    cols = tl.load(perm_ptr + offs_k, mask=mask_k, other=0) if HAS_PERM else offs_k
    return w, cols, mask_k


@triton.jit
def gemv_words(
    acc, x_ptr, words, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr, offs_kp, mask_kp, offs_n,
    mask_n, k_start, stride_xk, stride_sg, stride_sn, stride_zg, stride_zn, group_size,
    zero_value,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    HAS_PERM: tl.constexpr, ONE_GROUP_PER_BLOCK: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_KP, BLOCK_N] fp32 plus one row of x against one K block on CUDA cores: the
    products summed over each word's PACK values (rows i*PACK + j), not yet over i. Value j of every
    word is dequantized in place (no reshape of the tile), and the x values it meets are a
    strided gather of BLOCK_KP elements (cached)."""
    PACK: tl.constexpr = 32 // BITS
    if not HAS_G_IDX:
        scales, offset = block_group_params(
            scales_ptr, zeros_ptr, offs_kp, offs_n, mask_kp, mask_n, k_start,
            stride_sg, stride_sn, stride_zg, stride_zn, group_size, zero_value,
            PACK, HAS_ZEROS, ONE_GROUP_PER_BLOCK,
        )  # fmt: skip
    for j in tl.static_range(PACK):
        rows = offs_kp * PACK + j
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + rows, mask=mask_kp, other=0)
            scales, offset = group_params(
                scales_ptr, zeros_ptr, groups, offs_n, mask_kp[:, None] & mask_n[None, :],
                stride_sg, stride_sn, stride_zg, stride_zn, zero_value, HAS_ZEROS, False,
            )  # fmt: skip
        cols = tl.load(perm_ptr + rows, mask=mask_kp, other=0) if HAS_PERM else rows
        x = tl.load(x_ptr + cols * stride_xk, mask=mask_kp, other=0.0).to(tl.float32)
        acc += x[:, None] * dequant(words, j, scales, offset, BITS)
    return acc
