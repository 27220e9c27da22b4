"""Triton W4A16 / W8A16 GEMM for GPTQ and AWQ weights: y = x @ dequant(W)^T (+ bias).

The weight is in `PackedWeights`' layout (pagedserve/layers/quantization/packed.py): qweight
[K / pack, N] int32 packed along K, scales [G, N], zero points [G, N] int16 or one constant,
optional act-order permutation `perm` (x's columns are gathered through it inside the kernel)
and per-row groups `g_idx`. Two paths, picked by the number of rows M of x:

- M < DEQUANT_MATMUL_MIN_M: `quant_gemm`, which dequantizes W^T inside the K loop: each int32
  word of a [BLOCK_K / pack, BLOCK_N] tile is loaded once and unpacked into its pack rows
  i*pack + j, the whole [BLOCK_K, BLOCK_N] tile in row order, fp32 (q - zero) * scale, then
  rounded to x's dtype for one tensor-core dot per block with fp32 accumulation against x's
  contiguous tile (for M = 1, `gemv_words`: fp32 products on the unrounded weights, value j
  of each word in place, summed after the loop).
  Small M splits K over several programs (split-K) so that a decode step fills the GPU; the
  fp32 partial sums are then added (with the bias) by a second small kernel.
- M >= DEQUANT_MATMUL_MIN_M: `dequantize` writes W^T [K, N] in x's dtype, then cuBLAS.

Numerics: every weight is (q - zero) * scale computed exactly in fp32; the tensor-core paths
round it to x's dtype, which is exactly the reference `x @ dequantize_gptq(...).to(x.dtype)`
weight, and the M = 1 path keeps it in fp32 (the reference's fp32 weight). Only the summation
order differs (fp32 accumulation), so results agree with the reference within about a unit in
the last place of x's dtype (tests/quantization/test_quant_kernels.py states the tolerances).
No host syncs and no data-dependent shapes: safe inside CUDA graphs.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.layers.kernels import num_sms
from pagedserve.layers.kernels.quant_tiles import (
    block_group_params,
    dequant,
    dequant_tile,
    gemv_words,
    group_params,
)
from pagedserve.layers.quantization.packed import PackedWeights

# Rows of x from which dequantize + cuBLAS replaces the in-loop kernel: the smallest M of
# benchmarks/quant_gemm.py's grid (1, 16, 64, 256, 1024, 4096) from which it won on all four
# Llama-3.1-8B shapes on the H200 (tree 0ad4463: one layer's linears at M = 256, 0.34 ms
# against 0.58 ms in-loop; at M = 64 the in-loop kernel wins, 0.19 against 0.27 ms).
DEQUANT_MATMUL_MIN_M = 256
# Aim for this many programs per SM when choosing split-K (enough loads in flight to keep
# HBM busy in a memory-bound decode GEMM).
PROGRAMS_PER_SM = 4
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of `quant_gemm`. block_m 1: the CUDA-core GEMV variant; swap_ab: the tensor
    core computes out^T = W x^T, so the dequantized weight (in registers) is the MMA's A
    operand and only the small x^T tile goes through shared memory (for small M)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False


def pick_config(m: int) -> GemmConfig:
    """Tiles by M (untuned starting points; benchmarks/quant_gemm.py --sweep compares others)."""
    if m == 1:  # H200 sweep (benchmarks/quant_gemm.py): 32 x 512 beat 64 x 256 by 10%
        return GemmConfig(1, 32, 512, 4, 3)
    if m <= 16:
        return GemmConfig(16, 64, 128, 4, 3)
    if m <= 32:
        return GemmConfig(32, 64, 128, 4, 3)
    if m <= 64:
        return GemmConfig(64, 64, 128, 4, 3)
    if m <= 128:
        return GemmConfig(64, 128, 128, 4, 3)
    return GemmConfig(128, 128, 128, 8, 3)


def _split_k(tiles: int, k_blocks: int, device: torch.device) -> int:
    """Programs along K, so that tiles * split reaches PROGRAMS_PER_SM per SM."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 4
    return max(1, min(PROGRAMS_PER_SM * sms // tiles, k_blocks, MAX_SPLIT_K))


# M and split_k vary with the batch: not specialized, so a new batch size compiles nothing.
@triton.jit(do_not_specialize=["M", "split_k"])
def _quant_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr, bias_ptr, out_ptr,
    M, N, K, split_k,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    stride_os, stride_om, stride_on,
    group_size, zero_value,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    HAS_PERM: tl.constexpr, ONE_GROUP_PER_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, IEEE: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KP: tl.constexpr = BLOCK_K // PACK  # packed rows per K block
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # M tiles vary fastest, so programs running together read the same weight tile (L2).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif BLOCK_M == 1:  # GEMV: products summed over K once, after the loop
        acc_k = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    shifts = tl.arange(0, PACK) * BITS
    w_ptrs = qweight_ptr + tl.arange(0, BLOCK_KP)[:, None] * stride_qk + offs_n[None, :] * stride_qn
    if BLOCK_M == 1:
        # The GEMV's loads feed no dot, so Triton does not pipeline them: the next block's
        # words are loaded by hand before this block is computed (two blocks in flight per
        # program; 10-20% on the H200, benchmarks/quant_gemm.py). Weights are read once per
        # step: evict_first keeps them from pushing x and the scales out of L2.
        words = tl.load(
            w_ptrs + pid_k * BLOCK_KP * stride_qk,
            mask=((pid_k * BLOCK_KP + tl.arange(0, BLOCK_KP)) < K // PACK)[:, None]
            & mask_n[None, :],
            other=0, eviction_policy="evict_first",
        )  # fmt: skip
    for k_block in range(pid_k, tl.cdiv(K, BLOCK_K), split_k):
        offs_kp = k_block * BLOCK_KP + tl.arange(0, BLOCK_KP)
        mask_kp = offs_kp < K // PACK
        if BLOCK_M == 1:
            next_words = tl.load(
                w_ptrs + (k_block + split_k) * BLOCK_KP * stride_qk,
                mask=((offs_kp + split_k * BLOCK_KP) < K // PACK)[:, None] & mask_n[None, :],
                other=0, eviction_policy="evict_first",
            )  # fmt: skip
        else:
            words = tl.load(
                w_ptrs + k_block * BLOCK_KP * stride_qk,
                mask=mask_kp[:, None] & mask_n[None, :], other=0,
            )  # fmt: skip
        if BLOCK_M == 1:  # GEMV on CUDA cores (one row of x), fp32 weights
            acc_k = gemv_words(
                acc_k, x_ptr + pid_m * stride_xm, words, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr,
                offs_kp, mask_kp, offs_n, mask_n, k_block * BLOCK_K, stride_xk,
                stride_sg, stride_sn, stride_zg, stride_zn, group_size, zero_value,
                BITS, HAS_ZEROS, HAS_G_IDX, HAS_PERM, ONE_GROUP_PER_BLOCK,
            )  # fmt: skip
            words = next_words
        else:
            w, cols, mask_k = dequant_tile(
                words, shifts, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr, offs_n, mask_n,
                k_block, K, stride_sg, stride_sn, stride_zg, stride_zn, group_size, zero_value,
                BITS, HAS_ZEROS, HAS_G_IDX, HAS_PERM, ONE_GROUP_PER_BLOCK, BLOCK_K, BLOCK_N,
            )  # fmt: skip
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            )  # fmt: skip
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            elif SWAP_AB:
                acc += tl.dot(tl.trans(w.to(x.dtype)), tl.trans(x))
            else:
                acc += tl.dot(x, w.to(x.dtype))
    if BLOCK_M == 1:
        acc = tl.sum(acc_k, axis=0)[None, :]
    if SWAP_AB:
        acc = tl.trans(acc)
    out_mask = mask_m[:, None] & mask_n[None, :]
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + out_offs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["MN", "split_k"])
def _sum_partials_kernel(
    partial_ptr, bias_ptr, out_ptr, MN, N, split_k,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr, out_ptr,
    N, K,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_ok, stride_on,
    group_size, zero_value,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    HAS_PERM: tl.constexpr, ONE_GROUP_PER_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KP: tl.constexpr = BLOCK_K // PACK
    offs_kp = tl.program_id(0) * BLOCK_KP + tl.arange(0, BLOCK_KP)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_kp = offs_kp < K // PACK
    mask_n = offs_n < N
    mask = mask_kp[:, None] & mask_n[None, :]
    words = tl.load(
        qweight_ptr + offs_kp[:, None] * stride_qk + offs_n[None, :] * stride_qn,
        mask=mask, other=0,
    )  # fmt: skip
    if not HAS_G_IDX:
        scales, offset = block_group_params(
            scales_ptr, zeros_ptr, offs_kp, offs_n, mask_kp, mask_n,
            tl.program_id(0) * BLOCK_K,
            stride_sg, stride_sn, stride_zg, stride_zn, group_size, zero_value,
            PACK, HAS_ZEROS, ONE_GROUP_PER_BLOCK,
        )  # fmt: skip
    for j in tl.static_range(PACK):
        rows = offs_kp * PACK + j
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + rows, mask=mask_kp, other=0)
            scales, offset = group_params(
                scales_ptr, zeros_ptr, groups, offs_n, mask,
                stride_sg, stride_sn, stride_zg, stride_zn, zero_value, HAS_ZEROS, False,
            )  # fmt: skip
        # back to the checkpoint's row order, so x needs no permutation
        out_rows = tl.load(perm_ptr + rows, mask=mask_kp, other=0) if HAS_PERM else rows
        w = dequant(words, j, scales, offset, BITS)
        tl.store(
            out_ptr + out_rows[:, None] * stride_ok + offs_n[None, :] * stride_on,
            w.to(out_ptr.dtype.element_ty), mask=mask,
        )  # fmt: skip


def _weight_args(w: PackedWeights, block_k: int) -> tuple[list[object], dict[str, object]]:
    """The kernels' weight pointers/strides and constexpr flags."""
    zeros = w.zeros if w.zeros is not None else w.scales  # unused pointer when constant
    ptrs = [
        w.qweight, w.scales, zeros, w.g_idx if w.g_idx is not None else w.qweight,
    ]  # fmt: skip
    strides = [
        w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1),
        zeros.stride(0), zeros.stride(1),
    ]  # fmt: skip
    flags: dict[str, object] = {
        "BITS": w.bits,
        "HAS_ZEROS": w.zeros is not None,
        "HAS_G_IDX": w.g_idx is not None,
        "ONE_GROUP_PER_BLOCK": w.g_idx is None
        and (w.group_size % block_k == 0 or w.group_size >= w.in_features),
    }
    return [*ptrs, *strides], flags


def _block_k(w: PackedWeights, config: GemmConfig) -> int:
    """BLOCK_K of `config`, at least 16 packed rows for a tensor-core dot (a dot's K >= 16)."""
    pack = 32 // w.bits
    return max(config.block_k, 16 * pack) if config.block_m >= 16 else config.block_k


def quant_gemm(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    w: PackedWeights,  # K x N weight
    bias: torch.Tensor | None = None,  # [N]
    config: GemmConfig | None = None,  # default: pick_config(M)
    split_k: int | None = None,  # default: chosen from the GPU's SM count
) -> torch.Tensor:  # [M, N], x's dtype
    """x @ W^T (+ bias), dequantizing W inside the K loop (module docstring)."""
    m, k = x.shape
    n = w.out_features
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if config is None:
        config = pick_config(m)
        if x.dtype == torch.float32 and config.block_m >= 16:
            # fp32 tiles take twice the shared memory: (128, 128, 128) at 3 stages asked for
            # 238 KB on the H200 (limit 227 KB per block)
            config = GemmConfig(min(config.block_m, 64), 64, 128, 4, 2)
    block_k = _block_k(w, config)
    weight_args, flags = _weight_args(w, block_k)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if split_k is None:
        split_k = _split_k(tiles, triton.cdiv(k, block_k), x.device)
    partial = split_k > 1
    target = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if partial else out
    stride_os = target.stride(0) if partial else 0
    _quant_gemm_kernel[(tiles, split_k)](
        x, *weight_args[:4], w.perm if w.perm is not None else x,
        bias if bias is not None else x, target,
        m, n, k, split_k, x.stride(0), x.stride(1), *weight_args[4:],
        stride_os, target.stride(-2), target.stride(-1), w.group_size, w.zero_value,
        HAS_PERM=w.perm is not None, HAS_BIAS=bias is not None, PARTIAL=partial,
        IEEE=x.dtype == torch.float32, SWAP_AB=config.swap_ab and x.dtype != torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=block_k, num_warps=config.num_warps, num_stages=config.num_stages, **flags,
    )  # fmt: skip
    if partial:
        block = 1024
        _sum_partials_kernel[(triton.cdiv(m * n, block),)](
            target, bias if bias is not None else target, out, m * n, n, split_k,
            HAS_BIAS=bias is not None, BLOCK=block,
        )  # fmt: skip
    return out


def dequantize(
    w: PackedWeights,
    dtype: torch.dtype,
) -> torch.Tensor:  # [K, N] in dtype: W^T, rows in the checkpoint's order
    """The float weight W^T, each element (q - zero) * scale in fp32 rounded to `dtype`."""
    k, n = w.in_features, w.out_features
    out = torch.empty(k, n, dtype=dtype, device=w.qweight.device)
    block_n, block_k = 128, 128
    weight_args, flags = _weight_args(w, block_k)
    _dequantize_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        *weight_args[:4], w.perm if w.perm is not None else w.qweight, out,
        n, k, *weight_args[4:], out.stride(0), out.stride(1), w.group_size, w.zero_value,
        HAS_PERM=w.perm is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **flags,
    )  # fmt: skip
    return out


def dequant_matmul(
    x: torch.Tensor,  # [M, K] float
    w: PackedWeights,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x's dtype
    """x @ W^T (+ bias) through a dequantized copy of W^T and cuBLAS (large M)."""
    weight = dequantize(w, x.dtype)
    return torch.addmm(bias, x, weight) if bias is not None else x @ weight


def quant_linear(
    x: torch.Tensor,  # [..., K] float16 / bfloat16 / float32 on the weight's device
    w: PackedWeights,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N], x's dtype
    """A quantized linear layer's output: `quant_gemm` below DEQUANT_MATMUL_MIN_M rows of x,
    else `dequant_matmul`."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.size(0) >= DEQUANT_MATMUL_MIN_M:
        out = dequant_matmul(x2, w, bias)
    else:
        out = quant_gemm(x2, w, bias)
    return out.reshape(*x.shape[:-1], out.size(-1))
