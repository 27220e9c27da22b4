"""Online serving benchmark against any OpenAI-compatible server (vLLM's `bench serve` metrics).

A thin wrapper of `pagedserve bench serve` (pagedserve/entrypoints/bench/serve.py) that keeps
this script's workload: N streaming requests of random words (about one token each; the
input token counts below are word counts) at a request rate (Poisson arrivals; `inf` sends
them all at once) and/or under a concurrency cap, fixed output lengths unless
--no-ignore-eos. Prints vLLM's summary table (TTFT, TPOT, ITL and end-to-end latency: mean,
median, p90, p99) and one JSON line. Definitions (as in vLLM): TTFT = time to the first
streamed token; TPOT = (latency - TTFT) / (output tokens - 1) per request; ITL = the gaps
between successive streamed chunks. For vLLM's datasets (random tokens, ShareGPT) and
--save-result, use `pagedserve bench serve`.

  pagedserve serve MODEL --port 8000 &
  python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 \
      --request-rate 20 --input-len 128 --output-len 128
"""

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.entrypoints.bench.datasets import SampleRequest  # noqa: E402
from pagedserve.entrypoints.bench.serve_client import (  # noqa: E402
    benchmark,
    get_json,
    open_session,
)
from pagedserve.entrypoints.bench.serve_metrics import (  # noqa: E402
    calculate_metrics,
    print_summary,
)

_WORDS = (  # noqa: SIM905 (a sentence reads better than a 36-item list)
    "the a time upon once little girl boy dog cat tree sun moon happy sad big small red blue "
    "ran jumped played saw found said went home friend park ball water bird fish sky day night"
).split()
METRICS = ["ttft", "tpot", "itl", "e2el"]
PERCENTILES = [90.0, 99.0]


def make_prompts(num: int, input_len: int, seed: int) -> list[str]:
    """Random word sequences of about `input_len` tokens (one word is about one token)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(num)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base_url = args.base_url.rstrip("/")
    model = args.model
    if not model:
        model = (await get_json(f"{base_url}/v1/models", args.api_key, args.timeout))["data"][0][
            "id"
        ]
    async with open_session(args.api_key, args.timeout, args.max_concurrency) as session:
        requests = [
            SampleRequest(prompt, args.input_len, args.output_len)
            for prompt in make_prompts(args.num_prompts, args.input_len, args.seed)
        ]
        body: dict[str, Any] = {
            "model": model,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension: fixed output lengths
        outputs, duration = await benchmark(
            session, base_url + args.endpoint, body, requests,
            args.request_rate, 1.0, args.max_concurrency, args.seed,
        )  # fmt: skip
    summary = {
        "benchmark": "serving",
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        **calculate_metrics(requests, outputs, duration, METRICS, PERCENTILES),
    }
    errors = [e for e in summary.pop("errors") if e]
    if errors:
        summary["first_error"] = errors[0]
    for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts"):
        del summary[key]  # per-request lists: `pagedserve bench serve --save-result` has them
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions")  # fmt: skip
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: all at once)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight (default: no cap)")  # fmt: skip
    parser.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: fixed output lengths)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    summary = asyncio.run(run(args))
    print_summary(summary, METRICS, PERCENTILES)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
