"""Command-line flags of the OpenAI-compatible server, shared by `pagedserve serve` and
`python -m pagedserve.entrypoints.openai.api_server`.

`python -m pagedserve.entrypoints.openai.cli_args --markdown engine` (or `server`) prints the
option table that README.md (docs/serving.md) holds between its `engine-options`
(`server-options`) marker comments; tests/entrypoints/test_options.py checks they agree."""

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from pagedserve import envs
from pagedserve.config import DEFAULT_MODEL
from pagedserve.config_options import option
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.entrypoints.options import add_options, markdown_table

from .tool_parsers import TOOL_PARSERS

# Here, not in body_limit (which imports the web stack): `pagedserve serve` parses its flags,
# and fails on a bad one, before fastapi loads.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20  # a 128k-token prompt as token ids is ~1 MB


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


def json_list(text: str) -> list[str]:
    """argparse type of vLLM's list flags (`--allowed-origins '["https://a.example"]'`): a
    JSON list of strings, or one bare string."""
    if not text.lstrip().startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list ({e}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
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
        default_text="the --model argument (stories260k for the bundled model)",
        cli={"nargs": "+"},
    )
    api_key: list[str] | None = option(
        None,
        help="require `Authorization: Bearer KEY` (any of the keys given) on every route but "
        "/health, /ping, /metrics and /dashboard; an empty key is no key (as vLLM)",
        default_text="$PAGEDSERVE_API_KEY, else no key",
        cli={"nargs": "+"},
    )
    protect_metrics: bool = option(
        False,
        help="require the API key on /metrics too (the /dashboard page stays open, holding no "
        "data, and asks for the key to read /metrics); needs --api-key",
        cli={"action": "store_true"},
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
    enable_log_requests: bool = option(
        False,
        help="log each request's id, prompt size and sampling parameters (off by default, "
        "as in vLLM)",
        cli={"action": "store_true"},
    )
    disable_log_requests: bool = option(
        False,
        help="deprecated, as in vLLM: requests are not logged unless --enable-log-requests",
        cli={"action": "store_true"},
    )
    disable_log_stats: bool = option(
        False, help="do not log throughput periodically", cli={"action": "store_true"}
    )
    stats_log_interval: float = option(
        10.0, help="seconds between throughput log lines", cli={"type": seconds}
    )
    allowed_origins: list[str] | None = option(
        None,
        help="CORS: origins a browser page may call the API from (a JSON list, as vLLM)",
        default_text='["*"] (any)',
        cli={"type": json_list},
    )
    allowed_methods: list[str] | None = option(
        None,
        help="CORS: allowed HTTP methods (a JSON list)",
        default_text='["*"]',
        cli={"type": json_list},
    )
    allowed_headers: list[str] | None = option(
        None,
        help="CORS: allowed request headers (a JSON list)",
        default_text='["*"]',
        cli={"type": json_list},
    )
    allow_credentials: bool = option(
        False, help="CORS: allow credentials (cookies, auth headers)", cli={"action": "store_true"}
    )
    root_path: str | None = option(
        None,
        help="the path prefix a proxy serves the API under (ASGI root_path, e.g. /llm)",
        default_text="none",
    )
    ssl_keyfile: str | None = option(
        None, help="TLS: the server's private key file (PEM)", default_text="no TLS"
    )
    ssl_certfile: str | None = option(
        None, help="TLS: the server's certificate file (PEM)", default_text="no TLS"
    )
    ssl_ca_certs: str | None = option(
        None, help="TLS: CA certificates to verify clients with", default_text="none"
    )
    ssl_cert_reqs: int = option(
        0,
        help="TLS: whether client certificates are required (Python ssl: 0 none, 1 optional, "
        "2 required)",
        cli={"type": int, "choices": [0, 1, 2]},
    )
    uvicorn_log_level: str = option(
        "info",
        help="log level of uvicorn",
        cli={"choices": ["critical", "error", "warning", "info", "debug", "trace"]},
    )


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """`--config FILE.yaml` in the help; `argv.normalize_argv` expands it before parsing."""
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=argparse.SUPPRESS,  # expanded before parsing: never an attribute
        help="read flags from a YAML file of `flag-name: value` lines (as vLLM's --config); "
        "flags on the command line win",
    )


def add_engine_args(parser: Any, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag-name` per EngineArgs field (vLLM's spelling) to an argparse parser."""
    add_options(parser, EngineArgs, skip)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server flags, then the engine flags (one per EngineArgs field), in two groups."""
    add_config_flag(parser)
    add_options(parser.add_argument_group("server options"), ServerArgs)
    add_engine_args(parser.add_argument_group("engine options"))
    return parser


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    """`pagedserve run-batch`'s own flags (vLLM's names); the engine's are added apart."""
    parser.add_argument(
        "-i", "--input-file", required=True,
        help="the batch file: one JSON request per line (a local path; URLs are refused)",
    )  # fmt: skip
    parser.add_argument(
        "-o", "--output-file", required=True,
        help="where to write one JSON result per input line, in input order (a local path)",
    )  # fmt: skip
    parser.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="model name(s) that bodies may give as `model` (default: the --model argument, "
        "stories260k for the bundled model)",
    )  # fmt: skip
    parser.add_argument(
        "--chat-template", default=None,
        help="Jinja chat template: a file, or the template itself (default: the tokenizer's)",
    )  # fmt: skip


def resolve_server_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on other flags or the environment."""
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if args.api_key is None:
        key = envs.api_key()
        args.api_key = [key] if key else None
    else:  # as vLLM, an empty key is no key: `--api-key ""` leaves the API open
        args.api_key = [key for key in args.api_key if key] or None
    if not args.served_model_name:
        # The bundled model by its name, not its path inside site-packages.
        args.served_model_name = ["stories260k" if args.model == DEFAULT_MODEL else args.model]
    return args


def check_server_args(args: argparse.Namespace) -> None:
    """Raise ValueError for flags that do not go together (vLLM's checks)."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.protect_metrics and not args.api_key:
        raise ValueError("--protect-metrics requires --api-key (or $PAGEDSERVE_API_KEY)")


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
