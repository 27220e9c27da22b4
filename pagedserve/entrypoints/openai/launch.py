"""What `pagedserve serve` does around the app: bind the port first, read --chat-template,
and turn SIGINT/SIGTERM into a normal end of serving."""

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

# How long a stop (SIGTERM/SIGINT) lets running requests finish before they are ended with
# a 503 (an error event, for a stream); uvicorn's own limit is later, as a backstop.
DRAIN_S = 5.0


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the port before loading the model, so that a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(True)
    return sock


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file, or the template itself (as vLLM: text with no Jinja
    delimiters that names no file is a mistyped path, not a template). The template must
    compile. Raises ValueError naming the flag."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            value = f.read()
    elif not any(mark in value for mark in ("{{", "{%", "{#")):
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    import jinja2

    try:
        # transformers' own environment: its templates may use {% break %} (loop controls)
        # and {% generation %}, which a plain jinja2 Environment rejects.
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: skip the check, apply_chat_template runs
        return value
    try:
        _compile_jinja_template(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not compile: {e} (line {e.lineno})") from None
    return value


@contextlib.contextmanager
def stop_signals_end_serving(server: Any) -> Iterator[None]:
    """SIGINT and SIGTERM end `server.serve()` normally, so that the engine is shut down and
    the process exits 0 without a traceback. uvicorn handles both while it serves, then
    raises the signal again for the handler it found: here one that only asks the server to
    exit (it also covers a signal that comes before uvicorn installs its own)."""

    def stop(signum: int, frame: Any) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose shutdown gives running responses `drain_s` seconds, then calls
    `end_running` (which fails the requests still running, so that each handler answers, a
    stream with an error event and [DONE]). Without it uvicorn cancels those handlers: the
    client's stream stops mid-body and the log gets a CancelledError traceback."""

    def __init__(
        self, config: uvicorn.Config, end_running: Callable[[], None], drain_s: float = DRAIN_S
    ) -> None:
        config.timeout_graceful_shutdown = int(drain_s) + 5  # the backstop
        super().__init__(config)
        self.end_running = end_running
        self.drain_s = drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        async def end_after_drain() -> None:
            await asyncio.sleep(self.drain_s)
            self.end_running()

        deadline = asyncio.create_task(end_after_drain())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
