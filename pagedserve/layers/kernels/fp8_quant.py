"""Fused dynamic FP8 (e4m3) quantization of activations, for the FP8 linear method on CUDA.

The PyTorch chain (abs, amax, divide, clamp, cast: about six kernels and a temporary per
linear layer) cost more than the FP8 GEMM saves at decode batch sizes on the H200
(benchmarks/fp8_gemm.py, BENCHMARKS.md). These kernels read x twice (amax, then quantize)
and write x_q once:

- per tensor (vLLM's dynamic default): `_partial_amax_kernel` writes the amax of each
  program's rows, `_quantize_kernel` reduces those partials (at most MAX_PARTIALS, so no
  atomics, no memset, deterministic) and quantizes;
- per token: `_quantize_kernel` alone, each row with its own scale;
- static: `_quantize_kernel` with the given scale.

Values equal `quantize_fp8(x, fp8_dynamic_scale(x, per_token))` of
`pagedserve.layers.quantization.fp8` (the CPU reference): x / scale in float32 with
round-to-nearest division (the scale itself is amax times float32(1/448)), saturated to
+-448, rounded to nearest even.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # as fp8.MIN_SCALE (vLLM's MIN_SCALING_FACTOR)
MAX_PARTIALS = 256  # programs of the amax pass (each takes every MAX_PARTIALS-th row)
BLOCK_K = 1024
# The same numbers as Triton constants (a kernel reads only constexpr globals).
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
_INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)  # rounded to float32 in the kernel, as PyTorch


@triton.jit(do_not_specialize=["M"])
def _partial_amax_kernel(
    x_ptr, partial_ptr, M, K, stride_xm, NUM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, M, NUM_PROGRAMS):
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_ptr + row * stride_xm + start + cols, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + pid, tl.max(amax, axis=0))


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(
    x_ptr, out_ptr, scale_ptr, partial_ptr, M, K, stride_xm, stride_om,
    MODE: tl.constexpr,  # 0: static scale_ptr[0]; 1: per tensor from partials; 2: per token
    NUM_PARTIALS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    if MODE == 0:
        scale = tl.load(scale_ptr)
    elif MODE == 1:
        offs = tl.arange(0, NUM_PARTIALS)
        amax = tl.max(tl.load(partial_ptr + offs), axis=0)
        scale = tl.maximum(amax * _INV_FP8_MAX, _MIN_SCALE)
        if row == 0:
            tl.store(scale_ptr, scale)
    else:
        amax_block = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            mask = start + cols < K
            x = tl.load(x_row + start + cols, mask=mask, other=0.0)
            amax_block = tl.maximum(amax_block, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax_block, axis=0) * _INV_FP8_MAX, _MIN_SCALE)
        tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
        tl.store(out_ptr + row * stride_om + start + cols, q.to(tl.float8e4nv), mask=mask)


def quantize_fp8_dynamic(
    x: torch.Tensor,  # [M, K] float16/bfloat16/float32 CUDA, last dim contiguous
    per_token: bool,
    static_scale: torch.Tensor | None = None,  # [] or [1] float32: static scheme
) -> tuple[torch.Tensor, torch.Tensor]:  # x_q [M, K] float8_e4m3fn; scale [] or [M, 1] fp32
    """x quantized to FP8 with a static scale, one dynamic scale (amax / 448), or one per
    row; returns (x_q, scale) with scale as the GEMM takes it. Launches 1 or 2 kernels."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    block = min(BLOCK_K, triton.next_power_of_2(k))
    if static_scale is not None:
        scale = static_scale.reshape(())
        mode, partials, num_partials = 0, scale, 1
    elif per_token:
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        mode, partials, num_partials = 2, scale, 1
    else:
        scale = torch.empty((), dtype=torch.float32, device=x.device)
        num_partials = min(MAX_PARTIALS, triton.next_power_of_2(max(m, 1)))
        # Programs past M write 0 (the amax of nothing), so every partial is written.
        partials = torch.empty(num_partials, dtype=torch.float32, device=x.device)
        _partial_amax_kernel[(num_partials,)](
            x, partials, m, k, x.stride(0), NUM_PROGRAMS=num_partials, BLOCK=block
        )
        mode = 1
    if m:
        _quantize_kernel[(m,)](
            x, out, scale, partials, m, k, x.stride(0), out.stride(0),
            MODE=mode, NUM_PARTIALS=num_partials, BLOCK=block,
        )  # fmt: skip
    return out, scale
