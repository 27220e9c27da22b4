"""The fused mixture-of-experts computation in Triton (CUDA tensors; the CPU under
TRITON_INTERPRET=1 in the tests). Imported lazily by `fused_moe.py`: it imports triton.

    1. align     `moe_align_block_size`: the T * K (token, expert) pairs sorted by expert,
                 each expert's rows padded to block_m (moe_align.py)
    2. gate/up   grouped GEMM over those rows: rows of hidden_states x w13[e]^T for the gate
                 and the up half of the same output columns, SiLU(gate) * up in the epilogue
                 -> act [P, I] (one row per pair)
    3. down      grouped GEMM: act x w2[e]^T times the pair's routing weight -> y [P, H]
    4. sum       out[t] = sum_k y[t * K + k] over the pairs this rank holds (float32, in k order)

Activations and weights in one dtype (bf16 / fp16; fp32 with IEEE dots for the tests),
float32 accumulation. Everything is sized from T, K, E and the tile config alone, nothing is
read back to the host, so a CUDA graph of a decode step stays right for any routing.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import dataclasses

import torch
import triton
import triton.language as tl

from pagedserve.layers.moe.moe_align import moe_align_block_size
from pagedserve.layers.moe.reference import expert_scales

FP8_E4M3 = torch.float8_e4m3fn

# Tokens per pass: the act and y buffers are [chunk * K, I] and [chunk * K, H] (Mixtral:
# 470 MB for act at 8192 tokens), so long prefills run in chunks of this many tokens.
CHUNK_TOKENS = 8192
# Elements per program of the final sum: up to 1024 columns, several tokens when H is small.
_SUM_TILE = 4096
# Programs that keep an H200's 132 SMs busy in the memory-bound (decode) regime.
_TARGET_PROGRAMS = 264


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr, b_scale_ptr,
    N, K, num_pairs, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_se, stride_sn,
    ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    B_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """C[pair] = A[pair // ROWS_PER_A] @ B[expert]^T over one [BLOCK_M, BLOCK_N] tile.

    GATED: B's rows n (gate) and up_offset + n (up) both, C = silu(gate) * up.
    MUL_WEIGHT: C *= weights[pair]. B_SCALED: B is FP8, dequantized by its scale
    b_scale[expert, column] (stride_sn = 0 for one scale per expert) on the accumulator,
    exact since the FP8 values convert to A's dtype exactly. Padding rows
    (pair == num_pairs) load zeros and store nothing; row blocks at or past *total_ptr
    return at once."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    # Grouped order (GROUP_M row blocks share each B column tile while it is in L2).
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pair < num_pairs
    pair = pair.to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Columns past N wrap around (and are not stored), so the B loads need no column mask.
    b_cols = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + (pair // ROWS_PER_A)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + b_cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    up_shift = up_offset * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # unused (removed) unless GATED
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=pair_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(b_ptrs + up_shift)
            else:
                b_up = tl.load(b_ptrs + up_shift, mask=(offs_k < K - k0)[:, None], other=0.0)
            acc_up = tl.dot(a, b_up.to(a.dtype), acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if B_SCALED:
        scale_ptrs = b_scale_ptr + expert * stride_se + b_cols * stride_sn
        acc = acc * tl.load(scale_ptrs)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_ptrs + up_offset * stride_sn)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pair, mask=pair_mask, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = pair_mask[:, None] & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_sum_kernel(
    y_ptr, ids_ptr, out_ptr, num_tokens, hidden_size, expert_start, num_experts,
    stride_ym, stride_om, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """out[t] = sum over k of y[t * TOP_K + k] for a [BLOCK_T, BLOCK_H] tile, skipping pairs
    of other ranks' experts (their rows of y were never written)."""
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_mask = tokens < num_tokens
    col_mask = cols < hidden_size
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        local = tl.load(ids_ptr + tokens * TOP_K + k, mask=token_mask, other=0) - expert_start
        row_mask = token_mask & (local >= 0) & (local < num_experts)
        rows = (tokens * TOP_K + k) * stride_ym
        y = tl.load(
            y_ptr + rows[:, None] + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc += y.to(tl.float32)
    out_ptrs = out_ptr + tokens[:, None] * stride_om + cols[None, :]
    mask = token_mask[:, None] & col_mask[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True)
class GemmTile:
    """One grouped GEMM's tile: BLOCK_N, BLOCK_K, GROUP_M and the launch's warps/stages."""

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 4


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """block_m (rows per block, shared by both GEMMs: they use one alignment) and the tiles
    of the gate/up and down GEMMs."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile


def _decode_block_n(active_blocks: int, n: int, largest: int) -> int:
    """The widest BLOCK_N (<= largest) whose grid still fills the GPU: in the memory-bound
    regime each program streams its weight columns, and too few programs leave SMs idle."""
    block_n = largest
    while block_n > 32 and active_blocks * triton.cdiv(n, block_n) < _TARGET_PROGRAMS:
        block_n //= 2
    return block_n


def moe_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    intermediate: int,
    hidden: int,
    dtype: torch.dtype,
) -> MoeConfig:
    """The tiles for a call, by the average pairs per local expert (T * K / E): small
    (decode, weight-streaming) tiles when each expert sees a few tokens, large tensor-core
    tiles for prefill. Hand-picked for H200 (sm_90: 228 KB shared memory per SM), not tuned
    on it: `benchmarks/fused_moe.py --sweep` times the alternatives."""
    pairs = num_tokens * top_k
    per_expert = pairs / num_experts
    if per_expert <= 16:
        active = min(num_experts, pairs)  # row blocks with work: about one per used expert
        config = MoeConfig(
            16,
            GemmTile(_decode_block_n(active, intermediate, 64), 128),
            GemmTile(_decode_block_n(active, hidden, 128), 128),
        )
    elif per_expert <= 64:
        config = MoeConfig(32, GemmTile(64, 64, 4), GemmTile(64, 64, 4))
    elif per_expert <= 256:
        config = MoeConfig(64, GemmTile(64, 64, 8), GemmTile(128, 64, 8))
    else:
        config = MoeConfig(128, GemmTile(64, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3))
    if dtype == torch.float32:  # twice the bytes per tile: keep shared memory in bounds
        config = MoeConfig(
            config.block_m,
            *(dataclasses.replace(t, block_k=min(t.block_k, 32), num_stages=2)
              for t in (config.gate_up, config.down)),
        )  # fmt: skip
    return config


def _grouped_gemm(
    a: torch.Tensor,  # [rows, K]: hidden_states (ROWS_PER_A = top_k) or act (1)
    b: torch.Tensor,  # [E, N or 2N, K] in a's dtype, or FP8
    b_scale: torch.Tensor | None,  # FP8 b: [E, 1] or [E, N or 2N] float32
    c: torch.Tensor,  # [P, N] output
    weights: torch.Tensor,  # [P] routing weights (used with mul_weight)
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows_per_a: int,
    gated: bool,
    block_m: int,
    tile: GemmTile,
) -> None:
    sorted_ids, expert_ids, total = align
    n, k = c.shape[1], a.shape[1]
    scale = b_scale if b_scale is not None else weights  # any pointer when unscaled
    grid = (expert_ids.numel() * triton.cdiv(n, tile.block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, total, scale,
        n, k, c.shape[0], n,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        scale.stride(0) if b_scale is not None else 0,
        1 if b_scale is not None and b_scale.shape[1] > 1 else 0,
        ROWS_PER_A=rows_per_a, GATED=gated, MUL_WEIGHT=not gated, B_SCALED=b_scale is not None,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        EVEN_K=k % tile.block_k == 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def _weight_scales(
    dtype: torch.dtype, w: torch.Tensor, scale: torch.Tensor | None, name: str
) -> torch.Tensor | None:
    """`w`'s scales for the kernel ([E, 1] or [E, N] float32), None for a weight in the
    activation dtype. Raises ValueError for other dtypes or an FP8 weight without scales."""
    if w.dtype == FP8_E4M3 and scale is not None:
        return expert_scales(scale, w)
    if w.dtype == dtype and scale is None:
        return None
    raise ValueError(
        f"fused_moe: {name} is {w.dtype} with{'out' if scale is None else ''} a scale; want "
        f"the activations' dtype {dtype} without a scale, or float8_e4m3fn with one"
    )


def fused_moe_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """`moe_reference` (same arguments and result, shapes checked by the caller) by the
    Triton kernels; `config` overrides `moe_config`'s tiles (benchmark sweeps).
    hidden_states float16, bfloat16 or float32; w13 and w2 in that dtype, or float8_e4m3fn
    with w13_scale / w2_scale (`expert_scales`: per expert or per output row; weight-only
    FP8, the activations stay in their dtype).
    Raises ValueError for other dtypes or missing scales."""
    s13 = _weight_scales(hidden_states.dtype, w13, w13_scale, "w13")
    s2 = _weight_scales(hidden_states.dtype, w2, w2_scale, "w2")
    num_tokens, hidden = hidden_states.shape
    num_experts, intermediate = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    out = torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
    ids_all = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    weights_all = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    for start in range(0, num_tokens, CHUNK_TOKENS):
        end = min(start + CHUNK_TOKENS, num_tokens)
        x, ids = hidden_states[start:end], ids_all[start:end]
        cfg = config or moe_config(
            end - start, top_k, num_experts, intermediate, hidden, hidden_states.dtype
        )
        align = moe_align_block_size(ids, cfg.block_m, num_experts, expert_start)
        pairs = (end - start) * top_k
        weights = weights_all[start:end].reshape(-1)
        act = torch.empty(pairs, intermediate, dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, s13, act, weights, align, top_k, True, cfg.block_m, cfg.gate_up)
        y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
        _grouped_gemm(act, w2, s2, y, weights, align, 1, False, cfg.block_m, cfg.down)
        block_h = min(triton.next_power_of_2(hidden), 1024)
        block_t = _SUM_TILE // block_h
        grid = (triton.cdiv(end - start, block_t), triton.cdiv(hidden, block_h))
        _moe_sum_kernel[grid](
            y, ids, out[start:end], end - start, hidden, expert_start, num_experts,
            y.stride(0), out.stride(0), TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h,
        )  # fmt: skip
    return out
