"""`bench serve`'s metrics and summary table, as vLLM computes and prints them."""

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedserve.entrypoints.bench.datasets import SampleRequest

# (key, name, header) of the per-request latency metrics --percentile-metrics picks from.
METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclass
class RequestOutput:
    """One streamed request as the client saw it; times in seconds (perf_counter)."""

    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0  # to the first streamed chunk with text
    latency: float = 0.0  # to the end of the stream
    output_tokens: int = 0  # the usage's completion_tokens (else the chunks with text)
    itl: list[float] = field(default_factory=list)  # gaps between chunks with text
    generated_text: str = ""


def _percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(
    requests: list[SampleRequest],
    outputs: list[RequestOutput],
    duration: float,
    selected: list[str],
    percentiles: list[float],
) -> dict[str, Any]:
    """vLLM's result: counts, throughputs (per s of `duration`), peaks, and for each
    `selected` metric its mean, median, std and `percentiles` in ms (0 with no samples).
    TPOT = (latency - TTFT) / (output tokens - 1) of requests with more than one token."""
    done = [(r, o) for r, o in zip(requests, outputs, strict=True) if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_input = sum(r.prompt_len for r, _ in done)
    samples = {
        "ttft": [o.ttft for _, o in done],
        "tpot": [
            (o.latency - o.ttft) / (o.output_tokens - 1) for _, o in done if o.output_tokens > 1
        ],
        "itl": [gap for _, o in done for gap in o.itl],
        "e2el": [o.latency for _, o in done],
    }
    peak_tokens, peak_requests = _peaks([o for _, o in done])
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": sum(output_lens),
        "request_throughput": len(done) / duration,
        "output_throughput": sum(output_lens) / duration,
        "total_token_throughput": (total_input + sum(output_lens)) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    for key, _, _ in METRICS:
        if key not in selected:
            continue
        values = np.array(samples[key] or [0.0]) * 1000
        result[f"mean_{key}_ms"] = float(np.mean(values))
        result[f"median_{key}_ms"] = float(np.median(values))
        result[f"std_{key}_ms"] = float(np.std(values))
        for p in percentiles:
            result[f"p{_percentile_key(p)}_{key}_ms"] = float(np.percentile(values, p))
    result["input_lens"] = [r.prompt_len for r in requests]
    result["output_lens"] = output_lens
    result["ttfts"] = [o.ttft for o in outputs]
    result["itls"] = [o.itl for o in outputs]
    result["generated_texts"] = [o.generated_text for o in outputs]
    result["errors"] = [o.error for o in outputs]
    return result


def _peaks(outputs: list[RequestOutput]) -> tuple[float, int]:
    """The most streamed chunks in one whole second of the run (vLLM's peak output
    throughput; a chunk is one token unless the server merged a backlog of outputs into
    it, and vLLM's benchmark counts chunks too), and the most requests in flight at one
    moment (a sweep over their starts and ends; vLLM buckets this by second too, which counts
    requests that never overlapped)."""
    if not outputs:
        return 0.0, 0
    origin = min(o.start for o in outputs)
    seconds = int(max(o.start + o.latency for o in outputs) - origin) + 1
    tokens = np.zeros(seconds)
    for o in outputs:
        t = o.start - origin + o.ttft
        for gap in [0.0, *o.itl]:
            t += gap
            tokens[min(int(t), seconds - 1)] += 1
    # (time, +1 start / -1 end), an end before a start at the same time
    events = sorted([(o.start, 1) for o in outputs] + [(o.start + o.latency, -1) for o in outputs])
    in_flight = peak = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    return float(tokens.max()), peak


def print_summary(result: dict[str, Any], selected: list[str], percentiles: list[float]) -> None:
    """vLLM's "Serving Benchmark Result" table."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", result["completed"]))
    print("{:<40} {:<10}".format("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        print("{:<40} {:<10}".format("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate", "inf") not in ("inf", float("inf")):
        print("{:<40} {:<10.2f}".format("Request rate configured (RPS):", result["request_rate"]))
    rows = (
        ("Benchmark duration (s):", "duration"),
        ("Total input tokens:", "total_input_tokens"),
        ("Total generated tokens:", "total_output_tokens"),
        ("Request throughput (req/s):", "request_throughput"),
        ("Output token throughput (tok/s):", "output_throughput"),
        ("Peak output token throughput (tok/s):", "max_output_tokens_per_s"),
        ("Peak concurrent requests:", "max_concurrent_requests"),
        ("Total Token throughput (tok/s):", "total_token_throughput"),
    )
    for label, key in rows:
        value = result[key]
        shown = f"{value:<10}" if isinstance(value, int) else f"{value:<10.2f}"
        print(f"{label:<40} {shown}")
    for key, name, header in METRICS:
        if key not in selected:
            continue
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {name} (ms):", result[f"mean_{key}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {name} (ms):", result[f"median_{key}_ms"]))
        for p in percentiles:
            word = _percentile_key(p)
            print("{:<40} {:<10.2f}".format(f"P{word} {name} (ms):", result[f"p{word}_{key}_ms"]))
    print("=" * 50)


def print_errors(errors: list[str], shown: int = 3) -> None:
    """The failed requests' errors after the summary: the `shown` most frequent distinct ones
    with their counts (vLLM prints its failures' errors too; a failure was otherwise only a
    count, its reason only in --save-result's "errors")."""
    counts = Counter(e for e in errors if e)
    if not counts:
        return
    print(f"{sum(counts.values())} failed request(s); errors (count: first line):")
    for error, count in counts.most_common(shown):
        print(f"  {count}: {error.strip().splitlines()[0][:300]}")
    if len(counts) > shown:
        print(f"  ... and {len(counts) - shown} other distinct error(s)")
