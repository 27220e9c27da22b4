"""A server on a SentencePiece tokenizer (BOS added by encode) with --chat-template FILE; then
its engine core is killed: every pending request fails promptly, then the server exits (status
1) so that a supervisor restarts it. With --keep-alive-on-engine-death it stays up instead and
every new request, /health included, gets a 503."""

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import transformers

# The template writes the BOS itself, as Llama's do: encoding its text with the tokenizer's
# defaults would add a second one.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
MESSAGES = [{"role": "user", "content": "Bonjour 你好 🌍"}]
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def doomed(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    running = server_factory("sentencepiece-32k", None, ["--chat-template", str(template)])
    try:
        yield running
    finally:
        running.stop()


def engine_core_pid(server_pid: int) -> int:
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    raise AssertionError(f"no engine core among the children {children} of {server_pid}")


def socket_folders(pid: int) -> set[Path]:
    """The pagedserve-* folders of the Unix sockets that process `pid` has open (its fds'
    socket inodes looked up in /proc/net/unix): this server's, not those of other servers
    that tests running at the same time start."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    folders = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and "/pagedserve-" in fields[7]:
            folders.add(Path(fields[7]).parent)
    return folders


def test_chat_template_file_and_a_single_bos(doomed: Any) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(doomed.model)
    assert tokenizer.encode("x")[0] == tokenizer.bos_token_id  # encode adds a BOS here
    expected = tokenizer.apply_chat_template(
        MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert expected.count(tokenizer.bos_token_id) == 1
    assert doomed.tokenize(messages=MESSAGES) == expected
    result = doomed.client().chat.completions.create(
        model=doomed.model, messages=MESSAGES, max_tokens=2, temperature=0.0
    )
    assert result.usage.prompt_tokens == len(expected)


def test_streamed_equals_non_streamed_with_byte_fallback(doomed: Any) -> None:
    client = doomed.client()
    args = dict(
        model=doomed.model, prompt="Füße 你好 🎉", max_tokens=20, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    full = client.completions.create(**args).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
    assert streamed == full


def kill_engine_core(running: Any) -> float:
    os.kill(engine_core_pid(running.process.pid), signal.SIGKILL)
    return time.monotonic()


def test_killed_engine_core_fails_everything_promptly_then_the_server_exits(
    doomed: Any, sse: Any
) -> None:
    pending: dict[str, Any] = {}

    def wait_whole_response() -> None:
        pending["response"] = doomed.post("/v1/completions", {"prompt": "Once", **LONG})
        pending["time"] = time.monotonic()

    waiter = threading.Thread(target=wait_whole_response, daemon=True)
    waiter.start()
    body = {"prompt": "Once upon a time", "stream": True, **LONG}
    with httpx.stream("POST", f"{doomed.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # generating
        killed = kill_engine_core(doomed)
        rest = [line for line in lines if line]  # the stream ends by itself
        stream_ended = time.monotonic()
    events = sse("".join(f"{line}\n\n" for line in rest))
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 503 and "engine core" in error["message"]
    assert stream_ended - killed < 5.0
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert pending["response"].status_code == 503, pending["response"].text
    assert pending["time"] - killed < 5.0
    # It answered 503 forever: a supervisor (systemd, Kubernetes) could not tell it to restart.
    assert doomed.process.wait(timeout=30) == 1, doomed.log()
    log = doomed.log()
    assert "the engine core died" in log and "--keep-alive-on-engine-death" in log, log


def test_keep_alive_on_engine_death_answers_503(server_factory: Any) -> None:
    running = server_factory("llama3", None, ["--keep-alive-on-engine-death"])
    try:
        kill_engine_core(running)
        deadline = time.monotonic() + 10
        while httpx.get(f"{running.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health never said 503"
            time.sleep(0.05)
        new = running.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, timeout=5)
        assert new.status_code == 503 and new.json()["error"]["code"] == 503
        chat = running.post("/v1/chat/completions", {"messages": MESSAGES, "stream": True})
        assert chat.status_code == 503
        time.sleep(1.0)  # several polls of the engine's health: the server stays up
        assert running.process.poll() is None
        assert running.get("/health").status_code == 503
    finally:
        running.stop()


def assert_clean_stop(running: Any, stop_signal: signal.Signals, group: bool = True) -> None:
    """`stop_signal` to the server's process group (or, `group` False, to the server process
    alone): the server exits 0, its engine core is gone, and the log holds no error (the
    caller stops the server if this fails)."""
    core = engine_core_pid(running.process.pid)
    ok = running.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    (os.killpg if group else os.kill)(running.process.pid, stop_signal)
    assert running.process.wait(timeout=30) == 0, running.log()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{core}").exists()
    log = running.log_path.read_text()
    for bad in ("engine failed", "ERROR", "Traceback", "died"):
        assert bad not in log, log[-3000:]


def test_a_stop_signal_to_the_process_group_is_a_clean_stop(server_factory: Any) -> None:
    """timeout(1), systemd and a terminal's Ctrl-C signal the whole group. The engine core
    once died of the SIGTERM before the server stopped it (the server logged "engine failed"
    for a normal stop); then a normal stop was reported as an engine death (exit status 1,
    which a supervisor restarts); Ctrl-C printed tracebacks. A stop exits 0, quietly. SIGTERM
    here; SIGINT ends the async-scheduling server (test_async_scheduling_server.py)."""
    running = server_factory("llama3")
    try:
        assert_clean_stop(running, signal.SIGTERM)
    finally:
        running.stop()


def test_sigterm_to_the_server_process_alone_stops_the_core_and_removes_its_sockets(
    server_factory: Any,
) -> None:
    """A supervisor that signals only the server's pid (Kubernetes, `kill PID`): the server
    stops its engine core before it exits, and the core's socket folder goes with it."""
    running = server_factory("llama3")
    try:
        sockets = socket_folders(engine_core_pid(running.process.pid))
        assert sockets, "the engine core's socket folder was not found"
        assert_clean_stop(running, signal.SIGTERM, group=False)
        assert not any(folder.exists() for folder in sockets)
    finally:
        running.stop()
