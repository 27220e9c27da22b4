"""Times the Triton attention kernels on a GPU: decode (achieved HBM bandwidth) and prefill.

    PYTHONPATH=. python3 benchmarks/attention_kernels.py [--model llama3-8b] [--sweep decode]
        [--quick] [--kv-cache-dtype fp8] [--sliding-window 4096] [--logits-soft-cap 50]

Each kernel is captured in a CUDA graph and replayed (triton.testing.do_bench_cudagraph,
median), so the numbers are GPU time without Python launch overhead. Decode bandwidth counts
the K and V bytes read (sum of seq_lens x num_kv_heads x head_dim x 2 x dtype size) over the
time, against a device-to-device copy measured in the same run. Prints a table and one JSON
line per row; `--sweep decode,splits,prefill,batched` also times alternative tile configurations and
split counts (the data behind the defaults in triton_backend.py); `small` split-KV tiles at
batches 1-16 (split_min_tiles); `batched` on the shapes of
a batched-throughput step (256 decodes at ~600 keys; 16 prompts of 512 tokens).
`--kv-cache-dtype fp8` (or fp8_e5m2) runs the same rows over an fp8 cache with per-tensor
scales (queries stay bf16; bandwidth counts the fp8 bytes), to compare with the bf16 cache.
`--sliding-window W` runs every row with a window (bandwidth and flops count the keys inside
it) and adds `decode_long` rows at 64k-token contexts, whose time should match the rows at
context W (the kernels skip keys before the window); `--logits-soft-cap C` adds the soft cap.
"""

import argparse
import itertools
import json
import math
from typing import Any

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import git_commit
from pagedserve.attention.kv_quant import FP8_KV_CACHE_DTYPES
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.triton_backend import (
    AttentionPlan,
    TileConfig,
    choose_num_splits,
    paged_attention,
    plan_attention,
    store_kv,
)

MODELS = {  # (num_heads, num_kv_heads, head_dim) of one attention layer
    "llama3-8b": (32, 8, 128),
    "qwen3-0.6b": (16, 8, 128),
    "gpt2-large": (20, 20, 64),
}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = MODELS["llama3-8b"]  # set by --model
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
KV_DTYPE = DTYPE  # the cache's: set by --kv-cache-dtype
SLIDING_WINDOW: int | None = None  # set by --sliding-window
SOFT_CAP: float | None = None  # set by --logits-soft-cap
DEVICE = "cuda"


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.empty(2**31, dtype=torch.int16, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


class Cache:
    """One big random KV cache; each row draws random block tables from it (no L2 reuse)."""

    def __init__(self, num_tokens: int) -> None:
        num_blocks = num_tokens // BLOCK_SIZE + 64
        shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.kv_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE).to(KV_DTYPE)
        self.num_blocks = num_blocks
        # An fp8 cache is read with its per-tensor scales (device tensors, as in serving).
        fp8 = KV_DTYPE != DTYPE
        self.k_scale = torch.full((1,), 0.5, device=DEVICE) if fp8 else None
        self.v_scale = torch.full((1,), 0.25, device=DEVICE) if fp8 else None

    def metadata(self, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
        width = max(blocks_per_req)
        perm = torch.randperm(self.num_blocks, device=DEVICE)[: sum(blocks_per_req)]
        tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEVICE)
        start = 0
        for i, n in enumerate(blocks_per_req):
            tables[i, :n] = perm[start : start + n].int()
            start += n
        qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        slots = []
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            pos = torch.arange(s - q, s, device=DEVICE)
            slots.append(tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
        return AttentionMetadata(
            qsl.to(DEVICE), seq.to(DEVICE), tables, torch.cat(slots),
            max(query_lens), max(seq_lens), qsl, seq,
        )  # fmt: skip


def time_attention(
    cache: Cache,
    query_lens: list[int],
    seq_lens: list[int],
    plan_for: Any,  # (AttentionMetadata) -> AttentionPlan
) -> float:
    """Median ms of one paged_attention call, replayed in a CUDA graph. Small problems rotate
    over several block tables and queries (>= 256 MiB of K/V in all) so that L2 cannot hold
    them; the time is per call."""
    num_sets = min(max(-(-(256 << 20) // kv_bytes(seq_lens)), 1), 64)
    calls = []
    for _ in range(num_sets):
        md = cache.metadata(query_lens, seq_lens)
        query = torch.randn(md.num_tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        calls.append((torch.empty_like(query), query, md, plan_for(md)))
    scale = 1 / math.sqrt(HEAD_DIM)

    def run() -> None:
        for out, query, md, plan in calls:
            paged_attention(
                out, query, cache.kv_cache, md, scale, plan, cache.k_scale, cache.v_scale,
                SLIDING_WINDOW, SOFT_CAP,
            )  # fmt: skip

    run()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")
    return float(ms) / num_sets


def default_plan(md: AttentionMetadata, num_splits: int | None = None) -> AttentionPlan:
    return plan_attention(
        md, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE, torch.device(DEVICE), num_splits,
        SLIDING_WINDOW,
    )  # fmt: skip


def _only(md: AttentionMetadata, launch: str) -> AttentionPlan:
    plan = default_plan(md)
    if launch == "decode":
        return AttentionPlan(plan.decode, None, plan.decode_max_query_len, plan.num_splits)
    return AttentionPlan(None, plan.prefill, plan.decode_max_query_len, 1)


def kv_bytes(seq_lens: list[int]) -> int:
    """K and V bytes a decode of each sequence reads (its last window's with a window)."""
    keys = sum(s if SLIDING_WINDOW is None else min(s, SLIDING_WINDOW) for s in seq_lens)
    return keys * NUM_KV_HEADS * HEAD_DIM * 2 * KV_DTYPE.itemsize


def causal_flops(query_lens: list[int], seq_lens: list[int]) -> float:
    """2 matmuls x 2 flops per multiply-add over the visible (query, key) pairs: a query at
    position p sees p + 1 keys, at most the window."""
    window = SLIDING_WINDOW or max(seq_lens)
    pairs = sum(
        min(p + 1, window)
        for q, s in zip(query_lens, seq_lens, strict=True)
        for p in range(s - q, s)
    )
    return 4 * NUM_HEADS * HEAD_DIM * pairs


def bench_decode(cache: Cache, copy_bw: float, rows: list[dict[str, Any]], quick: bool) -> None:
    batches = [1, 4, 16, 64, 256] if not quick else [1, 64]
    contexts = [1024, 2048, 4096, 8192] if not quick else [4096]
    for batch, context in ((b, c) for b in batches for c in contexts):
        query_lens, seq_lens = [1] * batch, [context] * batch
        num_splits = default_plan(cache.metadata(query_lens, seq_lens)).num_splits
        ms = time_attention(cache, query_lens, seq_lens, default_plan)
        ms_no_split = ms
        if num_splits > 1:
            no_split = lambda md: default_plan(md, 1)
            ms_no_split = time_attention(cache, query_lens, seq_lens, no_split)
        bw = kv_bytes([context] * batch) / (ms * 1e-3)
        rows.append(dict(
            kind="decode", batch=batch, context=context, num_splits=num_splits,
            ms=round(ms, 4), ms_no_split=round(ms_no_split, 4), tb_per_s=round(bw / 1e12, 3),
            frac_copy_bw=round(bw / copy_bw, 3),
        ))  # fmt: skip
    if SLIDING_WINDOW is not None:  # O(window), not O(context): compare with context W above
        for batch in [1, 16]:
            query_lens, seq_lens = [1] * batch, [65536] * batch
            ms = time_attention(cache, query_lens, seq_lens, default_plan)
            num_splits = default_plan(cache.metadata(query_lens, seq_lens)).num_splits
            rows.append(dict(
                kind="decode_long", batch=batch, context=65536, num_splits=num_splits,
                ms=round(ms, 4), tb_per_s=round(kv_bytes(seq_lens) / (ms * 1e-3) / 1e12, 3),
            ))  # fmt: skip


def bench_prefill(cache: Cache, rows: list[dict[str, Any]], quick: bool) -> None:
    for length in [512, 1024, 2048, 4096, 8192] if not quick else [4096]:
        ms = time_attention(cache, [length], [length], default_plan)
        q = torch.randn(1, NUM_HEADS, length, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        # Contiguous K/V expanded to every query head, so SDPA takes its flash kernel.
        kv = torch.randn(2, 1, NUM_HEADS, length, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        sdpa_ms = triton.testing.do_bench_cudagraph(
            lambda q=q, kv=kv: F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True),
            rep=50,
            return_mode="median",
        )
        flops = causal_flops([length], [length])
        rows.append(dict(
            kind="prefill", batch=1, context=length, ms=round(ms, 4),
            tflops=round(flops / (ms * 1e-3) / 1e12, 1),
            sdpa_contiguous_ms=round(sdpa_ms, 4),
        ))  # fmt: skip
    # Mixed step: one 512-token chunk after 1024 cached tokens plus 63 decodes at 2k; also
    # each of its two launches alone (the other's requests exit at once).
    query_lens, seq_lens = [512] + [1] * 63, [1536] + [2048] * 63
    ms = time_attention(cache, query_lens, seq_lens, default_plan)
    decode_ms = time_attention(cache, query_lens, seq_lens, lambda md: _only(md, "decode"))
    prefill_ms = time_attention(cache, query_lens, seq_lens, lambda md: _only(md, "prefill"))
    rows.append(dict(kind="mixed", batch=64, context=2048, ms=round(ms, 4),
                     decode_launch_ms=round(decode_ms, 4),
                     prefill_launch_ms=round(prefill_ms, 4)))  # fmt: skip
    # store_kv for a 4096-token prefill.
    md = cache.metadata([4096], [4096])
    key = torch.randn(4096, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    ms = triton.testing.do_bench_cudagraph(
        lambda: store_kv(key, key, cache.kv_cache, md.slot_mapping, cache.k_scale, cache.v_scale),
        rep=50,
        return_mode="median",
    )
    rows.append(dict(kind="store_kv", batch=1, context=4096, ms=round(ms, 4)))


def _rel_error_vs_default(cache: Cache, query_lens: list[int], seq_lens: list[int],
                          plan_for: Any) -> float:  # fmt: skip
    """A swept config must compute what the default computes (same inputs, both plans)."""
    md = cache.metadata(query_lens, seq_lens)
    query = torch.randn(md.num_tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    outs = [torch.full_like(query, float("nan")) for _ in range(2)]
    for out, plan in zip(outs, [default_plan(md), plan_for(md)], strict=True):
        paged_attention(
            out, query, cache.kv_cache, md, 1 / math.sqrt(HEAD_DIM), plan,
            sliding_window=SLIDING_WINDOW, logits_soft_cap=SOFT_CAP,
        )  # fmt: skip
    return float((outs[1].float() - outs[0].float()).norm() / outs[0].float().norm())


def sweep_decode(cache: Cache, rows: list[dict[str, Any]], shapes: list[tuple[int, int]]) -> None:
    """Alternative decode tiles (tile_n, num_warps, num_stages), no split."""
    for batch, context in shapes:
        query_lens, seq_lens = [1] * batch, [context] * batch
        base = default_plan(cache.metadata(query_lens, seq_lens), 1)
        assert base.decode is not None
        block_m, default_tile_n = base.decode.block_m, base.decode.tile_n
        tiles = [
            (default_tile_n, 4, 2),
            (default_tile_n, 2, 2),
            (default_tile_n // 2, 4, 2),
            (min(default_tile_n * 2, 128), 4, 2),
            (min(default_tile_n * 2, 128), 2, 2),
        ]
        for tile_n, warps, stages in dict.fromkeys(tiles):
            tile = TileConfig(block_m, tile_n, warps, stages)
            plan = AttentionPlan(tile, None, base.decode_max_query_len, 1)
            ms = time_attention(cache, query_lens, seq_lens, lambda md, plan=plan: plan)
            error = _rel_error_vs_default(cache, query_lens, seq_lens, lambda md, plan=plan: plan)
            bw = kv_bytes([context] * batch) / (ms * 1e-3)
            rows.append(dict(kind="sweep_decode", batch=batch, context=context, tile_n=tile_n,
                             num_warps=warps, num_stages=stages, ms=round(ms, 4),
                             tb_per_s=round(bw / 1e12, 3), default=plan == base,
                             rel_err_vs_default=float(f"{error:.1e}")))  # fmt: skip


def sweep_splits(cache: Cache, rows: list[dict[str, Any]]) -> None:
    """Every split count against the heuristic's choice on decode batches."""
    for batch, context in [(1, 8192), (4, 8192), (16, 2048), (64, 4096)]:
        query_lens, seq_lens = [1] * batch, [context] * batch
        heuristic = default_plan(cache.metadata(query_lens, seq_lens)).num_splits
        for num_splits in [1, 2, 4, 8, 16, 32, 64]:
            ms = time_attention(
                cache, query_lens, seq_lens, lambda md, n=num_splits: default_plan(md, n)
            )
            rows.append(dict(kind="sweep_splits", batch=batch, context=context,
                             num_splits=num_splits, ms=round(ms, 4),
                             heuristic=heuristic))  # fmt: skip


def sweep_small_batches(cache: Cache, rows: list[dict[str, Any]]) -> None:
    """Split-KV decode at batches too small to fill the GPU: tile_n x warps x the fewest tiles
    per split, each with the split count the heuristic would give it, and batch 1 also with
    64 splits launched (a CUDA graph captured at a long max_model_len plans that many)."""
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    shapes = [(1, 1024), (1, 2048), (1, 4096), (1, 8192), (4, 1024), (4, 4096), (16, 1024)]
    for batch, context in shapes:
        query_lens, seq_lens = [1] * batch, [context] * batch
        base = default_plan(cache.metadata(query_lens, seq_lens))
        assert base.decode is not None
        default_ms = time_attention(cache, query_lens, seq_lens, default_plan)
        rows.append(dict(kind="small_default", batch=batch, context=context,
                         num_splits=base.num_splits, split_min_tiles=base.split_min_tiles,
                         tile_n=base.decode.tile_n, num_warps=base.decode.num_warps,
                         ms=round(default_ms, 4)))  # fmt: skip
        for tile_n, warps, min_tiles in itertools.product([32, 64], [2, 4], [1, 2, 4]):
            tile = TileConfig(base.decode.block_m, tile_n, warps, base.decode.num_stages)
            heuristic = choose_num_splits(batch * NUM_KV_HEADS, context, num_sms,
                                          min_tiles * tile_n)  # fmt: skip
            for num_splits in dict.fromkeys([heuristic, 64 if batch == 1 else heuristic]):
                plan = AttentionPlan(tile, None, base.decode_max_query_len, num_splits, min_tiles)
                ms = time_attention(cache, query_lens, seq_lens, lambda md, plan=plan: plan)
                error = _rel_error_vs_default(
                    cache, query_lens, seq_lens, lambda md, plan=plan: plan
                )
                rows.append(dict(kind="sweep_small", batch=batch, context=context,
                                 tile_n=tile_n, num_warps=warps, split_min_tiles=min_tiles,
                                 num_splits=num_splits, ms=round(ms, 4),
                                 vs_default=round(ms / default_ms, 3),
                                 rel_err_vs_default=float(f"{error:.1e}")))  # fmt: skip


def sweep_prefill(cache: Cache, rows: list[dict[str, Any]]) -> None:
    """Alternative prefill tiles (block_m, tile_n, num_warps, num_stages)."""
    prefill_tiles = [
        (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2)
    ]  # fmt: skip
    for (block_m, tile_n, warps, stages), length in itertools.product(prefill_tiles, [1024, 4096]):
        plan = AttentionPlan(None, TileConfig(block_m, tile_n, warps, stages), 0, 1)
        ms = time_attention(cache, [length], [length], lambda md, plan=plan: plan)
        tflops = causal_flops([length], [length]) / (ms * 1e-3) / 1e12
        rows.append(dict(kind="sweep_prefill", batch=1, context=length, block_m=block_m,
                         tile_n=tile_n, num_warps=warps, num_stages=stages, ms=round(ms, 4),
                         tflops=round(tflops, 1)))  # fmt: skip


def sweep_batched(cache: Cache, rows: list[dict[str, Any]]) -> None:
    """Tiles on the shapes of a batched-throughput step (P5: Llama-3.1-8B, 256 x 512 in / 128
    out): decodes of 256 requests at 512-640 keys, and a prefill step of 16 whole 512-token
    prompts, against torch SDPA's flash kernel on the same prompts stored contiguously."""
    decode_tiles = [(64, 4, 2), (64, 2, 2), (128, 4, 2), (128, 2, 2), (64, 2, 3), (32, 2, 2),
                    (64, 1, 2), (128, 4, 3)]  # fmt: skip
    for context in (576, 640):
        query_lens, seq_lens = [1] * 256, [context] * 256
        base = default_plan(cache.metadata(query_lens, seq_lens), 1)
        assert base.decode is not None
        for tile_n, warps, stages in decode_tiles:
            tile = TileConfig(base.decode.block_m, tile_n, warps, stages)
            plan = AttentionPlan(tile, None, base.decode_max_query_len, 1)
            ms = time_attention(cache, query_lens, seq_lens, lambda md, plan=plan: plan)
            bw = kv_bytes(seq_lens) / (ms * 1e-3)
            rows.append(dict(kind="sweep_batched_decode", batch=256, context=context,
                             tile_n=tile_n, num_warps=warps, num_stages=stages, ms=round(ms, 4),
                             tb_per_s=round(bw / 1e12, 3),
                             default=tile == base.decode))  # fmt: skip
    prefill_tiles = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (128, 128, 8, 2),
                     (64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (128, 32, 4, 2),
                     (256, 64, 8, 2), (128, 128, 8, 3)]  # fmt: skip
    query_lens = seq_lens = [512] * 16
    flops = causal_flops(query_lens, seq_lens)
    base_prefill = default_plan(cache.metadata(query_lens, seq_lens)).prefill
    for block_m, tile_n, warps, stages in prefill_tiles:
        tile = TileConfig(block_m, tile_n, warps, stages)
        plan = AttentionPlan(None, tile, 0, 1)
        try:
            ms = time_attention(cache, query_lens, seq_lens, lambda md, plan=plan: plan)
        except Exception as error:  # out of shared memory / registers for this tile
            rows.append(dict(kind="sweep_batched_prefill", batch=16, context=512,
                             block_m=block_m, tile_n=tile_n, num_warps=warps,
                             num_stages=stages, error=type(error).__name__))  # fmt: skip
            continue
        rows.append(dict(kind="sweep_batched_prefill", batch=16, context=512, block_m=block_m,
                         tile_n=tile_n, num_warps=warps, num_stages=stages, ms=round(ms, 4),
                         tflops=round(flops / (ms * 1e-3) / 1e12, 1),
                         default=tile == base_prefill))  # fmt: skip
    q = torch.randn(16, NUM_HEADS, 512, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    kv = torch.randn(2, 16, NUM_HEADS, 512, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    sdpa_ms = triton.testing.do_bench_cudagraph(
        lambda: F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True),
        rep=50, return_mode="median",
    )  # fmt: skip
    rows.append(dict(kind="sdpa_flash_contiguous", batch=16, context=512, ms=round(sdpa_ms, 4),
                     tflops=round(flops / (sdpa_ms * 1e-3) / 1e12, 1)))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--sweep", default="",
        help="comma list of extra sweeps: decode, splits, small, prefill, batched",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a few rows only")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument(
        "--kv-cache-dtype", choices=["auto", *FP8_KV_CACHE_DTYPES], default="auto",
        help="auto: the cache in bf16, as the queries; fp8/fp8_e4m3/fp8_e5m2: an fp8 cache",
    )  # fmt: skip
    parser.add_argument(
        "--sliding-window", type=int, default=None, metavar="W",
        help="every row with a sliding window of W keys (Mistral 7B v0.1: 4096)",
    )  # fmt: skip
    parser.add_argument(
        "--logits-soft-cap", type=float, default=None, metavar="C",
        help="every row with scores capped to C * tanh(s / C) (Gemma 2: 50)",
    )  # fmt: skip
    args = parser.parse_args()
    global NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_DTYPE, SLIDING_WINDOW, SOFT_CAP
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = MODELS[args.model]
    KV_DTYPE = FP8_KV_CACHE_DTYPES.get(args.kv_cache_dtype, DTYPE)
    SLIDING_WINDOW, SOFT_CAP = args.sliding_window, args.logits_soft_cap

    torch.manual_seed(0)
    header = dict(
        gpu=torch.cuda.get_device_name(), commit=git_commit(), model=args.model,
        torch=torch.__version__, triton=triton.__version__, dtype=str(DTYPE),
        kv_cache_dtype=str(KV_DTYPE), num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
        sliding_window=SLIDING_WINDOW, logits_soft_cap=SOFT_CAP,
    )  # fmt: skip
    copy_bw = copy_bandwidth()
    print(json.dumps(dict(kind="copy", tb_per_s=round(copy_bw / 1e12, 3), **header)), flush=True)
    num_tokens = 256 * 8192 if not args.quick else 64 * 8192
    if SLIDING_WINDOW is not None:  # bench_decode's long-context rows: 16 x 65,536 tokens
        num_tokens = max(num_tokens, 16 * 65536)
    cache = Cache(num_tokens=num_tokens)
    rows: list[dict[str, Any]] = []
    bench_decode(cache, copy_bw, rows, args.quick)
    bench_prefill(cache, rows, args.quick)
    sweeps = set(filter(None, args.sweep.split(",")))
    if "decode" in sweeps:
        shapes = [(64, 4096)] if args.quick else [(64, 4096), (256, 2048)]
        sweep_decode(cache, rows, shapes)
    if "splits" in sweeps:
        sweep_splits(cache, rows)
    if "small" in sweeps:
        sweep_small_batches(cache, rows)
    if "prefill" in sweeps:
        sweep_prefill(cache, rows)
    if "batched" in sweeps:
        sweep_batched(cache, rows)
    for row in rows:
        print(json.dumps({**row, **header}))
    print(f"\n{'kind':<14}{'batch':>6}{'context':>8}  result")
    for row in rows:
        rest = {k: v for k, v in row.items() if k not in ("kind", "batch", "context")}
        print(f"{row['kind']:<14}{row['batch']:>6}{row['context']:>8}  {rest}")


if __name__ == "__main__":
    main()
