"""CUDA C++ W4A16 GEMV for decode (M <= 8 rows of x) on tensor cores, built at first use with
`torch.utils.cpp_extension.load_inline` (source: w4_gemv.cu beside this file).

Weight layout. `repack(w)` rewrites a 4-bit `PackedWeights.qweight` [K / 8, N] once, at load,
so that each lane's 16-byte load is exactly its A fragments of four m16n8k16 MMAs:

    repacked [N_pad / 16, K_pad / 64, 32 lanes, 4 words] int32     (N_pad, K_pad: zero padded)

    tile j = columns 16 j .. 16 j + 15;  chunk c = K rows 64 c .. 64 c + 63 (two k32 steps)
    lane = 4 g + t: columns 16 j + g and 16 j + g + 8, K rows 32 s + 8 t .. 32 s + 8 t + 7
    word 2 s + h: step s of column 16 j + g + 8 h, its 8 values at nibble positions
                  0 4 1 5 2 6 3 7 (K offset i at position i / 2 + 4 (i % 2)), so that
                  `(word >> 4 p) & 0x000F000F` holds K offsets (2 p, 2 p + 1) in its two halves

A warp reads 512 contiguous bytes per chunk; a lane's x fragment (its B operand) is x[g, 32 s +
8 t .. + 7], one 16-byte load in x's own order.

Dequantization: lop3 `(w & 0x000F000F) | 0x64006400` is fp16x2 (1024 + q_lo, 1024 + q_hi),
`| 0x43004300` bf16x2 (128 + q_lo, 128 + q_hi); one fp16x2 / bf16x2 subtraction of
(offset + zero) leaves q - zero exactly (fp16 also takes bits 4-7 as 1024 + 16 q through one
fma by 1/16). The MMA multiplies x by q - zero exactly and sums in fp32; the fp32 sum of each
64-row chunk (32 rows for group size 32) is then multiplied by its group's scale. So the result
is `x.float() @ dequantize(w, float32)` up to fp32 summation order and the final rounding to
x's dtype. Zero points must be exact in the dtype after the offset: |zero| < 128 (bf16).

Work split: one block per 16 output columns, its warps taking the chunks in turn (warp w:
chunks w, w + W, ...), UNROLL chunks' loads in flight per lane, the warps' sums added in shared
memory. No split-K across blocks, no workspace, no host syncs: safe in CUDA graphs.
"""

import functools
import os
import shutil
import time
from pathlib import Path

import torch

from pagedserve.layers.quantization.packed import PackedWeights, unpack_int32

MAX_M = 8  # the MMA's N
TILE_N = 16  # output columns of a block
CHUNK_K = 64  # K rows of one lane's 16-byte load
# Aim for this many warps per SM (loads in flight) when choosing the warps of a block; gives
# the H200 sweep's best (benchmarks/w4_gemv_cuda.py --sweep): qkv 8, o 16, gate_up 4, down 16.
WARPS_PER_SM = 16
_SOURCE = Path(__file__).with_name("w4_gemv.cu")
_LOADED: dict[str, object] = {}  # "module": the extension, once built
_DECLARATION = """
void w4_gemv_out(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                 std::optional<torch::Tensor> zeros, std::optional<torch::Tensor> bias,
                 torch::Tensor out, int64_t group_size, int64_t zero_value, int64_t num_warps,
                 int64_t unroll);
"""


@functools.cache
def available() -> bool:
    """A CUDA GPU of compute capability 8.0+ (mma.sync bf16) and nvcc to build the kernel."""
    try:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
            return False
        from torch.utils.cpp_extension import CUDA_HOME

        nvcc = Path(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
        return (nvcc is not None and nvcc.exists()) or shutil.which("nvcc") is not None
    except Exception:  # noqa: BLE001 (a broken CUDA setup means "not available", never a crash)
        return False


def load(verbose: bool = False) -> object:
    """The compiled extension, built on the first call (under ~/.cache/pagedserve, again only
    when the source or flags change: load_inline hashes them). verbose: print the build's
    commands and ptxas' register / spill report (on a fresh build) and the time taken."""
    if "module" in _LOADED:
        return _LOADED["module"]
    from torch.utils.cpp_extension import load_inline

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    build_dir = Path(os.path.expanduser("~/.cache/pagedserve/w4_gemv_cuda")) / f"sm_{arch}"
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas=-v"]
    start = time.perf_counter()
    module = load_inline(  # type: ignore[no-untyped-call]
        name=f"pagedserve_w4_gemv_sm{arch}",
        cpp_sources=[_DECLARATION],
        cuda_sources=[_SOURCE.read_text()],
        functions=["w4_gemv_out"],
        extra_cuda_cflags=flags,
        build_directory=str(build_dir),
        verbose=verbose,
    )
    if verbose:
        print(f"w4_gemv_cuda: built/loaded in {time.perf_counter() - start:.1f} s")
    _LOADED["module"] = module
    return module


def supports(w: PackedWeights, x: torch.Tensor) -> bool:
    """Whether `w4_gemv` takes this weight and input (else the caller falls back): 4-bit, no
    act-order, groups of a multiple of 32 rows (or one group), 1..8 rows of fp16/bf16 x."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return (
        w.bits == 4
        and w.g_idx is None
        and w.perm is None
        and (w.group_size % 32 == 0 or w.scales.size(0) == 1)
        and w.scales.dtype in (torch.float16, torch.bfloat16)
        and (w.zeros is None or w.zeros.dtype == torch.int16)
        and x.dtype in (torch.float16, torch.bfloat16)
        and 1 <= x2.size(0) <= MAX_M
        and x2.size(1) == w.in_features
        and x.is_cuda
        and available()
    )


def repack(w: PackedWeights) -> torch.Tensor:  # [N_pad / 16, K_pad / 64, 32, 4] int32
    """The kernel's weight layout (module docstring), from `w.qweight` [K / 8, N] (run once at
    load; it allocates K x N bytes of temporaries)."""
    k, n = w.in_features, w.out_features
    k_pad, n_pad = -(-k // CHUNK_K) * CHUNK_K, -(-n // TILE_N) * TILE_N
    q = torch.zeros(k_pad, n_pad, dtype=torch.uint8, device=w.qweight.device)
    q[:k, :n] = unpack_int32(w.qweight, 4, 0).to(torch.uint8)
    # K = 64 c + 32 s + 8 t + i, N = 16 j + 8 h + g  ->  [j, c, g, t, s, h, i]
    q = q.view(k_pad // 64, 2, 4, 8, n_pad // 16, 2, 8).permute(4, 0, 6, 2, 1, 5, 3)
    words = torch.zeros(q.shape[:-1], dtype=torch.int64, device=q.device)  # [j, c, g, t, s, h]
    for i, position in enumerate((0, 4, 1, 5, 2, 6, 3, 7)):
        words |= q[..., i].to(torch.int64) << (4 * position)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.reshape(n_pad // 16, k_pad // 64, 32, 4).contiguous()


def pick_num_warps(n: int, k: int) -> int:
    """Warps of a block: enough that the GPU holds about WARPS_PER_SM warps per SM when there
    are few 16-column tiles, without warps left with no chunk."""
    num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    num_tiles = -(-n // TILE_N)
    num_chunks = -(-k // CHUNK_K)
    for warps in (4, 8, 16):
        if num_tiles * warps >= WARPS_PER_SM * num_sms:
            return min(warps, max(1, num_chunks))
    return min(16, max(1, num_chunks))


def w4_gemv(
    x: torch.Tensor,  # [..., K] float16 / bfloat16, at most MAX_M rows
    w: PackedWeights,
    repacked: torch.Tensor,  # repack(w)
    bias: torch.Tensor | None = None,  # [N]
    num_warps: int | None = None,  # default: pick_num_warps
    unroll: int = 4,  # chunks in flight per lane: 2, 4 or 8
) -> torch.Tensor:  # [..., N], x's dtype
    """x @ W^T (+ bias) for decode; the caller checks `supports(w, x)` first."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or x2.stride(0) != x2.size(1) or x2.data_ptr() % 16 != 0:
        x2 = x2.contiguous()  # the kernel's 16-byte loads of x rows
    n = w.out_features
    out = torch.empty(x2.size(0), n, dtype=x.dtype, device=x.device)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if num_warps is None:
        num_warps = pick_num_warps(n, x2.size(1))
    load().w4_gemv_out(  # type: ignore[attr-defined]
        x2, repacked, w.scales, w.zeros, bias, out, w.group_size, w.zero_value, num_warps, unroll
    )
    return out.reshape(*x.shape[:-1], n)
