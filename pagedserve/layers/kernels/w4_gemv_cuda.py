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

Work split: one block per NT x 16 output columns (NT = 1 or 2), its warps taking the chunks in
turn (warp w: chunks w, w + W, ...) in batches of UNROLL chunks, the next batch's loads in
flight while a batch is computed, the warps' sums added in shared memory. No split-K across
blocks, no workspace, no host syncs: safe in CUDA graphs.

Fused epilogues (`w4_gemv_silu_and_mul`, `w4_gemv_rope`): a block's two tiles can be partner
columns instead of neighbours, so that the GEMV finishes a layer's output itself: silu(gate) *
up of a [gate | up] layer (its N / 2 columns out), or the rotary embedding of a qkv layer's q
and k heads (column d of a head with its partner d + head_dim / 2). Each sum is rounded to x's
dtype first, as the plain GEMV's output is, so the result equals the GEMV with the same
num_warps followed by the separate kernel, up to that kernel's own fp32 rounding (the fused
GEMV has two tiles per block, so its default warps, and with them the fp32 sums' order, may
differ from the plain GEMV's pick). One kernel instead of two per layer at
decode: the activation's and the rotary's launches and their reads and writes of the output.

Programmatic dependent launch (compute capability 9.0+, `use_pdl`): the GEMV is launched with
CUDA's programmatic stream serialization, so that it may start while the kernel before it
finishes. It issues its first weight loads (weights, scales and zeros: written by no kernel),
then waits (PTX griddepcontrol.wait) before it reads x or writes anything; the small Triton
kernels that precede it in a decoder layer (RMSNorm, SiLU-and-mul, the decode attention and its
combine) signal at their start that it may launch (pagedserve/gdc.py). The GEMM launches
without it: on the H200, PDL made batch-64 decode 3% slower (BENCHMARKS.md, issue 15,
session 9).
"""

import functools
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import gdc
from pagedserve.layers.kernels import num_sms
from pagedserve.layers.quantization.packed import PackedWeights, unpack_int32

logger = logging.getLogger(__name__)

MAX_M = 8  # the MMA's N
TILE_N = 16  # output columns of a block
CHUNK_K = 64  # K rows of one lane's 16-byte load
MAX_K = 1 << 21  # the GEMV finds a row's group in fp32 (w4_gemv.cu, group_of): exact below this
# Aim for at least this many warps per SM (loads in flight) when choosing the warps of a GEMV
# block (pick_gemv_config; the H200 sweep's winners on Llama-8B's shapes had 8 to 27).
WARPS_PER_SM = 10
_SOURCES = [Path(__file__).with_name(name) for name in ("w4_gemv.cu", "w4_gemm.cu")]
_LOADED: dict[str, object] = {}  # "module": the extension, once built
_DECLARATION = """
bool w4_gemv_out(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                 std::optional<torch::Tensor> zeros, std::optional<torch::Tensor> bias,
                 torch::Tensor out, int64_t group_size, int64_t zero_value, int64_t num_warps,
                 int64_t unroll, int64_t nt, bool pdl, int64_t epilogue, int64_t period,
                 std::optional<torch::Tensor> positions, std::optional<torch::Tensor> cos_sin,
                 int64_t rot_cols, int64_t half);
bool w4_gemm_out(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                 std::optional<torch::Tensor> zeros, std::optional<torch::Tensor> bias,
                 torch::Tensor out, int64_t group_size, int64_t zero_value, int64_t num_warps,
                 int64_t split, int64_t mt, int64_t nt, int64_t kw);
void w4_dequant_out(torch::Tensor qweight, torch::Tensor scales,
                    std::optional<torch::Tensor> zeros, torch::Tensor out, int64_t group_size,
                    int64_t zero_value);
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
        cuda_sources=["\n".join(source.read_text() for source in _SOURCES)],
        functions=["w4_gemv_out", "w4_gemm_out", "w4_dequant_out"],
        extra_cuda_cflags=flags,
        build_directory=str(build_dir),
        verbose=verbose,
    )
    if verbose:
        print(f"w4_gemv_cuda: built/loaded in {time.perf_counter() - start:.1f} s")
    logger.info(
        "W4A16 CUDA kernels ready in %.1f s (built once per machine, cached in %s)",
        time.perf_counter() - start,
        build_dir,
    )
    _LOADED["module"] = module
    return module


@functools.cache
def built() -> bool:
    """Whether the extension builds and loads here (`available`, then `load`: about a minute
    the first time on a machine). A failed build is logged, not raised: the 4-bit layers then
    take the Triton kernels."""
    if not available():
        return False
    try:
        load()
    except Exception as e:  # noqa: BLE001 (any build failure means "use the Triton kernels")
        logger.warning("the W4A16 CUDA kernels did not build, using Triton's instead: %s", e)
        return False
    return True


def use_pdl(device: torch.device) -> bool:
    """Whether `w4_gemv` launches with programmatic dependent launch on `device`
    (`gdc.pdl_enabled`: compute capability 9.0+, PAGEDSERVE_PDL not "0")."""
    return gdc.pdl_enabled(device)


def supports_weight(w: "PackedWeights | RepackedWeights") -> bool:
    """Whether the kernels take this weight: 4-bit, no act-order, groups of a multiple of 32
    rows (or one group), fp16/bf16 scales, int16 or constant zero points, K below MAX_K, on a
    CUDA device where the extension can be built."""
    return (
        w.bits == 4
        and w.g_idx is None
        and w.perm is None
        and (w.group_size % 32 == 0 or w.scales.size(0) == 1)
        and w.scales.dtype in (torch.float16, torch.bfloat16)
        and (w.zeros is None or w.zeros.dtype == torch.int16)
        and w.scales.is_cuda
        and w.in_features < MAX_K
        and available()
    )


def supports(w: "PackedWeights | RepackedWeights", x: torch.Tensor) -> bool:
    """Whether `w4_gemv` takes this weight and input (else the caller falls back):
    `supports_weight` and 1..8 rows of fp16/bf16 x on the GPU."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and 1 <= x2.size(0) <= MAX_M
        and x2.size(1) == w.in_features
        and supports_weight(w)
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


# (unroll, nt) of the GEMV that the extension builds (w4_gemv.cu's dispatch): chunks per batch
# of a warp's loads, and 16-column tiles per block.
GEMV_CONFIGS = ((2, 1), (2, 2), (4, 1))
# The (unroll, nt) of the fused epilogues (w4_gemv.cu's kEpiSiluMul / kEpiRope): two tiles per
# block, a column and its partner.
EPILOGUE_CONFIG = (2, 2)
EPI_NONE, EPI_SILU_MUL, EPI_ROPE = 0, 1, 2  # w4_gemv.cu's kEpi*


def pick_gemv_config(n: int, k: int, nt: int | None = None) -> tuple[int, int, int]:
    """(num_warps, unroll, nt) of `w4_gemv`: two tiles per block when there are at least 8
    tiles per SM (the per-chunk work on x shared by both), else one (more blocks for narrow
    layers); the fewest warps of 4 / 8 / 16 that give the GPU WARPS_PER_SM warps per SM, without
    warps left with no chunk; batches of 4 chunks when a warp has at least 16 chunks and one
    tile, else 2. On the H200 this picks the sweep's best config for each of Llama-8B's four
    linears at M = 1 (benchmarks/w4_gemv_cuda.py --sweep; BENCHMARKS.md, issue 15). `nt`
    forces the tiles per block (the fused epilogues take 2)."""
    sms = num_sms(torch.cuda.current_device())
    num_tiles = -(-n // TILE_N)
    num_chunks = -(-k // CHUNK_K)
    if nt is None:
        nt = 2 if num_tiles >= 8 * sms else 1
    blocks = -(-num_tiles // nt)
    warps = 16
    for candidate in (4, 8):
        if blocks * candidate >= WARPS_PER_SM * sms:
            warps = candidate
            break
    warps = min(warps, max(1, num_chunks))
    unroll = 4 if nt == 1 and num_chunks >= 16 * warps else 2
    return warps, unroll, nt


def w4_gemv(
    x: torch.Tensor,  # [..., K] float16 / bfloat16, at most MAX_M rows
    w: "PackedWeights | RepackedWeights",
    repacked: torch.Tensor,  # repack(w)
    bias: torch.Tensor | None = None,  # [N]
    config: tuple[int, int, int] | None = None,  # (num_warps, unroll, nt): pick_gemv_config
    pdl: bool | None = None,  # programmatic dependent launch; None: use_pdl
) -> torch.Tensor:  # [..., N], x's dtype
    """x @ W^T (+ bias) for decode; the caller checks `supports(w, x)` first. ValueError for
    a config whose (unroll, nt) is not in GEMV_CONFIGS or whose num_warps is not 1..16."""
    x2 = x.reshape(-1, x.shape[-1])
    n = w.out_features
    num_warps, unroll, nt = config or pick_gemv_config(n, x2.size(1))
    if (unroll, nt) not in GEMV_CONFIGS or not 1 <= num_warps <= 16:
        raise ValueError(
            f"w4_gemv: (num_warps, unroll, nt) = {(num_warps, unroll, nt)} is not built: "
            f"num_warps 1..16 and (unroll, nt) in GEMV_CONFIGS = {GEMV_CONFIGS}"
        )
    out = _launch_gemv(x2, w, repacked, bias, n, (num_warps, unroll, nt), pdl, EPI_NONE, 0)
    return out.reshape(*x.shape[:-1], n)


def _launch_gemv(
    x2: torch.Tensor,  # [M, K]
    w: "PackedWeights | RepackedWeights",
    repacked: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,  # columns of the output
    config: tuple[int, int, int],
    pdl: bool | None,
    epilogue: int,  # EPI_*
    period: int,  # tiles between partners (fused epilogues)
    positions: torch.Tensor | None = None,  # EPI_ROPE
    cos_sin: torch.Tensor | None = None,
    rot_cols: int = 0,
    half: int = 0,
) -> torch.Tensor:  # [M, out_features], x's dtype
    num_warps, unroll, nt = config
    if x2.stride(-1) != 1 or x2.stride(0) != x2.size(1) or x2.data_ptr() % 16 != 0:
        # the kernel's 16-byte loads of x rows (a contiguous view at an odd offset stays
        # misaligned through .contiguous(): copy)
        x2 = x2.clone(memory_format=torch.contiguous_format)
    out = torch.empty(x2.size(0), out_features, dtype=x2.dtype, device=x2.device)
    if bias is not None and bias.dtype != x2.dtype:
        bias = bias.to(x2.dtype)
    launched = load().w4_gemv_out(  # type: ignore[attr-defined]
        x2, repacked, w.scales, w.zeros, bias, out, w.group_size, w.zero_value, num_warps,
        unroll, nt, use_pdl(x2.device) if pdl is None else pdl, epilogue, period, positions,
        cos_sin, rot_cols, half,
    )  # fmt: skip
    if not launched:  # GEMV_CONFIGS and w4_gemv.cu's dispatch disagree
        raise RuntimeError(
            f"w4_gemv: {(unroll, nt)} with epilogue {epilogue} is not a built configuration "
            "of the extension"
        )
    return out


def epilogue_config(n: int, k: int, num_warps: int | None = None) -> tuple[int, int, int]:
    """(num_warps, unroll, nt) of a fused-epilogue GEMV: EPILOGUE_CONFIG with `num_warps`,
    by default `pick_gemv_config`'s for two tiles per block. ValueError outside 1..16."""
    if num_warps is None:
        num_warps = pick_gemv_config(n, k, nt=2)[0]
    if not 1 <= num_warps <= 16:
        raise ValueError(f"w4_gemv: num_warps must be 1..16, got {num_warps}")
    return (num_warps, *EPILOGUE_CONFIG)


def supports_silu_and_mul(w: "PackedWeights | RepackedWeights", x: torch.Tensor) -> bool:
    """Whether `w4_gemv_silu_and_mul` takes this [gate | up] weight and x: `supports`, x in
    the scales' dtype, and N / 2 a multiple of 16 (a tile never holds both halves)."""
    n = w.out_features
    return n % (2 * TILE_N) == 0 and x.dtype == w.scales.dtype and supports(w, x)


def w4_gemv_silu_and_mul(
    x: torch.Tensor,  # [M, K] float16 / bfloat16, 1..MAX_M rows
    w: "PackedWeights | RepackedWeights",  # [gate | up]: N = 2 * intermediate
    repacked: torch.Tensor,  # repack(w)
    bias: torch.Tensor | None = None,  # [N]
    pdl: bool | None = None,
    num_warps: int | None = None,  # None: pick_gemv_config's for two tiles per block
) -> torch.Tensor:  # [M, N / 2], x's dtype
    """silu(gate) * up of h = x @ W^T (+ bias) = [gate | up] in one kernel (SwiGLU, as
    `fused_ops.silu_and_mul` computes it from h rounded to x's dtype); the caller checks
    `supports_silu_and_mul` first. ValueError for num_warps outside 1..16."""
    x2 = x.reshape(-1, x.shape[-1])
    n, k = w.out_features, x2.size(1)
    config = epilogue_config(n, k, num_warps)
    period = n // (2 * TILE_N)
    out = _launch_gemv(x2, w, repacked, bias, n // 2, config, pdl, EPI_SILU_MUL, period)
    return out.reshape(*x.shape[:-1], n // 2)


def supports_rope(
    w: "PackedWeights | RepackedWeights",
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rot_cols: int,
) -> bool:
    """Whether `w4_gemv_rope` takes this qkv weight and its inputs: `supports`, x in the
    scales' dtype, head_dim a multiple of 32 (a half head is whole tiles) dividing N and
    rot_cols (<= N), one int64 position per row of x, and a float32 [*, head_dim] table on
    x's device."""
    n = w.out_features
    return (
        head_dim % (2 * TILE_N) == 0
        and n % head_dim == 0
        and rot_cols % head_dim == 0
        and 0 <= rot_cols <= n
        and positions.dim() == 1
        and positions.stride(0) == 1
        and positions.dtype == torch.int64
        and positions.device == x.device
        and positions.numel() == x.reshape(-1, x.shape[-1]).size(0)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.size(1) == head_dim
        and cos_sin_cache.stride(1) == 1
        and cos_sin_cache.device == x.device
        and x.dtype == w.scales.dtype
        and supports(w, x)
    )


def w4_gemv_rope(
    x: torch.Tensor,  # [M, K] float16 / bfloat16, 1..MAX_M rows
    w: "PackedWeights | RepackedWeights",  # q | k | v heads of head_dim columns
    repacked: torch.Tensor,  # repack(w)
    positions: torch.Tensor,  # [M] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] float32, [cos | sin]
    head_dim: int,
    rot_cols: int,  # the q and k heads' columns (rotated); the rest (v) is not
    bias: torch.Tensor | None = None,  # [N]
    pdl: bool | None = None,
    num_warps: int | None = None,  # None: pick_gemv_config's for two tiles per block
) -> torch.Tensor:  # [M, N], x's dtype
    """x @ W^T (+ bias) with the rotary embedding (neox layout: column d of a head with d +
    head_dim / 2) applied to the first `rot_cols` columns in the same kernel, as
    `fused_ops.rotary_embedding` computes it from the output rounded to x's dtype; the caller
    checks `supports_rope` first. ValueError for num_warps outside 1..16."""
    x2 = x.reshape(-1, x.shape[-1])
    n, k = w.out_features, x2.size(1)
    config = epilogue_config(n, k, num_warps)
    half = head_dim // 2
    out = _launch_gemv(
        x2, w, repacked, bias, n, config, pdl, EPI_ROPE, half // TILE_N, positions,
        cos_sin_cache, rot_cols, half,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


# Rows of x from which dequantize + cuBLAS replaces `w4_gemm`: on the H200 the GEMM won at
# M = 64 (one Llama-8B layer's linears 0.21 ms against 0.27) and lost at M = 128 (0.39 against
# 0.28; BENCHMARKS.md, issue 15, session 5).
GEMM_MAX_M = 65
# Columns of a block up to M = 32: (warps, nt) = (8, 1) up to this N, else (4, 2): the H200
# sweep's winners (benchmarks/w4_gemv_cuda.py --sweep, M = 16 / 32).
GEMM_NARROW_N = 8192
# (num_warps, mt, nt, kw) of the GEMM that the extension builds (w4_gemm.cu's dispatch): warps
# per K group of a block, m16 row tiles per block, 16-column tiles per warp, and K groups per
# block (kw x num_warps warps in all).
GEMM_CONFIGS = (
    (8, 1, 1, 1), (4, 1, 2, 1), (4, 2, 2, 1), (8, 2, 1, 1), (4, 4, 1, 1), (8, 4, 1, 1),
    (4, 4, 2, 1), (8, 4, 2, 1),
    (8, 1, 1, 2), (4, 1, 2, 2), (4, 4, 1, 2), (8, 4, 1, 2), (8, 4, 2, 2),
)  # fmt: skip


def pick_gemm_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(num_warps, split, mt, nt, kw) of `w4_gemm` for M rows of x, after the H200 sweep on
    Llama-8B's linears (benchmarks/w4_gemv_cuda.py --sweep; BENCHMARKS.md, issue 15). Up to
    M = 32: m16 tiles per block by M, block widths by GEMM_NARROW_N, and split-K until the grid
    has about 6 (M <= 16) or 4 blocks per SM. Above: 64 rows per block (each dequantized
    weight serves them all); when blocks of 8 warps x 2 tiles already fill about one wave, those
    without split-K (its fp32 partial sums cost more than the idle SMs: gate_up) and with two K
    groups (kw 2: 16 warps per SM instead of 8; gate_up 65.9 us against 69.9), else one tile
    per warp and a split per 16 chunks (4 warps, or 8 from 128 chunks: down). Every split keeps
    at least 4 chunks (256 rows of K); at most 8 splits."""
    sms = num_sms(torch.cuda.current_device())
    num_chunks = -(-k // CHUNK_K)
    max_split = max(1, min(8, num_chunks // 4))
    if m > 32:
        row_blocks = -(-m // 64)
        if -(-n // (TILE_N * 2 * 8)) * row_blocks >= 0.8 * sms:
            return 8, 1, 4, 2, 2
        warps = 8 if num_chunks >= 128 else 4
        return warps, max(1, min(num_chunks // 16, max_split)), 4, 1, 1
    narrow = n <= GEMM_NARROW_N
    if m <= 16:
        mt, (warps, nt), target = 1, ((8, 1) if narrow else (4, 2)), 6 * sms
    else:
        mt, (warps, nt), target = 2, (4, 2), 4 * sms
    blocks = -(-n // (TILE_N * nt * warps)) * -(-m // (16 * mt))
    return warps, max(1, min(-(-target // blocks), max_split)), mt, nt, 1


def w4_gemm(
    x: torch.Tensor,  # [M, K] float16 / bfloat16
    w: "PackedWeights | RepackedWeights",
    repacked: torch.Tensor,  # repack(w)
    scales: torch.Tensor,  # [G, N] w.scales in x's dtype
    bias: torch.Tensor | None = None,  # [N]
    config: tuple[int, int, int, int, int] | None = None,  # (num_warps, split, mt, nt, kw)
) -> torch.Tensor:  # [M, N], x's dtype
    """x @ W^T (+ bias) on tensor cores for more than MAX_M rows (w4_gemm.cu): each weight is
    (q - z) * scale rounded to x's dtype, the products summed in fp32. For a weight that
    `supports_weight`, with N a multiple of 8 and 16-byte aligned scales / zeros (as
    `RepackedWeights` holds them); raises RuntimeError from the extension otherwise, and
    ValueError for a config whose (num_warps, mt, nt, kw) is not in GEMM_CONFIGS."""
    m, k = x.shape
    n = w.out_features
    warps, split, mt, nt, kw = config or pick_gemm_config(m, n, k)
    if (warps, mt, nt, kw) not in GEMM_CONFIGS or split < 1:
        raise ValueError(
            f"w4_gemm: (num_warps, mt, nt, kw) = {(warps, mt, nt, kw)} with split {split} is "
            f"not built: split >= 1 and GEMM_CONFIGS = {GEMM_CONFIGS}"
        )
    if x.stride(-1) != 1 or x.stride(0) != k or x.data_ptr() % 16 != 0:
        x = x.clone(memory_format=torch.contiguous_format)  # 16-byte copies of x rows
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    launched = load().w4_gemm_out(  # type: ignore[attr-defined]
        x, repacked, scales, w.zeros, bias, out, w.group_size, w.zero_value, warps, split, mt,
        nt, kw,
    )  # fmt: skip
    if not launched:  # GEMM_CONFIGS and w4_gemm.cu's dispatch disagree
        raise RuntimeError(
            f"w4_gemm: {(warps, mt, nt, kw)} is not a built configuration of the extension"
        )
    return out


def dequantize_repacked(
    w: "PackedWeights | RepackedWeights",
    repacked: torch.Tensor,  # repack(w)
    scales: torch.Tensor,  # [G, N] in the output dtype
) -> torch.Tensor:  # [N, K] in scales' dtype: W, as F.linear takes it
    """The float weight from the repacked layout, each element (q - zero) * scale in fp32
    rounded to scales' dtype (for large M: then cuBLAS)."""
    return _dequantize(repacked, scales, w.zeros, w.in_features, w.group_size, w.zero_value)


def _dequantize(
    repacked: torch.Tensor,  # [N / 16 (rounded up), K_pad / 64, 32, 4] int32: some tiles
    scales: torch.Tensor,  # [G, N] of those tiles' columns, contiguous
    zeros: torch.Tensor | None,  # [G, N] int16, contiguous
    k: int,
    group_size: int,
    zero_value: int,
) -> torch.Tensor:  # [N, K] in scales' dtype
    out = torch.empty(scales.size(1), k, dtype=scales.dtype, device=repacked.device)
    load().w4_dequant_out(  # type: ignore[attr-defined]
        repacked, scales, zeros, out, group_size, zero_value
    )
    return out


# Bytes of one dequantized slice of W in `dequant_linear`: bounds the temporary that large-M
# steps (prefill, and the decode CUDA graphs above GEMM_MAX_M rows, whose memory pool is
# outside the profiled peak) hold, 235 MB for all of Llama-8B's gate_up otherwise.
DEQUANT_SLICE_BYTES = 64 << 20


def dequant_linear(
    x: torch.Tensor,  # [M, K] in the scales' dtype
    w: "RepackedWeights",
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """x @ W^T (+ bias) through cuBLAS on W dequantized a slice of whole 16-column tiles at a
    time, each slice at most DEQUANT_SLICE_BYTES (one slice when W fits)."""
    n, k = w.out_features, w.in_features
    cols = max(TILE_N, DEQUANT_SLICE_BYTES // (2 * k) // TILE_N * TILE_N)
    if cols >= n:
        return F.linear(x, dequantize_repacked(w, w.repacked, w.scales), bias)
    out = torch.empty(x.size(0), n, dtype=x.dtype, device=x.device)
    for c0 in range(0, n, cols):
        c1 = min(n, c0 + cols)
        zeros = None if w.zeros is None else w.zeros[:, c0:c1].contiguous()
        weight = _dequantize(
            w.repacked[c0 // TILE_N : -(-c1 // TILE_N)],
            w.scales[:, c0:c1].contiguous(),
            zeros,
            k,
            w.group_size,
            w.zero_value,
        )
        out[:, c0:c1] = F.linear(x, weight, None if bias is None else bias[c0:c1])
    return out


class RepackedWeights(nn.Module):
    """A 4-bit GPTQ / AWQ weight in these kernels' layout only: `repacked` (module docstring)
    replaces `PackedWeights.qweight`, which is dropped so the weight is held once; `scales`
    [G, N] stay in the model's dtype (the activations'), as loaded. Built at load from a
    `PackedWeights` that `supports_weight`; `w4_linear` is its matmul for every M."""

    g_idx = None  # no act-order (supports_weight)
    perm = None

    def __init__(self, w: PackedWeights) -> None:
        super().__init__()
        self.bits, self.group_size, self.zero_value = 4, w.group_size, w.zero_value
        self.in_features, self.out_features = w.in_features, w.out_features
        self.repacked = nn.Parameter(repack(w), requires_grad=False)
        # fresh tensors: 16-byte aligned for the GEMM's copies
        self.scales = nn.Parameter(w.scales.clone(), requires_grad=False)
        zeros = None if w.zeros is None else w.zeros.clone()
        self.zeros = None if zeros is None else nn.Parameter(zeros, requires_grad=False)


def w4_linear(
    x: torch.Tensor,  # [..., K] in the scales' dtype
    w: RepackedWeights,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N], x's dtype
    """x @ W^T (+ bias) for any number of rows M of x: `w4_gemv` for M <= MAX_M, `w4_gemm`
    below GEMM_MAX_M (N a multiple of 8), else `dequant_linear` (cuBLAS on dequantized
    slices). x in another dtype than the scales (not what a model built with them passes)
    takes the dequantized path in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.size(0)
    if x.dtype != w.scales.dtype:
        weight = dequantize_repacked(w, w.repacked, w.scales).to(x.dtype)
        out = F.linear(x2, weight, bias)
    elif m <= MAX_M and m > 0:
        out = w4_gemv(x2, w, w.repacked, bias)
    elif m < GEMM_MAX_M and w.out_features % 8 == 0:
        out = w4_gemm(x2, w, w.repacked, w.scales, bias)
    else:
        out = dequant_linear(x2, w, bias)
    return out.reshape(*x.shape[:-1], out.size(-1))
