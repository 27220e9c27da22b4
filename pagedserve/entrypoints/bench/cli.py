"""The `pagedserve bench {throughput,latency,serve}` subcommands' parsers."""

import argparse
from typing import Any

from pagedserve.entrypoints.openai.cli_args import add_config_flag, add_engine_args


def _throughput(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.bench.throughput import main

    return main(args)


def _latency(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.bench.latency import main

    return main(args)


def _serve(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.bench.serve import main

    return main(args)


def add_bench_command(sub: Any) -> None:
    """Add `bench` and its three subcommands to the `pagedserve` subparsers `sub`."""
    from pagedserve.entrypoints.bench import latency, serve, throughput

    bench = sub.add_parser(
        "bench",
        help="benchmark offline throughput, batch latency or a server (vLLM's `vllm bench`)",
        description="Benchmarks with vLLM's flags and metrics.",
    )
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, run, help_text in (
        ("throughput", throughput, _throughput, "offline LLM.generate over a dataset"),
        ("latency", latency, _latency, "the time to run one batch to completion"),
    ):
        parser = kinds.add_parser(name, help=help_text, description=help_text + ".")
        module.add_cli_args(parser)
        add_config_flag(parser)
        add_engine_args(parser.add_argument_group("engine options"))
        parser.set_defaults(func=run)
    parser = kinds.add_parser(
        "serve",
        help="streamed requests against an OpenAI-compatible server",
        description="Send a dataset's requests to a running OpenAI-compatible server and "
        "report TTFT, TPOT, ITL and end-to-end latency (vLLM's summary).",
    )
    serve.add_cli_args(parser)
    parser.set_defaults(func=_serve)
