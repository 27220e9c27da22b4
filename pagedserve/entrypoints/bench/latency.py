"""`pagedserve bench latency`: the time to run one batch to completion (vLLM's metrics)."""

import argparse
import time
from typing import Any

import numpy as np

from pagedserve.entrypoints.bench.results import (
    add_result_args,
    model_tag,
    save_result,
    timestamp,
)
from pagedserve.entrypoints.bench.throughput import bench_params, make_llm

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench latency` flags (the engine's are added by the caller)."""
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="untimed batches first")
    parser.add_argument("--num-iters", type=int, default=30, help="timed batches")
    parser.add_argument(
        "--disable-detokenize", action="store_true", help="leave detokenizing out of the timed runs"
    )
    add_result_args(parser)


def latency_metrics(latencies: list[float]) -> dict[str, Any]:
    """vLLM's latency result: avg_latency, the latencies and their PERCENTAGES percentiles
    (numpy's linear interpolation), all in seconds."""
    values = np.percentile(latencies, PERCENTAGES)
    return {
        "avg_latency": float(np.mean(latencies)),
        "latencies": list(latencies),
        "percentiles": {str(p): float(v) for p, v in zip(PERCENTAGES, values, strict=True)},
    }


def print_latency(metrics: dict[str, Any]) -> None:
    """vLLM's lines: the average, then one line per percentile (seconds)."""
    print(f"Avg latency: {metrics['avg_latency']} seconds")
    for p, value in metrics["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")


def main(args: argparse.Namespace) -> int:
    """Run `bench latency` on parsed flags: random token prompts of --input-len, every
    request --output-len tokens (ignore_eos), --num-iters-warmup then --num-iters batches."""
    from pagedserve.errors import InvalidRequestError

    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            raise SystemExit(
                f"pagedserve bench latency: error: --{name.replace('_', '-')} must be positive"
            )
    llm = make_llm(args, "latency")
    vocab = llm.llm_engine.config.model_config.hf_text_config.vocab_size
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, min(vocab, 10000), size=(args.batch_size, args.input_len)).tolist()
    prompts = [{"prompt_token_ids": row} for row in ids]
    try:
        params = bench_params(args, args.output_len)

        def run_to_completion() -> float:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        for _ in range(args.num_iters_warmup):
            run_to_completion()
        latencies = [run_to_completion() for _ in range(args.num_iters)]
    except InvalidRequestError as e:  # a flag the engine refuses (--n 0, a too long prompt)
        raise SystemExit(f"pagedserve bench latency: error: {e}") from None
    finally:
        llm.llm_engine.shutdown()
    metrics = latency_metrics(latencies)
    print_latency(metrics)
    result = {"date": timestamp(), "model_id": args.model, **metrics}
    save_result(args, result, f"latency-{model_tag(args.model)}-{result['date']}.json")
    return 0
