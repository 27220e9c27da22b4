"""The `pagedserve` command line: generate, serve, chat, complete, run-batch and bench."""

import argparse
import logging
import sys

from pagedserve.engine.arg_utils import engine_args_from_namespace
from pagedserve.entrypoints.argv import normalize_argv
from pagedserve.entrypoints.bench.cli import add_bench_command
from pagedserve.entrypoints.model_check import check_local_model
from pagedserve.entrypoints.openai.cli_args import (
    add_config_flag,
    add_engine_args,
    add_run_batch_args,
    add_server_args,
)
from pagedserve.entrypoints.openai.client_cli import add_client_commands
from pagedserve.version import __version__

# `pagedserve generate`'s own defaults, for what neither a flag nor the model's
# generation_config.json sets (64 greedy tokens).
GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


def _generate(args: argparse.Namespace) -> int:
    check_local_model(args.model, "generate")
    from pagedserve.engine.model_files import default_sampling_params
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    given = {
        name: value
        for name, value in (
            ("max_tokens", args.max_tokens),
            ("temperature", args.temperature),
            ("top_p", args.top_p),
            ("top_k", args.top_k),
        )
        if value is not None
    }
    extra = {"seed": args.sampling_seed, "stop": args.stop or None}
    # Bad values end the command with one line naming them (sampling ones before the model
    # loads), not a traceback.
    try:
        SamplingParams(**{**GENERATE_DEFAULTS, **given}, **extra)
        llm = LLM.from_engine_args(engine_args_from_namespace(args))
        # Flags win over the model's generation_config.json defaults (as request fields do
        # on the server), which win over the command's own.
        values = {**GENERATE_DEFAULTS, **llm.llm_engine.config.model_config.diff_sampling_param}
        params = default_sampling_params({**values, **given, **extra})
        if "max_tokens" in given:  # the user's: not a default lowered to fit the context
            params.max_tokens = given["max_tokens"]
        prompts = args.prompt or ["Once upon a time"]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, NotImplementedError) as e:  # a bad option; an unsupported checkpoint
        raise SystemExit(f"pagedserve generate: error: {e}") from None
    for output in outputs:
        completion = output.outputs[0]
        print(
            f"--- prompt: {output.prompt!r} (finish_reason: {completion.finish_reason}, "
            f"{len(completion.token_ids)} tokens)"
        )
        print((output.prompt or "") + completion.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="High-throughput LLM inference with PagedAttention (vLLM-compatible).",
    )
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="generate text for prompts offline",
        description="Generate continuations of prompts with the offline engine.",
    )
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    # None: the model's generation_config.json default, else GENERATE_DEFAULTS
    gen.add_argument("--max-tokens", type=int, help="tokens per prompt (default: 64)")
    gen.add_argument("--temperature", type=float, help="0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, help="nucleus mass, 1 = off (default: 1)")
    gen.add_argument("--top-k", type=int, help="top-k, 0 = off (default: 0)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    add_config_flag(gen)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    serve = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /version, /metrics).",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model folder or Hub id (same as --model; default: the bundled stories260k)",
    )
    add_server_args(serve)
    serve.set_defaults(func=_serve)
    add_client_commands(sub)
    batch = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSON lines) with the engine in process",
        description="Run the requests of an OpenAI batch file (/v1/chat/completions and "
        "/v1/completions lines) through the server's request handling, with no HTTP server; "
        "write one result line per input line.",
    )
    add_run_batch_args(batch)
    add_config_flag(batch)
    add_engine_args(batch.add_argument_group("engine options"))
    batch.set_defaults(func=_run_batch)
    add_bench_command(sub)
    return parser


def _serve(args: argparse.Namespace) -> int:
    check_local_model(args.model_tag or args.model, "serve")
    from pagedserve.entrypoints.openai.api_server import run_server

    run_server(args)
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    check_local_model(args.model, "run-batch")
    from pagedserve.entrypoints.openai.run_batch import main as run_batch_main

    return run_batch_main(args)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    argv = normalize_argv(sys.argv[1:] if argv is None else argv, parser)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's (argparse's default)
        subcommand = _subparsers(parser)[args.command]
        if getattr(args, "bench_command", None):  # `bench throughput` etc.: one level down
            subcommand = _subparsers(subcommand)[args.bench_command]
        subcommand.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


if __name__ == "__main__":
    sys.exit(main())
