"""`pagedserve chat` and `pagedserve complete` against a running server (the real process, and
a recording stand-in that shows what each request carried)."""

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from .conftest import API_KEY, free_port

REPO = Path(__file__).resolve().parents[3]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OPENAI_API_KEY="")


def pagedserve(
    *args: str, stdin: str = "", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run `pagedserve ARGS` with `stdin`; its status and output."""
    command = [sys.executable, "-m", "pagedserve.entrypoints.cli", *args]
    return subprocess.run(
        command, input=stdin, capture_output=True, text=True, env=ENV, timeout=timeout
    )


class Recorder(BaseHTTPRequestHandler):
    """An OpenAI-like server that records each POST body and streams "reply-N" back."""

    bodies: list[dict[str, Any]] = []

    def do_GET(self) -> None:  # /v1/models
        self._send_json({"object": "list", "data": [{"id": "recorded", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        reply = f"reply-{len(self.bodies)}"
        if self.path.endswith("/chat/completions"):
            kind, choices = (
                "chat.completion.chunk",
                [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}},
                    {"index": 0, "delta": {"content": reply[:3]}},
                    {"index": 0, "delta": {"content": reply[3:]}, "finish_reason": "stop"},
                ],
            )
        else:
            kind, choices = "text_completion", [{"index": 0, "text": reply, "finish_reason": None}]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for choice in choices:
            chunk = {"id": "x", "object": kind, "created": 0, "model": "recorded"}
            self.wfile.write(f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _send_json(self, value: Any) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The stand-in's base URL and the bodies it has received."""
    bodies: list[dict[str, Any]] = []
    handler = type("Handler", (Recorder,), {"bodies": bodies})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", bodies
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def greedy_server(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server whose defaults (its generation config) are greedy and 12 tokens: the
    clients send neither, so their replies can be compared with the server's own."""
    folder = tmp_path_factory.mktemp("greedy-generation-config")
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 12})
    )
    running = server_factory("llama3", API_KEY, ["--generation-config", str(folder)])
    try:
        yield running
    finally:
        running.stop()


def chat_reply(server: Any, messages: list[dict[str, str]]) -> str:
    """The server's (non-streamed) reply to `messages`."""
    reply = server.client().chat.completions.create(model=server.model, messages=messages)
    content: str = reply.choices[0].message.content
    assert content  # a reply worth comparing
    return content


def test_chat_quick_against_the_server(greedy_server: Any) -> None:
    server = greedy_server
    url = f"{server.url}/v1"
    done = pagedserve("chat", "--url", url, "--api-key", API_KEY, "-q", "Hello there")
    assert done.returncode == 0, done.stderr
    expected = chat_reply(server, [{"role": "user", "content": "Hello there"}])
    # The first model of /v1/models, then the streamed reply; no prompt, no log lines.
    assert done.stdout == f"Using model: {server.model}\n{expected}\n"
    assert done.stderr == ""


def test_complete_quick_against_the_server(greedy_server: Any) -> None:
    server = greedy_server
    flags = ["--url", f"{server.url}/v1", "--api-key", API_KEY, "--model-name", server.model]
    done = pagedserve("complete", *flags, "--max-tokens", "4", "--quick", "The sky is")
    assert done.returncode == 0, done.stderr
    reply = server.client().completions.create(
        model=server.model, prompt="The sky is", max_tokens=4
    )
    assert reply.usage.completion_tokens == 4
    assert done.stdout == f"Using model: {server.model}\n{reply.choices[0].text}\n"


def test_interactive_chat_against_the_server(greedy_server: Any) -> None:
    server = greedy_server
    url = f"{server.url}/v1"
    done = pagedserve("chat", "--url", url, "--api-key", API_KEY, stdin="Hi\nAnd then?\n")
    assert done.returncode == 0, done.stderr
    first_turn = [{"role": "user", "content": "Hi"}]
    first = chat_reply(server, first_turn)
    # The second reply is the server's answer to the whole conversation.
    second = chat_reply(
        server,
        [
            *first_turn,
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert first != second
    assert done.stdout == (
        f"Using model: {server.model}\nPlease enter a message for the chat model:\n"
        f"> {first}\n> {second}\n> \n"  # the third prompt met EOF
    )
    assert "Traceback" not in done.stderr


def test_interactive_chat_keeps_the_conversation(recorder: Any) -> None:
    url, bodies = recorder
    flags = ["--url", url, "--system-prompt", "Be brief."]
    done = pagedserve("chat", *flags, stdin="first\nsecond\n")
    assert done.returncode == 0, done.stderr
    assert "Using model: recorded" in done.stdout
    assert "> reply-1\n" in done.stdout and "> reply-2\n" in done.stdout  # streamed, in full
    assert [body["model"] for body in bodies] == ["recorded", "recorded"]
    assert all(body["stream"] for body in bodies)
    system = {"role": "system", "content": "Be brief."}
    assert bodies[0]["messages"] == [system, {"role": "user", "content": "first"}]
    assert bodies[1]["messages"] == [
        system,
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply-1"},
        {"role": "user", "content": "second"},
    ]


def test_interactive_complete_sends_each_line(recorder: Any) -> None:
    url, bodies = recorder
    done = pagedserve("complete", "--url", url, "--max-tokens", "7", stdin="one\ntwo\n")
    assert done.returncode == 0, done.stderr
    assert [(b["prompt"], b["max_tokens"]) for b in bodies] == [("one", 7), ("two", 7)]
    assert "> reply-1\n" in done.stdout and "> reply-2\n" in done.stdout
    # Without --max-tokens the field is left out (the server's 16, as its --help says): a
    # null was sent, which the server reads as "up to the context length".
    bodies.clear()
    done = pagedserve("complete", "--url", url, "-q", "three")
    assert done.returncode == 0, done.stderr
    assert [b["prompt"] for b in bodies] == ["three"] and "max_tokens" not in bodies[0]


def test_a_line_that_is_not_utf8_is_reported_and_the_session_goes_on(recorder: Any) -> None:
    """Undecodable stdin bytes crashed the client (UnicodeEncodeError building the request,
    or UnicodeDecodeError reading the line), ending the session with a traceback."""
    url, bodies = recorder
    command = [sys.executable, "-m", "pagedserve.entrypoints.cli", "complete", "--url", url]
    for locale in ("C.UTF-8", "C"):
        bodies.clear()
        env = dict(ENV, LC_ALL=locale)
        done = subprocess.run(
            command, input=b"one\n\xff\xfe bad\ntwo\n", capture_output=True, env=env,
            timeout=60,
        )  # fmt: skip
        stderr = done.stderr.decode(errors="replace")
        assert done.returncode == 0 and "Traceback" not in stderr, stderr
        assert "error: the text is not valid UTF-8" in stderr
        assert [b["prompt"] for b in bodies] == ["one", "two"]
    quick = [*command, "-q", os.fsdecode(b"\xff")]
    done = subprocess.run(quick, capture_output=True, env=ENV, timeout=60)
    assert done.returncode == 1 and b"not valid UTF-8" in done.stderr, done.stderr


def test_ctrl_c_ends_quietly(recorder: Any) -> None:
    url, _ = recorder
    command = [sys.executable, "-m", "pagedserve.entrypoints.cli", "chat", "--url", url]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=ENV,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("Using model")
        assert process.stdout.readline().startswith("Please enter")  # now waiting at input()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr


def test_errors_are_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    done = pagedserve("chat", "--url", url, "-q", "hi")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert f"cannot reach the server at {url}" in done.stderr


def test_a_refused_request_is_reported(greedy_server: Any) -> None:
    url = f"{greedy_server.url}/v1"
    done = pagedserve("complete", "--url", url, "--model-name", "m", "-q", "x")  # no key
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "the server answered 401" in done.stderr


def test_without_openai_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.entrypoints.cli import main

    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` raises ImportError
    with pytest.raises(SystemExit) as exited:
        main(["chat", "-q", "hi"])
    assert "pip install 'pagedserve[client]'" in str(exited.value.code)
