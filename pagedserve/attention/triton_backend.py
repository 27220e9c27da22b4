"""Triton attention backend: plans one step's kernel launches and runs them (GPU default).

Importing this module imports Triton, so it raises ImportError where Triton is missing;
`get_attention_backend` imports it only when asked for "triton" or "auto".
"""

import functools
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve import envs
from pagedserve.attention.kernels.paged_attention import (
    combine_splits_kernel,
    paged_attention_kernel,
)
from pagedserve.attention.kernels.store_kv import store_kv_kernel
from pagedserve.attention.kv_quant import fp8_max, is_fp8
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.gdc import pdl_trigger

_LOG2E = 1.4426950408889634
_DEFAULT_NUM_SMS = 132  # H200; used off CUDA (Triton's CPU interpreter)
# Split-KV: fill up to this many programs per SM in the decode launch (its default tiles fit
# 5), use at most (a request's key tiles) // this many splits per request (the kernel's
# `_split_tiles`: each split but a request's last gets at least this many tiles), and never
# exceed this many splits (a power of two: the combine loads that many partials at once).
_SPLIT_PROGRAMS_PER_SM = 4
_SPLIT_MIN_TILES = 1
_MAX_SPLITS = 64
_MAX_QUERY_LEN = 2**31 - 1


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Tile sizes and launch options of one launch of `paged_attention_kernel`."""

    block_m: int  # rows per program: block_m // num_queries_per_kv tokens x the group's heads
    tile_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """The launches of one step, decided on the host from CPU metadata only (no sync).

    Requests with 1 <= query_len <= `decode_max_query_len` (decodes, and short chunks that fit
    one q block) go to the decode launch, one program per (request, kv head, split); longer ones
    go to the prefill launch, whose q blocks are found by binary search on the device.
    """

    decode: TileConfig | None
    prefill: TileConfig | None
    decode_max_query_len: int
    num_splits: int  # split-KV programs per (request, kv head) in the decode launch; 1 = off
    # A request uses at most (its key tiles) // this of the splits (so a graph captured at
    # max_model_len does not cut a short request into slivers).
    split_min_tiles: int = _SPLIT_MIN_TILES


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# The fp8 cache's fp16 dots (paged_attention.py); envs.fp8_kv_f16_dots says why a switch.
_F16_DOTS = envs.fp8_kv_f16_dots()


def _head_dim_pad(head_dim: int) -> int:
    """Power of two >= head_dim, and >= 16: the smallest K of a Triton dot."""
    return max(_next_pow2(head_dim), 16)


def decode_tile_config(
    num_queries_per_kv: int, head_dim: int, dtype: torch.dtype, split: bool = True
) -> TileConfig:
    """Small M: a decode program holds one token times its kv head's query heads. Key tiles
    of 8192 elements (16 KiB of K in half precision); two stages keep registers near 96, so 5
    programs fit an SM. Without split-KV (batches big enough to fill the GPU) 2 warps a
    program read K/V 1-7% faster than 4 (5.5% at 256 requests x 576 keys); the split path,
    latency-bound on few requests, keeps 4. H200 sweeps in docs/kernels.md."""
    block_m = max(16, _next_pow2(num_queries_per_kv))
    if dtype == torch.float32:
        return TileConfig(block_m, 32, num_warps=4, num_stages=1)
    tile_n = min(max(8192 // _head_dim_pad(head_dim), 32), 128)
    return TileConfig(block_m, tile_n, num_warps=4 if split else 2, num_stages=2)


def prefill_tile_config(num_queries_per_kv: int, head_dim: int, dtype: torch.dtype) -> TileConfig:
    """M = 64 rows: as fast as 128 on long prefills on H200 and twice the programs for short
    chunks; smaller key tiles for wide heads and fp32 (registers)."""
    group_m = _next_pow2(num_queries_per_kv)
    if dtype == torch.float32:
        return TileConfig(max(32, group_m), 32, num_warps=4, num_stages=1)
    tile_n = 32 if _head_dim_pad(head_dim) > 128 else 64
    return TileConfig(max(64, group_m), tile_n, num_warps=4, num_stages=2)


def _check_num_splits(num_splits: int) -> None:
    """ValueError for a forced split count the combine cannot merge (it loads at most
    _MAX_SPLITS partials per row)."""
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be 1..{_MAX_SPLITS}, got {num_splits}")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_num_splits(num_programs: int, max_keys: int, num_sms: int, min_keys: int) -> int:
    """Splits per (request, kv head) so that a decode launch of `num_programs` programs fills
    the GPU in one wave: none when it already has enough programs or the key ranges are short.
    `max_keys`: the most keys one program reads (the longest sequence, or the window);
    `min_keys`: the fewest keys worth a split of their own."""
    wanted = _SPLIT_PROGRAMS_PER_SM * num_sms // max(num_programs, 1)
    most = max_keys // max(min_keys, 1)
    return max(min(wanted, most, _MAX_SPLITS), 1)


def plan_attention(
    attn_metadata: AttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    num_splits: int | None = None,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """Choose the launches of a step. `num_splits` forces the split count (None: heuristic).
    With a `sliding_window`, a decode program reads at most the window's keys (plus the
    rest of its q block), so the split heuristic counts those, not `max_seq_len`.

    A batch with no query longer than one decode q block (decode-only, e.g. a CUDA graph's
    padded batch whose padding has query_len 0) always gets exactly the decode launch, so a
    captured graph stays right for any decode-only batch of its size.
    """
    group = num_heads // num_kv_heads
    decode = decode_tile_config(group, head_dim, dtype)
    decode_max_query_len = decode.block_m // group  # the same for either warp count
    has_prefill = attn_metadata.max_query_len > decode_max_query_len
    num_decode_reqs = attn_metadata.num_reqs
    if has_prefill:
        query_lens = np.diff(attn_metadata.query_start_loc_cpu.numpy())
        num_decode_reqs = int(np.count_nonzero(query_lens <= decode_max_query_len))
    if has_prefill and num_decode_reqs == 0:
        return AttentionPlan(None, prefill_tile_config(group, head_dim, dtype), 0, 1)
    if num_splits is None:
        num_sms = _num_sms(device)
        max_keys = attn_metadata.max_seq_len
        if sliding_window is not None:
            max_keys = min(max_keys, sliding_window + decode_max_query_len - 1)
        num_splits = choose_num_splits(
            num_decode_reqs * num_kv_heads, max_keys, num_sms, _SPLIT_MIN_TILES * decode.tile_n
        )
    if num_splits == 1:
        decode = decode_tile_config(group, head_dim, dtype, split=False)
    prefill = prefill_tile_config(group, head_dim, dtype) if has_prefill else None
    return AttentionPlan(decode, prefill, decode_max_query_len, num_splits)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
) -> None:
    """Write each new token's K and V at its slot (the Triton twin of `write_kv_cache`,
    quantizing for an fp8 cache as `kv_quant.quantize_kv` does, to the same bytes)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    quantized = is_fp8(kv_cache.dtype)
    scaled = quantized and k_scale is not None and v_scale is not None
    head_dim_pad = _next_pow2(head_dim)
    block_h = min(_next_pow2(num_kv_heads), max(4096 // head_dim_pad, 1))
    grid = (num_tokens, -(-num_kv_heads // block_h))
    store_kv_kernel[grid](
        key, value, kv_cache, slot_mapping,
        k_scale if scaled else slot_mapping, v_scale if scaled else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=block_h,
        FP8_MAX=fp8_max(kv_cache.dtype) if quantized else 0.0, KV_SCALED=scaled,
    )  # fmt: skip


def paged_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written for every request's token
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    attn_metadata: AttentionMetadata,
    scale: float,
    plan: AttentionPlan,
    k_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Attend every new token over its request's cached K/V (already holding this step's).
    Tokens past query_start_loc[-1] (a padded batch's padding) are left unwritten. An fp8
    cache is read as k_fp8 * k_scale and v_fp8 * v_scale (the scales applied in the kernel).
    `sliding_window` W: a token at position p sees keys p - W + 1 .. p, and block-table
    entries of keys before the window of a request's first new token are never read (the KV
    manager may have freed them). `logits_soft_cap` c: scores become c * tanh(score / c).
    Each is a compile-time constant of the kernels (None compiles them out). ValueError for a
    plan of more than 64 (`_MAX_SPLITS`) or fewer than 1 splits."""
    md = attn_metadata
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if num_tokens == 0 or md.num_reqs == 0:
        return
    assert query.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    head_dim_pad = _head_dim_pad(head_dim)
    scaled = is_fp8(kv_cache.dtype) and k_scale is not None and v_scale is not None
    common: dict[str, object] = dict(
        query_ptr=query, kv_cache_ptr=kv_cache, block_tables_ptr=md.block_tables,
        k_scale_ptr=k_scale if scaled else md.seq_lens,
        v_scale_ptr=v_scale if scaled else md.seq_lens, KV_SCALED=scaled,
        F16_DOTS=is_fp8(kv_cache.dtype) and query.dtype == torch.bfloat16 and _F16_DOTS,
        seq_lens_ptr=md.seq_lens, query_start_loc_ptr=md.query_start_loc, num_reqs=md.num_reqs,
        qk_scale=scale * _LOG2E,
        stride_q_token=query.stride(0), stride_q_head=query.stride(1),
        stride_o_token=out.stride(0), stride_o_head=out.stride(1),
        stride_cache_kv=kv_cache.stride(0), stride_cache_block=kv_cache.stride(1),
        stride_cache_slot=kv_cache.stride(2), stride_cache_head=kv_cache.stride(3),
        stride_block_tables=md.block_tables.stride(0),
        NUM_QUERIES_PER_KV=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SLIDING_WINDOW=sliding_window or 0,
        SOFT_CAP=logits_soft_cap * _LOG2E if logits_soft_cap else 0.0,
    )  # fmt: skip
    if plan.decode is not None:
        # the decode launch or its combine is the o projection's predecessor (gdc.py)
        pdl = pdl_trigger(out.device)
        tile = plan.decode
        block_q = tile.block_m // group
        num_splits = plan.num_splits
        _check_num_splits(num_splits)  # a forced count (the heuristic stays inside)
        partial_shape = (md.num_reqs, num_kv_heads, num_splits, tile.block_m)
        partial_max = partial_sum = partial_acc = out  # placeholders when not split
        if num_splits > 1:
            partial_max = out.new_empty(partial_shape, dtype=torch.float32)
            partial_sum = out.new_empty(partial_shape, dtype=torch.float32)
            partial_acc = out.new_empty((*partial_shape, head_dim_pad), dtype=torch.float32)
        paged_attention_kernel[(md.num_reqs, num_kv_heads, num_splits)](
            out_ptr=out, partial_acc_ptr=partial_acc, partial_max_ptr=partial_max,
            partial_sum_ptr=partial_sum, query_len_lo=1, query_len_hi=plan.decode_max_query_len,
            BLOCK_M=tile.block_m, BLOCK_Q=block_q, TILE_N=tile.tile_n,
            ONE_Q_BLOCK=True, SPLIT_KV=num_splits > 1, SPLIT_MIN_TILES=plan.split_min_tiles,
            PDL_TRIGGER=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages, **common,
        )  # fmt: skip
        if num_splits > 1:
            combine_splits_kernel[(md.num_reqs, num_kv_heads, block_q * group)](
                out, partial_acc, partial_max, partial_sum, md.query_start_loc, md.seq_lens,
                num_splits, 1, plan.decode_max_query_len, out.stride(0), out.stride(1),
                NUM_QUERIES_PER_KV=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                BLOCK_M=tile.block_m, BLOCK_Q=block_q, TILE_N=tile.tile_n,
                SLIDING_WINDOW=sliding_window or 0, SPLIT_MIN_TILES=plan.split_min_tiles,
                MAX_SPLITS=_MAX_SPLITS, PDL_TRIGGER=pdl, num_warps=4 if head_dim_pad <= 128 else 8,
            )  # fmt: skip
    if plan.prefill is not None:
        tile = plan.prefill
        block_q = tile.block_m // group
        grid = (num_tokens // block_q + md.num_reqs, num_kv_heads, 1)
        paged_attention_kernel[grid](
            out_ptr=out, partial_acc_ptr=out, partial_max_ptr=out, partial_sum_ptr=out,
            query_len_lo=plan.decode_max_query_len + 1, query_len_hi=_MAX_QUERY_LEN,
            BLOCK_M=tile.block_m, BLOCK_Q=block_q, TILE_N=tile.tile_n,
            ONE_Q_BLOCK=False, SPLIT_KV=False, SPLIT_MIN_TILES=1,  # one split: unused
            num_warps=tile.num_warps, num_stages=tile.num_stages, **common,
        )  # fmt: skip


class TritonAttentionBackend:
    """Stores new K/V with `store_kv_kernel`, then runs `paged_attention_kernel` (one launch
    for decodes, one for longer queries; split-KV for decode launches too small to fill the GPU),
    with the layer's sliding window and logit soft cap (see `paged_attention`).

    The plan is computed once per step: every layer gets the same AttentionMetadata object.
    No device->host sync happens, so decode-only steps can be captured in a CUDA graph.
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        """`num_splits`: force the decode launch's split count, 1..64 (ValueError otherwise);
        None: the heuristic (`choose_num_splits`)."""
        if num_splits is not None:
            _check_num_splits(num_splits)
        self.num_splits = num_splits  # None: heuristic; tests force the split-KV path
        self._planned_md: AttentionMetadata | None = None  # the plans' step
        self._plans: dict[tuple[object, ...], AttentionPlan] = {}

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
        v_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        store_kv(key, value, kv_cache, attn_metadata.slot_mapping, k_scale, v_scale)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        plan = self._plan(query, key, attn_metadata, sliding_window)
        paged_attention(
            out, query, kv_cache, attn_metadata, scale, plan, k_scale, v_scale,
            sliding_window, logits_soft_cap,
        )  # fmt: skip
        return out

    def _plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        attn_metadata: AttentionMetadata,
        sliding_window: int | None,
    ) -> AttentionPlan:
        """The step's plan for this layer's shapes and window, made once per metadata object
        and kept per (shapes, window): local and global layers alternate in Gemma."""
        shape_key = (query.shape[1], key.shape[1], query.shape[2], query.dtype, sliding_window)
        if self._planned_md is not attn_metadata:
            self._planned_md, self._plans = attn_metadata, {}
        plan = self._plans.get(shape_key)
        if plan is None:
            plan = plan_attention(
                attn_metadata, query.shape[1], key.shape[1], query.shape[2], query.dtype,
                query.device, self.num_splits, sliding_window,
            )  # fmt: skip
            self._plans[shape_key] = plan
        return plan
