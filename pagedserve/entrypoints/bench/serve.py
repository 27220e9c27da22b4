"""`pagedserve bench serve`: streamed requests against an OpenAI-compatible server (vLLM's)."""

import argparse
import asyncio
import os
from typing import Any

from pagedserve.entrypoints.bench.datasets import (
    DatasetError,
    add_dataset_args,
    read_sharegpt,
    sample_requests,
)
from pagedserve.entrypoints.bench.plots import plot_path, plot_sweep
from pagedserve.entrypoints.bench.results import (
    add_result_args,
    model_tag,
    save_result,
    timestamp,
)
from pagedserve.entrypoints.bench.serve_metrics import (
    METRICS,
    calculate_metrics,
    print_errors,
    print_summary,
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags."""
    parser.add_argument("--base-url", default=None, help="the server (default: --host, --port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions"
    )
    parser.add_argument("--model", default=None, help="the served model (default: the first)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder (default: --model, else the served root)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per s (default inf: all at once)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrivals: 1 = Poisson, < 1 burstier",
    )
    parser.add_argument(
        "--max-concurrency",
        type=concurrencies,
        default=[None],
        help="most requests in flight (default: no cap); a comma-separated list (1,4,16) "
        "runs the benchmark once per value, a sweep",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="generate every token asked")
    parser.add_argument("--temperature", type=float, default=None, help="default: the server's")
    parser.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help="comma-separated of ttft, tpot, itl, e2el",
    )
    parser.add_argument(
        "--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 25,50,99"
    )
    parser.add_argument("--timeout", type=float, default=6 * 3600.0, help="per request, s")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="draw output throughput against the median latencies, a point per concurrency",
    )
    add_dataset_args(parser)
    add_result_args(parser, output_json=False)


def concurrencies(text: str) -> list[int | None]:
    """--max-concurrency: one positive integer, or a comma-separated list of them (a sweep).
    Raises argparse.ArgumentTypeError naming the bad value."""
    values: list[int | None] = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a positive integer")
        values.append(value)
    return values


def request_body(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The fields every request carries: streaming with usage, and the sampling flags."""
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: fixed output lengths
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


async def _run(args: argparse.Namespace, max_concurrency: int | None) -> dict[str, Any]:
    from pagedserve.engine.llm_engine import load_tokenizer
    from pagedserve.entrypoints.bench.serve_client import benchmark, get_json, open_session

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    card = (await get_json(f"{base_url}/v1/models", args.api_key, args.timeout))["data"][0]
    async with open_session(args.api_key, args.timeout, max_concurrency) as session:
        model = args.model or card["id"]
        tokenizer_id = args.tokenizer or args.model or card.get("root") or model
        try:
            tokenizer = load_tokenizer(tokenizer_id)
        except (OSError, ValueError) as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DatasetError(
                f"cannot load the tokenizer {tokenizer_id!r} to count tokens ({reason}); "
                "pass --tokenizer FOLDER"
            ) from None
        chat = args.endpoint.endswith("chat/completions")
        requests = sample_requests(args, tokenizer.vocab_size, tokenizer, text_prompts=chat)
        outputs, duration = await benchmark(
            session,
            base_url + args.endpoint,
            request_body(model, args),
            requests,
            args.request_rate,
            args.burstiness,
            max_concurrency,
            args.seed,
        )
    selected = args.percentile_metrics.split(",")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    result = {
        "date": timestamp(),
        "backend": "openai-chat" if chat else "openai",
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "num_prompts": len(requests),
        # as vLLM: "inf" (JSON has no infinity)
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": max_concurrency,
        **calculate_metrics(requests, outputs, duration, selected, percentiles),
    }
    print_summary(result, selected, percentiles)
    print_errors(result["errors"])
    return result


def main(args: argparse.Namespace) -> int:
    """Run `bench serve` on parsed flags; a bad dataset or flag ends it with one line."""
    # Imported here: every `pagedserve` command builds this parser, and aiohttp takes 0.2 s.
    from pagedserve.entrypoints.bench.serve_client import CONNECTION_ERRORS, check_aiohttp

    try:
        check_aiohttp()
    except ImportError as e:
        raise SystemExit(f"pagedserve bench serve: error: {e}") from None
    known = {key for key, _, _ in METRICS}
    unknown = set(args.percentile_metrics.split(",")) - known
    if unknown:
        raise SystemExit(
            f"pagedserve bench serve: error: --percentile-metrics takes "
            f"{', '.join(sorted(known))}, not {', '.join(sorted(unknown))}"
        )
    if len(args.max_concurrency) > 1 and args.result_filename:
        raise SystemExit(
            "pagedserve bench serve: error: --result-filename names one file and a sweep of "
            "--max-concurrency writes one per value: leave it out"
        )
    if args.plot:
        try:
            args.plot = str(plot_path(args.plot))  # before the runs, so a typo costs none
        except (ImportError, ValueError) as e:
            raise SystemExit(f"pagedserve bench serve: error: {e}") from None
    try:
        if args.dataset_name == "sharegpt" and args.dataset_path:
            read_sharegpt(args.dataset_path)  # a bad file fails before any request
        results = []
        for max_concurrency in args.max_concurrency:
            result = asyncio.run(_run(args, max_concurrency))
            rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
            concurrency = f"-concurrency{max_concurrency}" if max_concurrency else ""
            name = f"{result['backend']}-{rate}qps{concurrency}-{model_tag(result['model_id'])}"
            save_result(args, result, f"{name}-{result['date']}.json")
            results.append(result)
    except DatasetError as e:
        raise SystemExit(f"pagedserve bench serve: error: {e}") from None
    except CONNECTION_ERRORS as e:
        raise SystemExit(f"pagedserve bench serve: error: cannot reach the server: {e!r}") from None
    if args.plot:
        selected = [k for k in args.percentile_metrics.split(",") if k != "itl"] or ["itl"]
        title = f"{model_tag(results[0]['model_id'])}: {results[0]['num_prompts']} requests"
        try:
            plot_sweep(results, selected, args.plot, title)
        except (ValueError, OSError) as e:  # no request completed; the file cannot be written
            raise SystemExit(f"pagedserve bench serve: error: --plot: {e}") from None
        print(f"plot saved to {args.plot}")
    return 0
