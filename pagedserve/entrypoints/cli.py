"""The `pagedserve` command line: `generate` (offline) and `serve` (OpenAI-compatible server)."""

import argparse
import logging
import sys

from pagedserve.engine.arg_utils import engine_args_from_namespace
from pagedserve.entrypoints.openai.cli_args import add_engine_args, add_server_args


def _generate(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    # Bad values end the command with one line naming them (sampling ones before the model
    # loads), not a traceback.
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            stop=args.stop or None,
        )
        llm = LLM.from_engine_args(engine_args_from_namespace(args))
        prompts = args.prompt or ["Once upon a time"]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, NotImplementedError) as e:  # a bad option; an unsupported checkpoint
        raise SystemExit(f"pagedserve generate: error: {e}") from None
    for output in outputs:
        completion = output.outputs[0]
        print(
            f"--- prompt: {output.prompt!r} ({completion.finish_reason}, "
            f"{len(completion.token_ids)} tokens)"
        )
        print((output.prompt or "") + completion.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="High-throughput LLM inference with PagedAttention (vLLM-compatible).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="generate text for prompts offline",
        description="Generate continuations of prompts with the offline engine.",
    )
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument(
        "--max-tokens", type=int, default=64, help="tokens per prompt (default: %(default)s)"
    )
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    gen.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus mass, 1 = off (default: %(default)s)"
    )
    gen.add_argument("--top-k", type=int, default=0, help="top-k, 0 = off (default: %(default)s)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--stop", action="append", help="a stop string (repeat for several)")
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
    return parser


def _serve(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.openai.api_server import run_server

    run_server(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
