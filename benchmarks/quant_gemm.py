"""W4A16 / W8A16 GEMM (GPTQ / AWQ kernels) against a bf16 matmul, on Llama-3.1-8B's layer shapes.

For each shape (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and M
(rows of x: 1, 16, 64 decode; 256 large decode batch; 1024, 4096 prefill) it times, with
triton.testing.do_bench (median of CUDA-event timings, L2 flushed between runs):
  bf16       F.linear on an unquantized bf16 weight (cuBLAS)
  in-loop    quant_gemm: dequantize inside the K loop (split-K for small M)
  deq+mm     dequantize to a bf16 W^T, then cuBLAS (the large-M path)
and prints a table, the best quantized path per M summed over the four shapes, the crossover
M for `DEQUANT_MATMUL_MIN_M` (pagedserve/layers/kernels/quant_gemm.py), and one JSON line.
--sweep also tries other tile configs / split-K per (shape, M) and prints the best, to tune
`pick_config`. Weights are random in the kernels' layout (the layout GPTQ and AWQ checkpoints
are both repacked into at load, so the timing covers both formats).

  python benchmarks/quant_gemm.py                      # 4-bit, group 128, symmetric
  python benchmarks/quant_gemm.py --bits 8 --act-order --asym --sweep
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name: (K in, N out) of Llama-3.1-8B's linears (TP=1)
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
MS = (1, 16, 64, 256, 1024, 4096)
# (block_m, block_n, block_k, num_warps, num_stages, swap_ab) candidates for --sweep, by M.
SWEEP = {
    1: [(1, 64, 256, 4, 3, False), (1, 32, 256, 4, 3, False), (1, 128, 256, 4, 3, False),
        (1, 64, 128, 4, 3, False), (1, 64, 512, 4, 3, False), (1, 128, 128, 8, 3, False),
        (1, 128, 512, 8, 3, False), (1, 256, 256, 8, 3, False), (16, 64, 128, 4, 3, True),
        (1, 32, 1024, 4, 3, False), (1, 16, 512, 4, 3, False), (1, 64, 512, 8, 3, False)],
    16: [(16, 64, 128, 4, 3, False), (16, 64, 128, 4, 3, True), (16, 128, 128, 4, 3, True),
         (16, 32, 128, 4, 3, False), (16, 64, 256, 4, 3, True), (16, 128, 128, 4, 4, False)],
    64: [(64, 64, 128, 4, 3, False), (64, 64, 128, 4, 3, True), (32, 64, 128, 4, 3, False),
         (64, 128, 128, 4, 3, False), (64, 128, 128, 8, 3, True)],
    256: [(64, 128, 128, 4, 3, False), (128, 128, 128, 8, 3, False), (128, 64, 128, 4, 3, False),
          (64, 256, 128, 8, 3, False), (128, 256, 128, 8, 3, False)],
}  # fmt: skip
SWEEP[1024] = SWEEP[4096] = SWEEP[256]


def make_weights(k: int, n: int, args: argparse.Namespace, dtype: Any, device: str) -> Any:
    """Random W in the kernels' layout (`PackedWeights`) on `device`."""
    import torch

    from pagedserve.layers.quantization.packed import PackedWeights

    pack = 32 // args.bits
    group = args.group_size if args.group_size != -1 else k
    groups = k // group
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // pack, n), dtype=torch.int32, device=device)
    scales = (torch.rand(groups, n, device=device) * 0.01).to(dtype)
    zeros = None
    if args.asym:
        zeros = torch.randint(0, 2**args.bits, (groups, n), dtype=torch.int16, device=device)
    perm = torch.randperm(k, device=device).to(torch.int32) if args.act_order else None
    zero = 2 ** (args.bits - 1)
    return PackedWeights(qweight, zeros, zero, scales, None, perm, args.bits, group)


def bench(fn: Any) -> float:
    """Median milliseconds of fn() replayed in a CUDA graph (as a decode step runs it: no
    Python launch overhead, which dominated the small shapes with plain do_bench); on the CPU
    (--smoke) one timed call."""
    import torch
    import triton

    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    fn()  # compile outside the capture
    return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


def sweep(x: Any, w: Any, m: int) -> tuple[float, str]:
    """The best (ms, config) of the SWEEP candidates for M, each with automatic and no split-K."""
    from pagedserve.layers.kernels.quant_gemm import GemmConfig, quant_gemm

    best = (float("inf"), "")
    for candidate in SWEEP[m]:
        for split_k in (None, 1):
            config = GemmConfig(*candidate)
            if config.block_m < 16 and m > 1:
                continue
            ms = bench(lambda c=config, s=split_k: quant_gemm(x, w, config=c, split_k=s))
            best = min(best, (ms, f"{candidate} split_k={split_k or 'auto'}"))
    return best


def main() -> None:
    import torch
    import torch.nn.functional as F

    from pagedserve.layers.kernels.quant_gemm import (
        DEQUANT_MATMUL_MIN_M,
        dequant_matmul,
        pick_config,
        quant_gemm,
    )

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, choices=(-1, 32, 64, 128), default=128)
    parser.add_argument("--act-order", action="store_true", help="GPTQ desc_act (x permuted)")
    parser.add_argument("--asym", action="store_true", help="per-group zero points (AWQ-like)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--m", type=int, nargs="+", default=list(MS))
    parser.add_argument("--sweep", action="store_true", help="also try other tile configs")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="check the script on the CPU under TRITON_INTERPRET=1: shapes / 64, M 1 and 16, "
        "group 32, float16",
    )
    args = parser.parse_args()
    device, shapes = "cuda", SHAPES
    if args.smoke:
        device, args.m, args.group_size, args.dtype = "cpu", [1, 16], 32, "float16"
        shapes = {name: (k // 64, n // 64) for name, (k, n) in SHAPES.items()}
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (smoke run)"
    print(f"GPU: {gpu}  W{args.bits}A16 g{args.group_size} "
          f"act_order={args.act_order} asym={args.asym} {args.dtype}")  # fmt: skip
    header = f"{'shape':<9}{'M':>6}{'bf16 ms':>10}{'in-loop':>10}{'deq+mm':>10}{'best/bf16':>11}"
    print(header + ("  sweep best" if args.sweep else ""))
    rows = []
    totals: dict[int, dict[str, float]] = {}
    for name, (k, n) in shapes.items():
        w = make_weights(k, n, args, dtype, device)
        dense = torch.randn(n, k, dtype=dtype, device=device) * 0.01
        for m in args.m:
            x = torch.randn(m, k, dtype=dtype, device=device)
            t = {
                "bf16": bench(lambda x=x, dense=dense: F.linear(x, dense)),
                "in-loop": bench(lambda x=x, w=w: quant_gemm(x, w)),
                "deq+mm": bench(lambda x=x, w=w: dequant_matmul(x, w)),
            }
            best = min(t["in-loop"], t["deq+mm"])
            line = (
                f"{name:<9}{m:>6}{t['bf16']:>10.4f}{t['in-loop']:>10.4f}{t['deq+mm']:>10.4f}"
                f"{best / t['bf16']:>10.2f}x"
            )
            row: dict[str, Any] = {"shape": name, "k": k, "n": n, "m": m, **t}
            row["default_config"] = str(pick_config(m))
            if args.sweep and m in SWEEP:
                swept_ms, config = sweep(x, w, m)
                line += f"  {swept_ms:.4f} {config}"
                row["sweep_best_ms"], row["sweep_best_config"] = swept_ms, config
            print(line)
            rows.append(row)
            for path in t:
                totals.setdefault(m, {}).setdefault(path, 0.0)
                totals[m][path] += t[path]
    print("\nPer M, summed over the four shapes (one decoder layer's linears):")
    print(f"{'M':>6}{'bf16 ms':>10}{'in-loop':>10}{'deq+mm':>10}  best quantized path")
    crossover = None
    for m, t in totals.items():
        winner = "in-loop" if t["in-loop"] <= t["deq+mm"] else "deq+mm"
        print(f"{m:>6}{t['bf16']:>10.4f}{t['in-loop']:>10.4f}{t['deq+mm']:>10.4f}  {winner}")
    for m in sorted(totals):  # smallest M from which deq+mm wins on every shape
        wins = [r["deq+mm"] < r["in-loop"] for r in rows if r["m"] >= m]
        if wins and all(wins):
            crossover = m
            break
    print(
        f"\nDEQUANT_MATMUL_MIN_M is {DEQUANT_MATMUL_MIN_M}; measured crossover (deq+mm faster "
        f"on every shape for all M >= it, among {sorted(totals)}): {crossover}"
    )
    print(json.dumps({"benchmark": "quant_gemm", "args": vars(args), "rows": rows,
                      "crossover_m": crossover}))  # fmt: skip


if __name__ == "__main__":
    main()
