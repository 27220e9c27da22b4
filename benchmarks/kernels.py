"""Times the Triton attention kernels on a GPU: decode (achieved HBM bandwidth) and prefill.

    PYTHONPATH=. python3 benchmarks/kernels.py [--sweep] [--quick]

Each kernel is captured in a CUDA graph and replayed (triton.testing.do_bench_cudagraph,
median), so the numbers are GPU time without Python launch overhead. Decode bandwidth counts
the K and V bytes read (sum of seq_lens x num_kv_heads x head_dim x 2 x dtype size) over the
time, against a device-to-device copy measured in the same run. Prints a table and one JSON
line per row; `--sweep` also times alternative tile configurations.
"""

import argparse
import json
import math
import subprocess
import time
from typing import Any

import torch
import torch.nn.functional as F
import triton

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.triton_backend import (
    AttentionPlan,
    TileConfig,
    paged_attention,
    plan_attention,
    store_kv,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.empty(2**31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


class Cache:
    """One big random KV cache; each row draws random block tables from it (no L2 reuse)."""

    def __init__(self, num_tokens: int) -> None:
        num_blocks = num_tokens // BLOCK_SIZE + 64
        shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.kv_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        self.num_blocks = num_blocks

    def metadata(self, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
        width = max(blocks_per_req)
        perm = torch.randperm(self.num_blocks, device="cuda")[: sum(blocks_per_req)]
        tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device="cuda")
        start = 0
        for i, n in enumerate(blocks_per_req):
            tables[i, :n] = perm[start : start + n].int()
            start += n
        qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        slots = []
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            pos = torch.arange(s - q, s, device="cuda")
            slots.append(tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
        return AttentionMetadata(
            qsl.cuda(), seq.cuda(), tables, torch.cat(slots), max(query_lens), max(seq_lens),
            qsl, seq,
        )  # fmt: skip


def time_attention(cache: Cache, md: AttentionMetadata, plan: AttentionPlan) -> float:
    """Median ms of one paged_attention call (graph replay)."""
    num_tokens = md.num_tokens
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    out = torch.empty_like(query)
    scale = 1 / math.sqrt(HEAD_DIM)

    def run() -> None:
        paged_attention(out, query, cache.kv_cache, md, scale, plan)

    run()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median"))


def default_plan(md: AttentionMetadata, num_splits: int | None = None) -> AttentionPlan:
    return plan_attention(
        md, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE, torch.device("cuda"), num_splits
    )


def kv_bytes(seq_lens: list[int]) -> int:
    return sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize


def causal_flops(query_lens: list[int], seq_lens: list[int]) -> float:
    """2 matmuls x 2 flops per multiply-add over the visible (query, key) pairs."""
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(query_lens, seq_lens, strict=True))
    return 4 * NUM_HEADS * HEAD_DIM * pairs


def bench_decode(cache: Cache, copy_bw: float, rows: list[dict[str, Any]], quick: bool) -> None:
    batches = [1, 4, 16, 64, 256] if not quick else [1, 64]
    contexts = [1024, 2048, 4096, 8192] if not quick else [4096]
    for batch, context in ((b, c) for b in batches for c in contexts):
        md = cache.metadata([1] * batch, [context] * batch)
        plan = default_plan(md)
        ms = time_attention(cache, md, plan)
        ms_no_split = ms if plan.num_splits == 1 else time_attention(cache, md, default_plan(md, 1))
        bw = kv_bytes([context] * batch) / (ms * 1e-3)
        rows.append(dict(
            kind="decode", batch=batch, context=context, num_splits=plan.num_splits,
            ms=round(ms, 4), ms_no_split=round(ms_no_split, 4), tb_per_s=round(bw / 1e12, 3),
            frac_copy_bw=round(bw / copy_bw, 3),
        ))  # fmt: skip


def bench_prefill(cache: Cache, rows: list[dict[str, Any]], quick: bool) -> None:
    for length in [512, 1024, 2048, 4096, 8192] if not quick else [4096]:
        md = cache.metadata([length], [length])
        ms = time_attention(cache, md, default_plan(md))
        q = torch.randn(1, NUM_HEADS, length, HEAD_DIM, dtype=DTYPE, device="cuda")
        kv = torch.randn(2, 1, NUM_KV_HEADS, length, HEAD_DIM, dtype=DTYPE, device="cuda")
        sdpa_ms = triton.testing.do_bench_cudagraph(
            lambda q=q, kv=kv: F.scaled_dot_product_attention(
                q, kv[0], kv[1], is_causal=True, enable_gqa=True
            ),
            rep=50,
            return_mode="median",
        )
        flops = causal_flops([length], [length])
        rows.append(dict(
            kind="prefill", batch=1, context=length, ms=round(ms, 4),
            tflops=round(flops / (ms * 1e-3) / 1e12, 1),
            sdpa_contiguous_ms=round(sdpa_ms, 4),
        ))  # fmt: skip
    # Mixed step: one 512-token chunk after 1024 cached tokens plus 63 decodes at 2k.
    query_lens, seq_lens = [512] + [1] * 63, [1536] + [2048] * 63
    md = cache.metadata(query_lens, seq_lens)
    ms = time_attention(cache, md, default_plan(md))
    rows.append(dict(kind="mixed", batch=64, context=2048, ms=round(ms, 4)))
    # store_kv for a 4096-token prefill.
    md = cache.metadata([4096], [4096])
    key = torch.randn(4096, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    ms = triton.testing.do_bench_cudagraph(
        lambda: store_kv(key, key, cache.kv_cache, md.slot_mapping), rep=50, return_mode="median"
    )
    rows.append(dict(kind="store_kv", batch=1, context=4096, ms=round(ms, 4)))


def sweep(cache: Cache, rows: list[dict[str, Any]], deadline: float) -> None:
    """Alternative tile configs (and split counts) on a few shapes, to tune the defaults."""
    decode_tiles = [
        (16, 2, 4), (16, 4, 4), (32, 2, 4), (32, 4, 3), (32, 4, 4), (32, 4, 5), (64, 4, 2),
        (64, 4, 3), (64, 4, 4), (64, 8, 3), (64, 8, 4), (128, 4, 2), (128, 4, 3), (128, 8, 3),
    ]  # fmt: skip
    for batch, context in [(64, 4096), (256, 2048)]:
        md = cache.metadata([1] * batch, [context] * batch)
        base = default_plan(md, 1)
        for tile_n, warps, stages in decode_tiles:
            if time.time() > deadline:
                return
            plan = AttentionPlan(TileConfig(16, tile_n, warps, stages), None, 4, 1)
            ms = time_attention(cache, md, plan)
            bw = kv_bytes([context] * batch) / (ms * 1e-3)
            rows.append(dict(kind="sweep_decode", batch=batch, context=context, tile_n=tile_n,
                             num_warps=warps, num_stages=stages, ms=round(ms, 4),
                             tb_per_s=round(bw / 1e12, 3), default=plan == base))  # fmt: skip
    for batch, context in [(1, 8192), (4, 8192), (16, 2048)]:
        md = cache.metadata([1] * batch, [context] * batch)
        for num_splits in [1, 2, 4, 8, 16, 32, 64]:
            if time.time() > deadline:
                return
            ms = time_attention(cache, md, default_plan(md, num_splits))
            rows.append(dict(kind="sweep_splits", batch=batch, context=context,
                             num_splits=num_splits, ms=round(ms, 4),
                             heuristic=default_plan(md).num_splits))  # fmt: skip
    prefill_tiles = [
        (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (128, 64, 4, 3),
        (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (64, 32, 4, 3), (128, 128, 8, 3),
    ]  # fmt: skip
    md = cache.metadata([4096], [4096])
    for block_m, tile_n, warps, stages in prefill_tiles:
        if time.time() > deadline:
            return
        plan = AttentionPlan(None, TileConfig(block_m, tile_n, warps, stages), 0, 1)
        ms = time_attention(cache, md, plan)
        tflops = causal_flops([4096], [4096]) / (ms * 1e-3) / 1e12
        rows.append(dict(kind="sweep_prefill", batch=1, context=4096, block_m=block_m,
                         tile_n=tile_n, num_warps=warps, num_stages=stages, ms=round(ms, 4),
                         tflops=round(tflops, 1)))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time alternative tiles")
    parser.add_argument("--quick", action="store_true", help="a few rows only")
    parser.add_argument("--sweep-seconds", type=float, default=90.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    header = dict(
        gpu=torch.cuda.get_device_name(), commit=_commit(), torch=torch.__version__,
        triton=triton.__version__, dtype=str(DTYPE), num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
    )  # fmt: skip
    copy_bw = copy_bandwidth()
    print(json.dumps(dict(kind="copy", tb_per_s=round(copy_bw / 1e12, 3), **header)), flush=True)
    cache = Cache(num_tokens=256 * 8192)
    rows: list[dict[str, Any]] = []
    bench_decode(cache, copy_bw, rows, args.quick)
    bench_prefill(cache, rows, args.quick)
    if args.sweep:
        sweep(cache, rows, time.time() + args.sweep_seconds)
    for row in rows:
        print(json.dumps({**row, **header}))
    print(f"\n{'kind':<14}{'batch':>6}{'context':>8}  result")
    for row in rows:
        rest = {k: v for k, v in row.items() if k not in ("kind", "batch", "context")}
        print(f"{row['kind']:<14}{row['batch']:>6}{row['context']:>8}  {rest}")


if __name__ == "__main__":
    main()
