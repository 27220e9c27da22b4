"""The CUDA W4A16 GEMV (pagedserve/layers/kernels/w4_gemv_cuda.py) against the bf16 / fp16
F.linear and the Triton `quant_gemm`, on Llama-3.1-8B's decode shapes, with a correctness check.

For qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096, M in 1 2 4 8 and x in
bf16 and fp16 (4-bit, group 128, fp16 scales, zero 8 as GPTQ symmetric; --asym: int16 zeros):
- checks the CUDA kernel against `x.float() @ dequantize(w, float32)`, with the tolerance of
  tests/quantization/test_quant_kernels.py: |y - ref| <= rtol |ref| + atol (|x| @ |W^T|), rtol =
  one unit in the last place of x's dtype (bf16 2^-7, fp16 2^-10), atol = 2^-16 (fp32 sums);
  prints max abs / rel error and the worst ratio to that bound, and exits 1 if any ratio > 1;
- times, as CUDA-graph replays over enough weight copies that nothing stays in L2 (each copy
  called once per replay, as a forward streams every weight from HBM once), the dense F.linear
  (16-bit weight), `quant_gemm` and `w4_gemv`; prints ms and TB/s of packed weight (qweight
  bytes: K N / 2) per shape and the per-layer sum, and one JSON line.
For M > 8 it times the tensor-core GEMM (`w4_gemm`) and dequantize + cuBLAS
(`dequantize_repacked`), checked against the reference with each weight rounded to x's dtype
as they round it, and reports the one `w4_linear` takes for that M.
--sweep also times every (num_warps, unroll, nt) of the GEMV and (num_warps, split, mt, nt, kw)
of the GEMM, prints the best per shape and keeps every time in the JSON line's rows ("sweep").

  python3 benchmarks/w4_gemv_cuda.py [--sweep [--gemm-config 8,1,4,2,1 ...]] [--asym] [--m 1 --m 8]
      [--dtype bfloat16] [--shape o]
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import quant_gemm as quant_gemm_bench  # noqa: E402
from benchmarks.quant_gemm import SHAPES  # noqa: E402

GROUP = 128
L2_BYTES = 256 << 20  # weight bytes rotated per replay: several times the H200's 60 MB L2
ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}
ATOL = 2.0**-16


def timed(fn: Any, copies: int) -> float:
    """ms per call: fn(i) for each of `copies` weight sets in one CUDA-graph replay."""
    import triton

    def run() -> None:
        for i in range(copies):
            fn(i)

    run()  # build / compile outside the capture
    return float(triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")) / copies


def check(y: Any, x: Any, w: Any, dtype_name: str, rounded: bool = False) -> dict[str, float]:
    """Errors of y against the fp32 reference (rounded: with each weight rounded to x's dtype,
    as the GEMM rounds it); 'ratio' <= 1 is within the stated tolerance."""
    import torch

    from pagedserve.layers.kernels.quant_gemm import dequantize

    weight = dequantize(w, x.dtype if rounded else torch.float32).float()  # W^T [K, N]
    ref = x.float() @ weight
    bound = ULP[dtype_name] * ref.abs() + ATOL * (x.float().abs() @ weight.abs())
    diff = (y.float() - ref).abs()
    return {
        "max_abs": float(diff.max()),
        "max_rel": float(diff.max() / ref.abs().max()),
        "ratio": float((diff / bound).max()),
    }


def make_weights(k: int, n: int, copies: int, asym: bool) -> list[Any]:
    """`copies` random 4-bit group-128 weights with fp16 scales (quant_gemm.py's maker)."""
    import torch

    layout = argparse.Namespace(bits=4, group_size=GROUP, asym=asym, act_order=False)
    return [
        quant_gemm_bench.make_weights(k, n, layout, torch.float16, "cuda") for _ in range(copies)
    ]


def bench_case(
    x: Any,
    packs: list[Any],
    repacked: list[Any],
    dense: list[Any],
    sweep: bool,
    only: list[tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """Errors and timings of one (shape, dtype, M)."""
    import torch.nn.functional as F

    from pagedserve.layers.kernels import w4_gemv_cuda as cu
    from pagedserve.layers.kernels.quant_gemm import quant_gemm

    dtype_name = str(x.dtype).removeprefix("torch.")
    n, k = packs[0].out_features, packs[0].in_features
    m = x.size(0)
    if m > cu.MAX_M:
        return bench_gemm(x, packs, repacked, dense, sweep, only)
    row: dict[str, Any] = {
        "err": check(cu.w4_gemv(x, packs[0], repacked[0]), x, packs[0], dtype_name),
        "err_triton": check(quant_gemm(x, packs[0]), x, packs[0], dtype_name),
        "dense_ms": timed(lambda i: F.linear(x, dense[i % len(dense)]), len(dense)),
        "triton_ms": timed(lambda i: quant_gemm(x, packs[i]), len(packs)),
        "cuda_ms": timed(lambda i: cu.w4_gemv(x, packs[i], repacked[i]), len(packs)),
        "cuda_cfg": cu.pick_gemv_config(n, k),
    }
    row["default_ms"] = row["cuda_ms"]
    for warps, (unroll, nt) in itertools.product((4, 8, 16), cu.GEMV_CONFIGS) if sweep else []:
        config = (warps, unroll, nt)
        t = timed(lambda i, c=config: cu.w4_gemv(x, packs[i], repacked[i], config=c), len(packs))
        row.setdefault("sweep", {})[str(config)] = round(t, 5)
        if t < row["cuda_ms"]:
            row["cuda_ms"], row["cuda_cfg"] = t, config
    return row


def bench_gemm(
    x: Any,
    packs: list[Any],
    repacked: list[Any],
    dense: list[Any],
    sweep: bool,
    only: list[tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """Errors and timings of one (shape, dtype, M > MAX_M): `w4_linear`'s path for M (the
    GEMM, or dequantize + cuBLAS from GEMM_MAX_M), the Triton `quant_linear` and F.linear;
    --sweep times every GEMM (num_warps, split, mt, nt), or those in `only`."""
    import torch.nn.functional as F

    from pagedserve.layers.kernels import w4_gemv_cuda as cu
    from pagedserve.layers.kernels.quant_gemm import quant_linear
    from pagedserve.layers.quantization.packed import PackedWeights

    dtype_name = str(x.dtype).removeprefix("torch.")
    m, k = x.shape
    n = packs[0].out_features
    # the GEMM takes scales in x's dtype (as a model's layers hold them)
    typed = [
        PackedWeights(w.qweight, w.zeros, w.zero_value, w.scales.to(x.dtype), None, None, 4,
                      w.group_size)
        for w in packs
    ]  # fmt: skip

    def gemm(i: int, config: Any = None) -> Any:
        return cu.w4_gemm(x, typed[i], repacked[i], typed[i].scales, config=config)

    def dequant(i: int) -> Any:
        return F.linear(x, cu.dequantize_repacked(typed[i], repacked[i], typed[i].scales))

    row: dict[str, Any] = {
        "err": check(gemm(0), x, typed[0], dtype_name, rounded=True),
        "err_dequant": check(dequant(0), x, typed[0], dtype_name, rounded=True),
        "err_triton": check(quant_linear(x, typed[0]), x, typed[0], dtype_name, rounded=True),
        "dense_ms": timed(lambda i: F.linear(x, dense[i % len(dense)]), len(dense)),
        "triton_ms": timed(lambda i: quant_linear(x, typed[i]), len(packs)),
        "gemm_ms": timed(gemm, len(packs)),
        "dequant_ms": timed(dequant, len(packs)),
        "cuda_cfg": cu.pick_gemm_config(m, n, k),
    }
    row["default_ms"] = row["gemm_ms"]
    configs = [
        (warps, split, mt, nt, kw)
        for (warps, mt, nt, kw), split in itertools.product(cu.GEMM_CONFIGS, (1, 2, 4, 8))
        if mt == 1 or 16 * mt // 2 < m  # m16 tiles a block may use
    ]
    if only:
        configs = [c for c in only if c[:1] + c[2:] in cu.GEMM_CONFIGS]
    for config in configs if sweep else []:
        t = timed(lambda i, c=config: gemm(i, c), len(packs))
        row.setdefault("sweep", {})[str(config)] = round(t, 5)
        if t < row["gemm_ms"]:
            row["gemm_ms"], row["cuda_cfg"] = t, config
    row["cuda_ms"] = row["gemm_ms"] if m < cu.GEMM_MAX_M else row["dequant_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, action="append", help="rows of x (default 1 2 4 8)")
    parser.add_argument("--dtype", action="append", choices=sorted(ULP))
    parser.add_argument("--sweep", action="store_true", help="time every launch config")
    parser.add_argument("--asym", action="store_true", help="int16 zero points")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: all")
    parser.add_argument(
        "--gemm-config",
        action="append",
        type=lambda v: tuple(int(p) for p in v.split(",")),
        help="with --sweep: time only these GEMM configs, num_warps,split,mt,nt,kw",
    )
    args = parser.parse_args()
    import torch

    from benchmarks.common import git_commit
    from pagedserve.layers.kernels import w4_gemv_cuda as cu

    if not cu.available():
        print("w4_gemv_cuda: not available (needs a CUDA GPU of sm_80+ and nvcc)")
        return 2
    start = time.perf_counter()
    cu.load(verbose=True)
    compile_s = time.perf_counter() - start
    torch.manual_seed(0)
    ms, dtypes = args.m or [1, 2, 4, 8], args.dtype or ["bfloat16", "float16"]
    results: list[dict[str, Any]] = []
    worst = 0.0
    for name, (k, n) in SHAPES.items():
        if args.shape and name not in args.shape:
            continue
        copies = max(2, L2_BYTES // (k * n // 2))
        packs = make_weights(k, n, copies, args.asym)
        repacked = [cu.repack(w) for w in packs]
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            dense = [
                torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(max(2, copies // 4))
            ]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                row = bench_case(x, packs, repacked, dense, args.sweep, args.gemm_config)
                row.update(shape=name, k=k, n=n, m=m, dtype=dtype_name)
                err = row.pop("err")
                worst = max(worst, err["ratio"], row.pop("err_dequant", err)["ratio"])
                results.append(row)
                extra = ""
                if "gemm_ms" in row:
                    gemm_us, dequant_us = row["gemm_ms"] * 1e3, row["dequant_ms"] * 1e3
                    extra = f"gemm {gemm_us:6.1f} us  dequant {dequant_us:6.1f} us  "
                print(
                    f"{name:8s} {dtype_name:8s} M={m}  dense {row['dense_ms'] * 1e3:6.1f} us  "
                    f"triton {row['triton_ms'] * 1e3:6.1f} us  cuda {row['cuda_ms'] * 1e3:6.1f} us "
                    f"(default config {row['default_ms'] * 1e3:6.1f}) "
                    f"{k * n / 2 / row['cuda_ms'] / 1e9:5.2f} TB/s {row['cuda_cfg']}  {extra}"
                    f"err abs "
                    f"{err['max_abs']:.2e} rel {err['max_rel']:.2e} ratio {err['ratio']:.2f} "
                    f"(triton ratio {row.pop('err_triton')['ratio']:.2f})",
                    flush=True,
                )
        torch.cuda.empty_cache()
    print_summary(results, ms, dtypes)
    summary = {
        "benchmark": "w4_gemv_cuda",
        "gpu": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "compile_s": round(compile_s, 1),
        "asym": args.asym,
        "worst_error_ratio": worst,
        "rows": [
            {key: v for key, v in r.items() if key not in ("err", "err_triton")} for r in results
        ],
    }
    print(json.dumps(summary))
    if worst > 1.0:
        print(f"FAIL: error {worst:.2f} x the tolerance")
        return 1
    return 0


def print_summary(results: list[dict[str, Any]], ms: list[int], dtypes: list[str]) -> None:
    """One layer's four linears (ms, and TB/s of packed weight) per dtype and M."""
    layer_bytes = sum(k * n / 2 for k, n in SHAPES.values())
    print(f"\n{'dtype':8s} {'M':>2s} {'dense ms':>9s} {'triton ms':>10s} {'cuda ms':>8s} "
          f"{'cuda TB/s':>9s} {'cuda/dense':>10s} {'cuda/triton':>11s}")  # fmt: skip
    for dtype_name in dtypes:
        for m in ms:
            rows = [r for r in results if r["dtype"] == dtype_name and r["m"] == m]
            dense, triton_ms, cuda = (sum(r[key] for r in rows) for key in
                                      ("dense_ms", "triton_ms", "cuda_ms"))  # fmt: skip
            print(
                f"{dtype_name:8s} {m:2d} {dense:9.4f} {triton_ms:10.4f} {cuda:8.4f} "
                f"{layer_bytes / cuda / 1e9:9.2f} {cuda / dense:10.2f} {cuda / triton_ms:11.2f}"
            )


if __name__ == "__main__":
    sys.exit(main())
