"""`pagedserve bench serve` against benchmarks/mock_openai_server.py (a fast streamed
/v1/completions, our server's chunk format): the counts of a small run, and the errors of
failed requests printed with the summary."""

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.entrypoints.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = REPO / "pagedserve" / "assets" / "stories260k"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=[0, 5], ids=["all-succeed", "every-5th-fails"])
def mock_server(request: Any) -> Iterator[tuple[str, int]]:
    """The mock server in its own process: (base URL, its --fail-every)."""
    port, fail_every = _free_port(), request.param
    command = [sys.executable, "benchmarks/mock_openai_server.py", "--port", str(port),
               "--token-interval-ms", "1", "--fail-every", str(fail_every)]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert "mock OpenAI server" in process.stdout.readline()  # listening
        yield f"http://127.0.0.1:{port}", fail_every
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_bench_serve_against_the_mock(
    mock_server: tuple[str, int], tmp_path: Path, capsys: Any
) -> None:
    url, fail_every = mock_server
    save = ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    argv = ["bench", "serve", "--base-url", url, "--tokenizer", str(TOKENIZER),
            "--num-prompts", "16", "--max-concurrency", "8", "--random-input-len", "12",
            "--random-output-len", "5", "--ignore-eos", "--percentile-metrics", "ttft,itl,e2el",
            *save]  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    failed = 16 // fail_every if fail_every else 0
    assert result["completed"] == 16 - failed and result["failed"] == failed
    assert result["total_input_tokens"] == 12 * (16 - failed)
    assert result["total_output_tokens"] == 5 * (16 - failed)
    assert sorted(result["output_lens"]) == [0] * failed + [5] * (16 - failed)
    assert 1 <= result["max_concurrent_requests"] <= 8
    assert all(
        len(gaps) == 4 for gaps, e in zip(result["itls"], result["errors"], strict=True) if not e
    )
    errors = [e for e in result["errors"] if e]
    assert len(errors) == failed and all("mock failure" in e for e in errors)
    if failed:
        assert f"{failed} failed request(s); errors" in out
        assert f"  {failed}: error event: " in out and "mock failure" in out
    else:
        assert "failed request(s)" not in out
