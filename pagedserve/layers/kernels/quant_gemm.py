"""Triton W4A16 / W8A16 GEMM for GPTQ and AWQ weights: y = x @ dequant(W)^T (+ bias).

The weight is in `PackedWeights`' layout (pagedserve/layers/quantization/packed.py): qweight
[K / pack, N] int32 packed along K, scales [G, N], zero points [G, N] int16 or one constant,
optional act-order permutation `perm` (x's columns are gathered through it inside the kernel)
and per-row groups `g_idx`. Two paths, picked by the number of rows M of x:

- M < DEQUANT_MATMUL_MIN_M: `quant_gemm`, which dequantizes each [BLOCK_K, BLOCK_N] tile of
  W^T inside the K loop (fp32 (q - zero) * scale, rounded to x's dtype, then a tensor-core
  dot with fp32 accumulation; for M = 1 a CUDA-core dot product instead). Small M splits K
  over several programs (split-K) so that a decode step fills the GPU; the fp32 partial sums
  are then added (with the bias) by a second small kernel.
- M >= DEQUANT_MATMUL_MIN_M: `dequantize` writes W^T [K, N] in x's dtype, then cuBLAS.

Numerics: every weight is (q - zero) * scale computed in fp32 and rounded to x's dtype, which
is exactly the reference `x @ dequantize_gptq(...).to(x.dtype)` weight; only the summation
order differs (fp32 accumulation), so results agree with the reference within a few units in
the last place of x's dtype (tests/quantization/test_quant_kernels.py states the tolerances).
No host syncs and no data-dependent shapes: safe inside CUDA graphs.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.layers.quantization.packed import PackedWeights

# Rows of x from which dequantize + cuBLAS replaces the in-loop kernel. A placeholder until the
# lead measures the crossover on the H200: `python benchmarks/quant_gemm.py` prints, per M,
# the time of both paths for Llama-3.1-8B's shapes and the best one; set this to the smallest
# M from which dequantize + cuBLAS wins on all of them.
DEQUANT_MATMUL_MIN_M = 1024
# Aim for this many programs per SM when choosing split-K (enough loads in flight to keep
# HBM busy in a memory-bound decode GEMM).
PROGRAMS_PER_SM = 4
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of `quant_gemm` (BLOCK_M 1: the CUDA-core GEMV variant)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(m: int) -> GemmConfig:
    """Tiles by M (untuned starting points; benchmarks/quant_gemm.py --sweep compares others)."""
    if m == 1:
        return GemmConfig(1, 64, 128, 4, 3)
    if m <= 16:
        return GemmConfig(16, 64, 128, 4, 3)
    if m <= 32:
        return GemmConfig(32, 64, 128, 4, 3)
    if m <= 64:
        return GemmConfig(64, 64, 64, 4, 3)
    if m <= 128:
        return GemmConfig(64, 128, 64, 4, 3)
    return GemmConfig(128, 128, 64, 8, 3)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_k(tiles: int, k_blocks: int, device: torch.device) -> int:
    """Programs along K, so that tiles * split reaches PROGRAMS_PER_SM per SM."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    return max(1, min(PROGRAMS_PER_SM * sms // tiles, k_blocks, MAX_SPLIT_K))


@triton.jit
def _dequant_tile(
    qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr,
    offs_k, offs_n, k_start, mask_k, mask_n,
    stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
    group_size, zero_value,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    ONE_GROUP_PER_BLOCK: tl.constexpr,
):  # fmt: skip
    """W^T[offs_k, offs_n] in fp32 ([BLOCK_K, BLOCK_N])."""
    PACK: tl.constexpr = 32 // BITS
    mask = mask_k[:, None] & mask_n[None, :]
    # Each int32 is loaded by the PACK rows it holds (the repeats hit L1).
    words = tl.load(
        qweight_ptr + (offs_k[:, None] // PACK) * stride_qk + offs_n[None, :] * stride_qn,
        mask=mask, other=0,
    )  # fmt: skip
    q = (words >> ((offs_k[:, None] % PACK) * BITS)) & ((1 << BITS) - 1)
    if ONE_GROUP_PER_BLOCK:  # the block's rows share one row of scales and zeros
        group = k_start // group_size
        scales = tl.load(scales_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n)
        scales = scales.to(tl.float32)[None, :]
        if HAS_ZEROS:
            zeros = tl.load(zeros_ptr + group * stride_zg + offs_n * stride_zn, mask=mask_n)
            q = q - zeros.to(tl.int32)[None, :]
        else:
            q = q - zero_value
    else:
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        else:
            groups = offs_k // group_size
        scales = tl.load(
            scales_ptr + groups[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask
        ).to(tl.float32)
        if HAS_ZEROS:
            zeros = tl.load(
                zeros_ptr + groups[:, None] * stride_zg + offs_n[None, :] * stride_zn, mask=mask
            )
            q = q - zeros.to(tl.int32)
        else:
            q = q - zero_value
    return q.to(tl.float32) * scales


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
    PARTIAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_block in range(pid_k, tl.cdiv(K, BLOCK_K), split_k):
        k_start = k_block * BLOCK_K
        offs_k = k_start + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        # act-order: kernel row k is x's column perm[k]
        cols = tl.load(perm_ptr + offs_k, mask=mask_k, other=0) if HAS_PERM else offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        w = _dequant_tile(
            qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr,
            offs_k, offs_n, k_start, mask_k, mask_n,
            stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
            group_size, zero_value,
            BITS, HAS_ZEROS, HAS_G_IDX, ONE_GROUP_PER_BLOCK,
        )  # fmt: skip
        if BLOCK_M >= 16:
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        else:  # GEMV: no tensor cores below 16 rows; multiply-add on CUDA cores
            x32 = x.to(tl.float32)
            if not IEEE:  # the weight rounded to x's dtype, as the tensor-core path
                w = w.to(x.dtype).to(tl.float32)
            acc += tl.sum(x32[:, :, None] * w[None, :, :], axis=1)
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
    k_start = tl.program_id(0) * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k = offs_k < K
    mask_n = offs_n < N
    w = _dequant_tile(
        qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr,
        offs_k, offs_n, k_start, mask_k, mask_n,
        stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
        group_size, zero_value,
        BITS, HAS_ZEROS, HAS_G_IDX, ONE_GROUP_PER_BLOCK,
    )  # fmt: skip
    # back to the checkpoint's row order, so x needs no permutation
    rows = tl.load(perm_ptr + offs_k, mask=mask_k, other=0) if HAS_PERM else offs_k
    tl.store(
        out_ptr + rows[:, None] * stride_ok + offs_n[None, :] * stride_on,
        w.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :],
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


def _block_k(w: PackedWeights, block_k: int) -> int:
    """Shrink BLOCK_K to a smaller power-of-two group size (32, 64), so that a block reads one
    row of scales."""
    size = w.group_size
    if w.g_idx is None and 16 <= size < block_k and size & (size - 1) == 0:
        return size
    return block_k


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
    config = config or pick_config(m)
    block_k = _block_k(w, config.block_k)
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
        IEEE=x.dtype == torch.float32, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
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
    block_n, block_k = 128, _block_k(w, 64)
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
