"""Online serving benchmark against any OpenAI-compatible server (vLLM's `bench serve` metrics).

Sends N streaming requests at a request rate (Poisson arrivals; `inf` sends them all at once)
and/or under a concurrency cap, then prints request and output-token throughput and the mean,
median, p90 and p99 of TTFT, TPOT, ITL and end-to-end latency, as a table and one JSON line.
Definitions (as in vLLM): TTFT = time to the first streamed token; TPOT = (latency - TTFT) /
(output tokens - 1) per request; ITL = the gaps between successive streamed chunks.

  pagedserve serve MODEL --port 8000 &
  python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 \
      --request-rate 20 --input-len 128 --output-len 128
"""

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

_WORDS = (  # noqa: SIM905 (a sentence reads better than a 36-item list)
    "the a time upon once little girl boy dog cat tree sun moon happy sad big small red blue "
    "ran jumped played saw found said went home friend park ball water bird fish sky day night"
).split()


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    num_output_tokens: int = 0
    itls: list[float] = field(default_factory=list)


def make_prompts(num: int, input_len: int, seed: int) -> list[str]:
    """Random word sequences of about `input_len` tokens (one word is about one token)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(num)]


async def send_one(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: str
) -> RequestResult:
    result = RequestResult(start=time.perf_counter())
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: fixed output lengths
    if args.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    last = result.start
    num_chunks = 0
    try:
        async with client.stream("POST", args.endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("usage"):
                    result.num_output_tokens = data["usage"]["completion_tokens"]
                if not _has_text(data):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft = now - result.start
                else:
                    result.itls.append(now - last)
                last = now
                num_chunks += 1
        result.latency = time.perf_counter() - result.start
        result.num_output_tokens = result.num_output_tokens or num_chunks
        result.ok = num_chunks > 0
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


def _has_text(data: dict[str, Any]) -> bool:
    for choice in data.get("choices", []):
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = random.Random(args.seed)

        async def limited(prompt: str) -> RequestResult:
            async with semaphore:
                return await send_one(client, args, model, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def _stats(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p90_{name}_ms": 0.0,
                f"p99_{name}_ms": 0.0}  # fmt: skip
    ordered = sorted(values)

    def percentile(q: float) -> float:  # linear interpolation, as numpy's default
        position = (len(ordered) - 1) * q
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {
        f"mean_{name}_ms": 1000 * sum(ordered) / len(ordered),
        f"median_{name}_ms": 1000 * percentile(0.5),
        f"p90_{name}_ms": 1000 * percentile(0.9),
        f"p99_{name}_ms": 1000 * percentile(0.99),
    }


def summarize(
    args: argparse.Namespace, model: str, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    num_output = sum(r.num_output_tokens for r in done)
    tpots = [
        (r.latency - r.ttft) / (r.num_output_tokens - 1) for r in done if r.num_output_tokens > 1
    ]
    summary: dict[str, Any] = {
        "benchmark": "serving",
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "completed": len(done),
        "failed": len(errors),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": num_output / duration,
        "total_output_tokens": num_output,
        **_stats("ttft", [r.ttft for r in done]),
        **_stats("tpot", tpots),
        **_stats("itl", [gap for r in done for gap in r.itls]),
        **_stats("e2el", [r.latency for r in done]),
    }
    if errors:
        summary["first_error"] = errors[0]
    return summary


def print_table(summary: dict[str, Any]) -> None:
    print(f"completed {summary['completed']}/{summary['num_prompts']} requests in "
          f"{summary['duration_s']:.2f} s ({summary['failed']} failed)")  # fmt: skip
    print(f"request throughput: {summary['request_throughput']:.2f} req/s")
    print(f"output throughput:  {summary['output_throughput']:.1f} tok/s")
    print(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        row = [summary[f"{kind}_{name}_ms"] for kind in ("mean", "median", "p90", "p99")]
        print(f"{name.upper():<6}" + "".join(f"{value:>10.2f}" for value in row))


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
    print_table(summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
