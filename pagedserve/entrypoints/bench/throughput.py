"""`pagedserve bench throughput`: offline `LLM.generate` over a dataset (vLLM's metrics)."""

import argparse
import time
from collections.abc import Sequence
from typing import Any

from pagedserve.entrypoints.bench.datasets import (
    DatasetError,
    SampleRequest,
    add_dataset_args,
    read_sharegpt,
    sample_requests,
)
from pagedserve.entrypoints.bench.results import (
    add_result_args,
    model_tag,
    save_result,
    timestamp,
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench throughput` flags (the engine's are added by the caller)."""
    add_dataset_args(parser)
    parser.add_argument(
        "--input-len", type=int, default=None, help="random dataset: the same as --random-input-len"
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens of every request (overrides the dataset's)",
    )
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument(
        "--disable-detokenize", action="store_true", help="leave detokenizing out of the timed run"
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="draw each step's time against its roofline floor, and its MBU / MFU, into PNG",
    )
    add_result_args(parser)


def make_llm(args: argparse.Namespace, command: str) -> Any:
    """The offline engine of the parsed engine flags; a bad option ends the command with one
    line (not a traceback)."""
    from pagedserve.engine.arg_utils import engine_args_from_namespace
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.entrypoints.model_check import check_local_model

    check_local_model(args.model, f"bench {command}")
    try:
        return LLM.from_engine_args(engine_args_from_namespace(args))
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"pagedserve bench {command}: error: {e}") from None


def bench_params(args: argparse.Namespace, max_tokens: int) -> Any:
    """vLLM's benchmark sampling (`bench throughput` and `bench latency`): `--n` completions
    at temperature 1 and top_p 1, `max_tokens` each whatever EOS says, detokenized unless
    `--disable-detokenize`. Raises ValueError (InvalidRequestError) for a bad `--n`."""
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n,
        temperature=1.0,
        top_p=1.0,
        ignore_eos=True,
        max_tokens=max_tokens,
        detokenize=not args.disable_detokenize,
    )


def run_generate(
    llm: Any, prompts: Sequence[Any], params: Sequence[Any]
) -> tuple[float, list[Any]]:
    """Time one `llm.generate(prompts, params)`: (seconds, outputs)."""
    start = time.perf_counter()
    outputs = llm.generate(list(prompts), list(params), use_tqdm=False)
    return time.perf_counter() - start, outputs


def throughput_metrics(
    requests: Sequence[SampleRequest], outputs: Sequence[Any], elapsed: float
) -> dict[str, Any]:
    """vLLM's throughput result (elapsed_time in s, requests_per_second, tokens_per_second:
    prompt and output tokens per s) and output tokens per s; output tokens are counted from
    the outputs (every completion of every request)."""
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def print_throughput(metrics: dict[str, Any]) -> None:
    """vLLM's lines: requests/s, total tokens/s, output tokens/s, then the token totals."""
    print(
        f"Throughput: {metrics['requests_per_second']:.2f} requests/s, "
        f"{metrics['tokens_per_second']:.2f} total tokens/s, "
        f"{metrics['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {metrics['total_prompt_tokens']}")
    print(f"Total num output tokens:  {metrics['total_output_tokens']}")


def roofline_summary(llm: Any, plot: str | None, title: str) -> dict[str, Any]:
    """The run's MBU and MFU from the engine's `step_records` against the device's peaks
    (None where unknown), and with `plot` a PNG of its steps (`plots.plot_steps`)."""
    from pagedserve.entrypoints.bench.plots import plot_steps
    from pagedserve.roofline import device_peaks, run_summary

    engine = llm.llm_engine
    records = engine.step_records or []
    peaks = device_peaks(engine.engine_core.device_name)
    if plot:
        plot_steps(records, peaks, plot, title)
        print(f"plot saved to {plot}")
    return run_summary(records, peaks)


def print_roofline(summary: dict[str, Any]) -> None:
    """One line: the steps, and MBU / MFU where the device's peaks are known."""
    shown = [f"{summary['num_steps']} steps"]
    shown += [
        f"{k.upper()}: {100 * summary[k]:.1f}%" for k in ("mbu", "mfu") if summary[k] is not None
    ]
    if summary["mbu"] is None and summary["mfu"] is None:
        shown.append("MBU / MFU: no device peaks known")
    print("Roofline: " + ", ".join(shown))


def main(args: argparse.Namespace) -> int:
    """Run `bench throughput` on parsed flags; dataset errors end it with one line."""
    from pagedserve.entrypoints.bench.plots import plot_path
    from pagedserve.errors import InvalidRequestError
    from pagedserve.roofline import device_peaks

    # What the summary and the plot after the run need is checked before it, so that a bad
    # --plot or PAGEDSERVE_PEAK_* does not cost the run.
    try:
        device_peaks(None)
        if args.plot:
            args.plot = str(plot_path(args.plot))
    except (ImportError, ValueError) as e:
        raise SystemExit(f"pagedserve bench throughput: error: {e}") from None

    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
    try:
        if args.dataset_name == "sharegpt" and args.dataset_path:
            read_sharegpt(args.dataset_path)  # a bad file fails before the model loads
        llm = make_llm(args, "throughput")
        tokenizer = None if args.skip_tokenizer_init else llm.get_tokenizer()
        vocab = llm.llm_engine.config.model_config.hf_text_config.vocab_size
        requests = sample_requests(args, vocab, tokenizer)
    except DatasetError as e:
        raise SystemExit(f"pagedserve bench throughput: error: {e}") from None
    prompts = [
        {"prompt_token_ids": r.prompt} if isinstance(r.prompt, list) else r.prompt for r in requests
    ]
    try:
        params = [bench_params(args, r.expected_output_len) for r in requests]
        llm.llm_engine.step_records = []
        elapsed, outputs = run_generate(llm, prompts, params)
    except InvalidRequestError as e:  # a flag the engine refuses (--n 0, a too long prompt)
        raise SystemExit(f"pagedserve bench throughput: error: {e}") from None
    finally:
        llm.llm_engine.shutdown()
    metrics = throughput_metrics(requests, outputs, elapsed)
    print_throughput(metrics)
    title = f"{model_tag(args.model)}: {len(requests)} requests, bench throughput"
    try:
        roofline = roofline_summary(llm, args.plot, title)
    except OSError as e:  # the plot's file cannot be written
        raise SystemExit(f"pagedserve bench throughput: error: --plot: {e}") from None
    print_roofline(roofline)
    result = {"date": timestamp(), "model_id": args.model, **metrics, **roofline}
    save_result(args, result, f"throughput-{model_tag(args.model)}-{result['date']}.json")
    return 0
