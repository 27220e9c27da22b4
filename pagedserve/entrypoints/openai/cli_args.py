"""Command-line flags of the OpenAI-compatible server, shared by `pagedserve serve` and
`python -m pagedserve.entrypoints.openai.api_server`.

`python -m pagedserve.entrypoints.openai.cli_args --markdown engine` (or `server`) prints the
option table that README.md (docs/serving.md) holds between its `engine-options`
(`server-options`) marker comments; tests/entrypoints/test_options.py checks they agree."""

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any

from pagedserve import envs
from pagedserve.config import option
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.entrypoints.options import add_options, markdown_table

from .body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from .tool_parsers import TOOL_PARSERS


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


@dataclass(frozen=True)
class ServerArgs:
    """The server's own flags (the engine's are EngineArgs'), declared once: `--help`, the
    parser and the table in docs/serving.md are generated from these fields."""

    host: str = option("0.0.0.0", help="address to listen on")
    port: int = option(8000, help="port", cli={"type": port})  # the function above
    served_model_name: list[str] | None = option(
        None,
        help="model name(s) that clients pass as `model`; the first is used in responses",
        default_text="the --model argument",
        cli={"nargs": "+"},
    )
    api_key: str | None = option(
        None,
        help="require `Authorization: Bearer KEY` on every route but /health and /metrics",
        default_text="$PAGEDSERVE_API_KEY, else no key",
    )
    chat_template: str | None = option(
        None,
        help="Jinja chat template: a file, or the template itself",
        default_text="the tokenizer's",
    )
    enable_auto_tool_choice: bool = option(
        False,
        help='let the model decide when to call tools (tool_choice "auto", the default of a '
        "request with tools); needs --tool-call-parser",
        cli={"action": "store_true"},
    )
    tool_call_parser: str | None = option(
        None,
        help="how the model writes tool calls, to find them in its output (tool_choice "
        '"auto"); "required" and a named function work without it',
        default_text="none",
        cli={"choices": TOOL_PARSERS},
    )
    max_request_body_bytes: int = option(
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="largest request body accepted, in bytes; a larger one gets 413 before it is read "
        "(on Content-Length, or as a streamed body passes the limit)",
        cli={"type": positive_int},
    )
    keep_alive_on_engine_death: bool = option(
        False,
        help="when the engine core dies, keep serving (every request then gets a 503) "
        "instead of exiting with status 1 so that a supervisor restarts the server "
        "(vLLM: VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1)",
        cli={"action": "store_true"},
    )
    disable_log_requests: bool = option(
        False, help="do not log each request", cli={"action": "store_true"}
    )
    disable_log_stats: bool = option(
        False, help="do not log throughput periodically", cli={"action": "store_true"}
    )
    stats_log_interval: float = option(
        10.0, help="seconds between throughput log lines", cli={"type": seconds}
    )
    uvicorn_log_level: str = option(
        "info",
        help="log level of uvicorn",
        cli={"choices": ["critical", "error", "warning", "info", "debug", "trace"]},
    )


def add_engine_args(parser: Any, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag-name` per EngineArgs field (vLLM's spelling) to an argparse parser."""
    add_options(parser, EngineArgs, skip)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server flags, then the engine flags (one per EngineArgs field), in two groups."""
    add_options(parser.add_argument_group("server options"), ServerArgs)
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


def check_server_args(args: argparse.Namespace) -> None:
    """Raise ValueError for flags that do not go together (vLLM's checks)."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


def main(argv: list[str] | None = None) -> int:
    """Print the Markdown table of the engine or server options."""
    parser = argparse.ArgumentParser(description="Print an option table for the docs.")
    parser.add_argument("--markdown", choices=["engine", "server"], required=True)
    args = parser.parse_args(argv)
    print(engine_table() if args.markdown == "engine" else server_table())
    return 0


def engine_table() -> str:
    """The Markdown table of the engine options (README.md): keyword, flag, default, meaning."""
    return markdown_table(EngineArgs, keyword_column=True)


def server_table() -> str:
    """The Markdown table of the server's own flags (docs/serving.md)."""
    return markdown_table(ServerArgs, keyword_column=False)


if __name__ == "__main__":
    sys.exit(main())
