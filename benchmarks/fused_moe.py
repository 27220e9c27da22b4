"""The fused MoE (Triton) against its roofline and against the torch reference, on the GPU.

    PYTHONPATH=. python3 benchmarks/fused_moe.py [--shapes qwen3-30b-a3b mixtral-8x7b]
        [--tokens 1 16 64 256 1024 4096] [--sweep] [--no-reference] [--fp8]

For each expert shape (one MoE layer of the model, bf16, random weights and uniform random
top-k routing, as a router picks: K distinct experts per token) and each token count T, times
`fused_moe` (`triton.testing.do_bench_cudagraph`: a CUDA graph of ROUTINGS calls, each with
its own routing and input so that the experts one call reads are not all in L2 from the last;
median per call) and `moe_reference` (CUDA events; it syncs with the host, so no graph).

The floor of one call is max(memory, compute):
  memory  = (experts touched x 3 H I + 2 T H) x 2 bytes / 4.8 TB/s (H200 HBM3e peak)
  compute = 2 x T K x 3 H I flops / 989 TFLOP/s (H200 dense bf16 peak)
"touched" is the number of distinct experts the call's routing uses (averaged over the
routings). `of floor` = floor / measured time. The `config` column is `moe_config`'s choice
(block_m / gate-up BLOCK_N x BLOCK_K / down BLOCK_N x BLOCK_K).

--fp8 stores the experts as float8_e4m3fn with per-row scales (weight-only FP8: 1 byte per
weight in the floor; the reference runs on the bf16 weights).

--sweep also times alternative tile configs at each T and prints the fastest beside the
default (configs that do not fit the GPU's shared memory are skipped).
"""

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from pagedserve.layers.moe.reference import moe_reference  # noqa: E402
from pagedserve.layers.moe.triton_moe import (  # noqa: E402
    GemmTile,
    MoeConfig,
    fused_moe_triton,
    moe_config,
)

HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS = 989e12
ROUTINGS = 4
# (experts E, top-k K, hidden H, expert intermediate I) of one MoE layer
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),  # Qwen/Qwen3-30B-A3B config.json
    "mixtral-8x7b": (8, 2, 4096, 14336),  # mistralai/Mixtral-8x7B-v0.1 config.json
}


@dataclasses.dataclass
class Case:
    """ROUTINGS sets of (hidden_states, topk_weights, topk_ids) for one T."""

    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    touched: float  # distinct experts per call, averaged


def make_case(num_experts: int, top_k: int, hidden: int, num_tokens: int) -> Case:
    inputs, touched = [], 0
    for _ in range(ROUTINGS):
        logits = torch.randn(num_tokens, num_experts, device="cuda")
        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
        inputs.append((x, weights, ids))
        touched += int((torch.bincount(ids.flatten(), minlength=num_experts) > 0).sum())
    return Case(inputs, touched / ROUTINGS)


Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor) -> Experts:
    """(w13, w2, w13_scale, w2_scale) as float8_e4m3fn with per-row float32 scales."""
    out: list[torch.Tensor] = []
    for w in (w13, w2):
        scale = w.float().abs().amax(dim=2) / 448.0
        out.append((w.float() / scale[:, :, None]).to(torch.float8_e4m3fn))
        out.append(scale)
    return out[0], out[2], out[1], out[3]


def time_fused_us(
    experts: Experts, case: Case, config: MoeConfig | None = None, rep_ms: int = 200
) -> float:
    w13, w2, s13, s2 = experts

    def run() -> None:
        for x, weights, ids in case.inputs:
            fused_moe_triton(x, w13, w2, weights, ids, 0, s13, s2, config=config)

    run()  # compile outside the graph
    ms = triton.testing.do_bench_cudagraph(run, rep=rep_ms, return_mode="median")
    return float(ms) * 1e3 / ROUTINGS


def time_reference_us(w13: torch.Tensor, w2: torch.Tensor, case: Case) -> float:
    x, weights, ids = case.inputs[0]

    def fn() -> torch.Tensor:
        return moe_reference(x, w13, w2, weights, ids)

    return float(triton.testing.do_bench(fn, warmup=5, rep=100, return_mode="median")) * 1e3


def sweep_configs(default: MoeConfig) -> list[MoeConfig]:
    """Alternatives around the default: every block_m with a few tile pairs."""
    tiles = [
        (GemmTile(32, 128), GemmTile(64, 128)),
        (GemmTile(64, 128), GemmTile(128, 128)),
        (GemmTile(64, 64, 4), GemmTile(64, 64, 4)),
        (GemmTile(64, 64, 8), GemmTile(128, 64, 8)),
        (GemmTile(64, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3)),
        (GemmTile(128, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3)),
        (GemmTile(64, 32, 8, 4, 5), GemmTile(128, 32, 8, 4, 5)),
    ]
    configs = [MoeConfig(m, g, d) for m, (g, d) in itertools.product((16, 32, 64, 128), tiles)]
    return [c for c in configs if c != default]


def describe(config: MoeConfig, launch: bool = False) -> str:
    """block_m/gate-up NxK/down NxK, with (group_m, warps, stages) of each when `launch`."""
    g, d = config.gate_up, config.down
    if launch:
        return (
            f"{config.block_m}/{g.block_n}x{g.block_k} g{g.group_m} w{g.num_warps} "
            f"s{g.num_stages}/{d.block_n}x{d.block_k} g{d.group_m} w{d.num_warps} s{d.num_stages}"
        )
    return f"{config.block_m}/{g.block_n}x{g.block_k}/{d.block_n}x{d.block_k}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--sweep", action="store_true", help="also time alternative tiles")
    parser.add_argument("--no-reference", action="store_true", help="skip moe_reference")
    parser.add_argument("--fp8", action="store_true", help="float8_e4m3fn expert weights")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, commit {git_commit()}")  # fmt: skip
    header = (
        f"{'shape':<14} {'T':>5} {'touched':>7} {'MB':>7} {'floor us':>9} {'fused us':>9} "
        f"{'of floor':>8} {'TB/s':>5} {'TFLOP/s':>7} {'ref us':>9} {'speedup':>7}  config"
    )
    print(header)
    rows = []
    for name in args.shapes:
        e, k, h, i = SHAPES[name]
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
        experts: Experts = fp8_experts(w13, w2) if args.fp8 else (w13, w2, None, None)
        weight_bytes = 1 if args.fp8 else 2
        for t in args.tokens:
            case = make_case(e, k, h, t)
            config = moe_config(t, k, e, i, h, torch.bfloat16)
            fused = time_fused_us(experts, case)
            num_bytes = case.touched * 3 * h * i * weight_bytes + 2 * t * h * 2
            flops = 2 * t * k * 3 * h * i
            floor = max(num_bytes / HBM_BYTES_PER_S, flops / BF16_FLOPS) * 1e6
            ref = float("nan") if args.no_reference else time_reference_us(w13, w2, case)
            row: dict[str, Any] = {
                "shape": name, "tokens": t, "touched": case.touched, "bytes": num_bytes,
                "flops": flops, "floor_us": floor, "fused_us": fused, "reference_us": ref,
                "config": describe(config), "fp8": args.fp8,
            }  # fmt: skip
            print(
                f"{name:<14} {t:>5} {case.touched:>7.1f} {num_bytes / 1e6:>7.1f} {floor:>9.1f} "
                f"{fused:>9.1f} {floor / fused:>8.0%} {num_bytes / fused / 1e6:>5.2f} "
                f"{flops / fused / 1e6:>7.1f} {ref:>9.1f} {ref / fused:>6.1f}x  {describe(config)}",
                flush=True,
            )
            if args.sweep:
                best, best_us = config, fused
                for candidate in sweep_configs(config):
                    try:
                        us = time_fused_us(experts, case, candidate, rep_ms=50)
                    except Exception as error:  # a tile that does not fit: skip it, say so
                        print(f"{'':<21} skipped {describe(candidate)}: {type(error).__name__}")
                        continue
                    if us < best_us:
                        best, best_us = candidate, us
                row["sweep_best"], row["sweep_best_us"] = dataclasses.asdict(best), best_us
                print(f"{'':<21} sweep best {best_us:.1f} us: {describe(best, True)}", flush=True)
            rows.append(row)
        del w13, w2, experts
        torch.cuda.empty_cache()
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
