"""Command-line flags of the OpenAI-compatible server, shared by `pagedserve serve` and
`python -m pagedserve.entrypoints.openai.api_server`."""

import argparse
import math

from pagedserve import envs
from pagedserve.engine.arg_utils import add_engine_args

from .body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES


def port(text: str) -> int:
    """argparse type of --port (its name appears in "invalid port value")."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def seconds(text: str) -> float:
    """argparse type of a positive, finite duration."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a positive integer."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server flags, then the engine flags (one per EngineArgs field), in two groups."""
    server = parser.add_argument_group("server options")
    server.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (default: %(default)s)"
    )
    server.add_argument("--port", type=port, default=8000, help="port (default: %(default)s)")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) that clients pass as `model`; the first is used in responses "
        "(default: the --model argument)",
    )
    server.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health and /metrics "
        "(default: $PAGEDSERVE_API_KEY, else no key)",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template: a file, or the template itself (default: the tokenizer's)",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="largest request body accepted; a larger one gets 413 before it is read "
        "(default: %(default)s, 16 MiB)",
    )
    server.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="when the engine core dies, keep serving (every request then gets a 503) "
        "instead of exiting with status 1 so that a supervisor restarts the server "
        "(vLLM: VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1)",
    )
    server.add_argument(
        "--disable-log-requests", action="store_true", help="do not log each request"
    )
    server.add_argument(
        "--disable-log-stats", action="store_true", help="do not log throughput periodically"
    )
    server.add_argument(
        "--stats-log-interval",
        type=seconds,
        default=10.0,
        help="seconds between throughput log lines (default: %(default)s)",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of uvicorn (default: %(default)s)",
    )
    add_engine_args(parser.add_argument_group("engine options"))
    return parser


def resolve_server_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on other flags or the environment."""
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if args.api_key is None:
        args.api_key = envs.api_key()
    if not args.served_model_name:
        args.served_model_name = [args.model]
    return args
