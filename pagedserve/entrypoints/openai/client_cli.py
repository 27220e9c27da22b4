"""`pagedserve chat` and `pagedserve complete`: interactive clients of a running
OpenAI-compatible server (vLLM's `vllm chat` and `vllm complete`), over the `openai` package."""

import argparse
import io
import logging
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, TextIO

DEFAULT_URL = "http://localhost:8000/v1"


def add_client_args(parser: argparse.ArgumentParser, quick_metavar: str) -> None:
    """The flags `chat` and `complete` share (vLLM's names)."""
    parser.add_argument(
        "--url", default=DEFAULT_URL,
        help=f"base URL of the running OpenAI-compatible server (default: {DEFAULT_URL})",
    )  # fmt: skip
    parser.add_argument(
        "--model-name", default=None,
        help="the model to ask (default: the first one that /v1/models lists)",
    )  # fmt: skip
    parser.add_argument(
        "--api-key", default=None,
        help="the server's API key (default: $OPENAI_API_KEY, else none)",
    )  # fmt: skip
    parser.add_argument(
        "-q", "--quick", metavar=quick_metavar, default=None,
        help=f"send this one {quick_metavar.lower()}, print the reply and exit",
    )  # fmt: skip


def _openai() -> Any:
    """The `openai` module, or SystemExit saying how to install it."""
    try:
        import openai
    except ImportError:
        raise SystemExit(
            "pagedserve: error: the chat and complete commands need the openai package: "
            "pip install 'pagedserve[client]' (or pip install openai)"
        ) from None
    return openai


def connect(args: argparse.Namespace, command: str) -> tuple[Any, str]:
    """An OpenAI client of `--url` and the model to ask (`--model-name`, else the server's
    first). Raises SystemExit with one line when the server cannot be reached or refuses."""
    openai = _openai()
    logging.getLogger().setLevel(logging.WARNING)  # no line per HTTP request amid the chat
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    client = openai.OpenAI(base_url=args.url, api_key=api_key, max_retries=0)
    if args.model_name:
        return client, args.model_name
    try:
        models = client.models.list().data
    except openai.OpenAIError as e:
        raise SystemExit(f"pagedserve {command}: error: {describe(e, args.url)}") from None
    if not models:
        raise SystemExit(f"pagedserve {command}: error: {args.url}/models lists no model")
    return client, str(models[0].id)


def describe(error: Exception, url: str) -> str:
    """One line for a failed call: the server's message, or why it could not be reached."""
    openai = _openai()
    if isinstance(error, openai.APIConnectionError):
        return f"cannot reach the server at {url} ({error.__cause__ or error})"
    if isinstance(error, openai.APIStatusError):
        body = error.body if isinstance(error.body, dict) else {}
        message = body.get("message") or error.message
        return f"the server answered {error.status_code}: {message}"
    return str(error)


def stream_text(chunks: Iterable[Any], text_of: Callable[[Any], str | None], out: TextIO) -> str:
    """Print each chunk's text as it arrives (then a newline); the whole text."""
    parts: list[str] = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        text = text_of(chunk.choices[0])
        if text:
            parts.append(text)
            out.write(text)
            out.flush()
    out.write("\n")
    out.flush()
    return "".join(parts)


def _lines(prompt_text: str) -> Iterable[str]:
    """Lines from stdin (prompting with `prompt_text`) until EOF."""
    while True:
        try:
            yield input(prompt_text)
        except EOFError:
            print()
            return


class NotUTF8Error(ValueError):
    """A line (or --quick text) that is not valid UTF-8: the request JSON cannot carry it."""


def _ask_utf8(ask: Callable[[str], None], text: str) -> None:
    """`ask(text)`; NotUTF8Error (nothing sent) for a text holding undecodable bytes (as
    surrogate escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise NotUTF8Error("the text is not valid UTF-8; nothing was sent") from None
    ask(text)


def _converse(
    args: argparse.Namespace, command: str, ask: Callable[[str], None], intro: str
) -> int:
    """Ask `--quick` once, or each stdin line until EOF; Ctrl-C ends quietly. A failed call
    or a text that is not UTF-8 ends `--quick` with status 1 and is reported (the session
    goes on) interactively."""
    openai = _openai()
    failures = (openai.OpenAIError, NotUTF8Error)
    try:
        if args.quick is not None:
            try:
                _ask_utf8(ask, args.quick)
            except failures as e:
                print(f"pagedserve {command}: error: {describe(e, args.url)}", file=sys.stderr)
                return 1
            return 0
        if isinstance(sys.stdin, io.TextIOWrapper):  # undecodable bytes: reported, no crash
            sys.stdin.reconfigure(errors="surrogateescape")
        print(intro)
        for line in _lines("> "):
            try:
                _ask_utf8(ask, line)
            except failures as e:
                print(f"error: {describe(e, args.url)}", file=sys.stderr)
    except KeyboardInterrupt:
        print()
    return 0


def chat_main(args: argparse.Namespace) -> int:
    """`pagedserve chat`: keep a conversation with the server's model, streaming each reply."""
    try:
        client, model = connect(args, "chat")
    except KeyboardInterrupt:
        return 0
    print(f"Using model: {model}")
    conversation: list[dict[str, str]] = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})

    def ask(message: str) -> None:
        turn = [*conversation, {"role": "user", "content": message}]
        stream = client.chat.completions.create(model=model, messages=turn, stream=True)
        reply = stream_text(stream, lambda choice: choice.delta.content, sys.stdout)
        # Kept only once answered: a failed turn is not part of the conversation.
        conversation[:] = [*turn, {"role": "assistant", "content": reply}]

    return _converse(args, "chat", ask, "Please enter a message for the chat model:")


def complete_main(args: argparse.Namespace) -> int:
    """`pagedserve complete`: complete each prompt with the server's model, streaming."""
    try:
        client, model = connect(args, "complete")
    except KeyboardInterrupt:
        return 0
    print(f"Using model: {model}")

    # Without --max-tokens the field is left out, so the server's default (16) applies: an
    # explicit null means "up to the context length" (vLLM reads it so; we do too).
    limit = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}

    def ask(prompt: str) -> None:
        stream = client.completions.create(model=model, prompt=prompt, stream=True, **limit)
        stream_text(stream, lambda choice: choice.text, sys.stdout)

    return _converse(args, "complete", ask, "Please enter prompt to complete:")


def add_client_commands(sub: Any) -> None:
    """Add the `chat` and `complete` subcommands to an argparse subparsers action."""
    chat = sub.add_parser(
        "chat",
        help="chat with the model of a running server",
        description="Chat with a running OpenAI-compatible server: each stdin line is a user "
        "message; the conversation is kept and each reply streamed. EOF (Ctrl-D) ends it.",
    )
    add_client_args(chat, "MESSAGE")
    chat.add_argument(
        "--system-prompt", default=None, help="a system message to start the conversation with"
    )
    chat.set_defaults(func=chat_main)
    complete = sub.add_parser(
        "complete",
        help="complete prompts with the model of a running server",
        description="Complete prompts with a running OpenAI-compatible server "
        "(/v1/completions): each stdin line is a prompt; each completion is streamed.",
    )
    add_client_args(complete, "PROMPT")
    complete.add_argument(
        "--max-tokens", type=int, default=None,
        help="tokens per completion (default: the server's, 16 as in OpenAI's API)",
    )  # fmt: skip
    complete.set_defaults(func=complete_main)
