"""A dead or stuck worker fails the engine within seconds, and no worker outlives its engine.

Every wait is bounded; the model is the real stories260k (context 512) at tp_size 2.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.errors import EngineDeadError

from ._helpers import SHARED_MODELS, descendants, wait_gone

MODEL = SHARED_MODELS / "stories260k"
REPO = Path(__file__).resolve().parents[2]
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)  # seconds of steps
FAIL_WITHIN_S = 10.0  # the issue asks for "within seconds"; detection itself takes < 1 s


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP])
def test_dead_or_stuck_worker_fails_generation(signum: signal.Signals) -> None:
    """SIGKILL: the engine sees the worker's exit at once. SIGSTOP: rank 0 waits in an
    all-reduce that never completes; the collective and reply timeouts (3 s here) end it."""
    llm = LLM(
        str(MODEL),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=2,
        num_gpu_blocks_override=256,
        distributed_timeout_s=3.0,
    )
    pids = llm.llm_engine.engine_core.executor.worker_pids
    signalled_at: list[float] = []

    def signal_rank_1() -> None:
        time.sleep(0.5)  # generation runs for seconds: this lands mid-step or between steps
        os.kill(pids[1], signum)
        signalled_at.append(time.monotonic())

    thread = threading.Thread(target=signal_rank_1)
    thread.start()
    try:
        with pytest.raises(EngineDeadError, match="rank") as info:
            llm.generate(["Once upon a time"] * 8, LONG, use_tqdm=False)
        failed_after = time.monotonic() - signalled_at[0]
    finally:
        thread.join()
    expected = "killed by SIGKILL" if signum == signal.SIGKILL else "3 s|timed out|Timed out"
    assert any(part in str(info.value) for part in expected.split("|")), str(info.value)
    assert failed_after < FAIL_WITHIN_S
    assert wait_gone(pids, timeout_s=2.0) == []  # every rank is killed with the engine
    with pytest.raises(EngineDeadError):  # and it stays dead
        llm.generate(["Once upon a time"], LONG, use_tqdm=False)
    llm.shutdown()


def test_workers_exit_when_the_engine_process_is_killed() -> None:
    """No orphans: workers notice within a second that their parent is gone."""
    script = (
        "from pagedserve import LLM\n"
        f"llm = LLM({str(MODEL)!r}, device='cpu', tensor_parallel_size=2, "
        "num_gpu_blocks_override=64)\n"
        "print(*llm.llm_engine.engine_core.executor.worker_pids, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    engine = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(pid) for pid in _read_line(engine, timeout_s=120).split()]
        assert len(pids) == 2 and wait_gone(pids, timeout_s=0) == pids
    finally:
        engine.kill()
        engine.wait(timeout=30)
    assert wait_gone(pids, timeout_s=5.0) == []


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_server_worker_death_and_shutdown(stop_signal: signal.Signals, tmp_path: Path) -> None:
    """The server at tp_size 2: (SIGTERM case) killing a worker mid-stream ends the stream
    with an error event and turns /health to 503 within seconds; either way, stopping the
    server with SIGTERM/SIGINT leaves no engine-core or worker process behind."""
    server = _start_server(tmp_path)
    try:
        tree = descendants(server.process.pid)  # the engine core and its 2 workers
        assert len(tree) >= 3, tree
        if stop_signal == signal.SIGTERM:
            _kill_worker_mid_stream(server, tree)
        os.kill(server.process.pid, stop_signal)
        assert server.process.wait(timeout=30) is not None
        assert wait_gone(tree, timeout_s=5.0) == []
    finally:
        server.stop()


class _Server:
    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.process, self.url, self.log = process, url, log

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def _start_server(tmp_path: Path) -> _Server:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "pagedserve.entrypoints.openai.api_server",
        "--model",
        str(MODEL),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--tensor-parallel-size",
        "2",
        "--num-gpu-blocks-override",
        "256",
        "--uvicorn-log-level",
        "warning",
        "--disable-log-stats",
        # This test reads /health after a worker dies; exiting then is test_engine_death's.
        "--keep-alive-on-engine-death",
    ]
    log = tmp_path / "server.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = _Server(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.2)
    server.stop()
    pytest.fail(f"the server did not become healthy:\n{log.read_text()[-5000:]}")


def _kill_worker_mid_stream(server: _Server, tree: list[int]) -> None:
    body = {
        "model": str(MODEL),
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        os.kill(_workers_in(tree)[0], signal.SIGKILL)
        killed_at = time.monotonic()
        events += [line for line in lines if line.startswith("data: ")]
    errors = [json.loads(e[6:]) for e in events if e != "data: [DONE]" and "error" in e[6:]]
    assert errors and errors[-1]["error"]["code"] == 503, events[-3:]
    while (status := httpx.get(f"{server.url}/health", timeout=5).status_code) != 503:
        assert time.monotonic() - killed_at < FAIL_WITHIN_S, status
        time.sleep(0.1)


def _workers_in(tree: list[int]) -> list[int]:
    """The worker processes among `tree`: on CPU, the engine core's forkserver forks them, and
    fork keeps the forkserver's command line; the forkserver is their parent."""
    forked = []
    for pid in tree:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"multiprocessing.forkserver" in f.read():
                forked.append(pid)
    workers = [pid for pid in forked if not descendants(pid)]  # the forkserver has children
    assert len(workers) == 2, (forked, workers)
    return workers


def _read_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    """The next stdout line of `process`, failing the test after `timeout_s`."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()))  # type: ignore[union-attr]
    reader.daemon = True
    reader.start()
    reader.join(timeout_s)
    if not lines or not lines[0]:
        pytest.fail(
            f"no line from the engine process within {timeout_s} s (exit code {process.poll()})"
        )
    return lines[0]
