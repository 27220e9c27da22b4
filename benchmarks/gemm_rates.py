"""Matmul rates of one model's linear layers on the GPU: the ceiling of compute-bound steps.

    PYTHONPATH=. python3 benchmarks/gemm_rates.py [--preset llama-3.1-8b] [--tokens 256 8192]
        [--tunableop]

For each linear layer of a decoder block (merged QKV, output projection, merged gate/up, down
projection, and the LM head) and each token count M, times `F.linear(x [M, K], W [N, K])` the
way the model runs it (CUDA events, median of `triton.testing.do_bench`, bf16, random
inputs), and the same product with the weight stored transposed (`x @ W_t`, W_t [K, N]
contiguous), which makes cuBLAS pick from another set of kernels. Prints TFLOP/s (2 M N K
flops per product) next to an 8192^3 product in the same run, and one JSON line per row.
`--tunableop` also times each shape after PyTorch's TunableOp has benchmarked cuBLAS(Lt)'s
candidate algorithms for it (torch.cuda.tunable).
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from benchmarks.presets import PRESETS  # noqa: E402


def layer_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer, unsharded."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {
        "qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
        "lm_head": (config["vocab_size"], hidden),
    }


def time_ms(fn: Any) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 8192, 16384])
    parser.add_argument("--tunableop", action="store_true")
    args = parser.parse_args()
    dtype, device = torch.bfloat16, "cuda"
    torch.manual_seed(0)
    header = dict(gpu=torch.cuda.get_device_name(), commit=git_commit(), torch=torch.__version__,
                  preset=args.preset, dtype=str(dtype))  # fmt: skip

    a = torch.randn(8192, 8192, dtype=dtype, device=device)
    b = torch.randn(8192, 8192, dtype=dtype, device=device)
    square = 2 * 8192**3 / (time_ms(lambda a=a, b=b: a @ b) * 1e-3) / 1e12
    print(json.dumps(dict(kind="square_8192", tflops=round(square, 1), **header)), flush=True)

    rows: list[dict[str, Any]] = []
    for name, (n, k) in layer_shapes(PRESETS[args.preset]).items():
        weight = torch.randn(n, k, dtype=dtype, device=device) * 0.02
        weight_t = weight.t().contiguous()
        for m in args.tokens:
            x = torch.randn(m, k, dtype=dtype, device=device)
            flops = 2 * m * n * k
            row: dict[str, Any] = dict(layer=name, m=m, n=n, k=k)
            row["linear_ms"] = time_ms(lambda x=x, w=weight: F.linear(x, w))
            row["transposed_ms"] = time_ms(lambda x=x, w=weight_t: x @ w)
            for key in ("linear", "transposed"):
                row[f"{key}_tflops"] = round(flops / (row[f"{key}_ms"] * 1e-3) / 1e12, 1)
                row[f"{key}_ms"] = round(row[f"{key}_ms"], 4)
            rows.append(row)
            print(json.dumps({**row, **header}), flush=True)
        del weight, weight_t

    if args.tunableop:
        torch.cuda.tunable.enable(True)
        torch.cuda.tunable.tuning_enable(True)
        torch.cuda.tunable.set_max_tuning_duration(20)
        torch.cuda.tunable.set_max_tuning_iterations(20)
        for row in rows:
            weight = torch.randn(row["n"], row["k"], dtype=dtype, device=device) * 0.02
            x = torch.randn(row["m"], row["k"], dtype=dtype, device=device)
            F.linear(x, weight)  # tunes this shape once
            ms = time_ms(lambda x=x, w=weight: F.linear(x, w))
            flops = 2 * row["m"] * row["n"] * row["k"]
            row["tunableop_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
            print(json.dumps({"kind": "tunableop", **row, **header}), flush=True)
        torch.cuda.tunable.enable(False)

    print(f"\n8192^3 bf16 product: {square:.0f} TFLOP/s")
    cols = ["linear_tflops", "transposed_tflops"] + (["tunableop_tflops"] if args.tunableop else [])
    print(f"{'layer':<14}{'M':>7}{'N':>8}{'K':>7}" + "".join(f"{c:>20}" for c in cols))
    for row in rows:
        print(f"{row['layer']:<14}{row['m']:>7}{row['n']:>8}{row['k']:>7}"
              + "".join(f"{row.get(c, '-'):>20}" for c in cols))  # fmt: skip


if __name__ == "__main__":
    main()
