"""`pagedserve run-batch`: an OpenAI batch file through the server's request handling, in
process; each result is what the real server answers to the same request."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
ENV = dict(os.environ, PYTHONPATH=str(REPO))
# The `server` fixture's engine flags (conftest.Server), so that greedy outputs agree.
ENGINE_FLAGS = [
    "--device", "cpu", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(16 * 2**20),
    "--block-size", "16",
]  # fmt: skip
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def run_batch(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pagedserve.entrypoints.cli", "run-batch", *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)


def line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    """A response body less what differs between two runs of one request."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_results_are_the_servers_answers(server: Any, tmp_path: Path) -> None:
    chat_body = {
        "model": server.model, "messages": [{"role": "user", "content": "Hello"}], **GREEDY,
    }  # fmt: skip
    completion_body = {"model": server.model, "prompt": "Once upon a time", **GREEDY}
    invalid_body = {"model": server.model, "prompt": "x", "temperature": "hot"}
    unknown_model = {"model": "nope", "prompt": "x"}
    lines = [
        line("chat-1", "/v1/chat/completions", chat_body),
        line("cmpl-1", "/v1/completions", completion_body),
        '{"custom_id": "broken", "method": "POST", ',  # not JSON
        "",  # blank lines are skipped, as vLLM's
        line("invalid-1", "/v1/completions", invalid_body),
        line("unknown-model", "/v1/completions", unknown_model),
        line("embed-1", "/v1/embeddings", {"input": "x"}),
        line("stream-1", "/v1/completions", {**completion_body, "stream": True}),
        json.dumps({"custom_id": "get-1", "method": "GET", "url": "/v1/completions", "body": {}}),
    ]
    source, target = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines) + "\n")
    done = run_batch("-i", str(source), "-o", str(target), "--model", server.model, *ENGINE_FLAGS)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(text) for text in target.read_text().splitlines()]
    custom_ids = [result["custom_id"] for result in results]
    expected_ids = ["chat-1", "cmpl-1", None, "invalid-1", "unknown-model"]
    assert custom_ids == [*expected_ids, "embed-1", "stream-1", "get-1"]  # input order
    for result in results:
        assert set(result) == {"id", "custom_id", "response", "error"}
        assert set(result["response"]) == {"status_code", "request_id", "body"}
        assert result["id"] and result["response"]["request_id"]
    assert len({result["id"] for result in results}) == len(results)
    by_id = {result["custom_id"]: result for result in results}

    # Successes: status 200, the server's body, no error.
    for custom_id, path, body in [
        ("chat-1", "/v1/chat/completions", chat_body),
        ("cmpl-1", "/v1/completions", completion_body),
    ]:
        result = by_id[custom_id]
        assert result["error"] is None and result["response"]["status_code"] == 200
        answer = server.post(path, body)
        assert answer.status_code == 200, answer.text
        assert without_ids(result["response"]["body"]) == without_ids(answer.json())
    assert by_id["cmpl-1"]["response"]["body"]["usage"]["completion_tokens"] == 8

    # Requests the server refuses: its status and error body, word for word.
    for custom_id, body in [("invalid-1", invalid_body), ("unknown-model", unknown_model)]:
        result = by_id[custom_id]
        answer = server.post("/v1/completions", body)
        assert answer.status_code in (400, 404)
        assert result["response"]["status_code"] == answer.status_code
        assert result["response"]["body"] is None and result["error"] == answer.json()

    # Lines that are no batch request: a 400 entry each, with OpenAI's error shape.
    for custom_id, param, words in [
        (None, None, "not valid JSON"),
        ("embed-1", "url", "'/v1/embeddings' is not supported"),
        ("stream-1", "body.stream", "must not be sent in stream mode"),
        ("get-1", "method", "method must be POST"),
    ]:
        result = by_id[custom_id]
        assert result["response"] == {**result["response"], "status_code": 400, "body": None}
        error = result["error"]["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError"
        assert error["param"] == param and words in error["message"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["-i", "https://example.com/in.jsonl", "-o", "out.jsonl"], "is a URL"),
        (["-i", "IN", "-o", "s3://bucket/out.jsonl"], "is a URL"),
        (["-i", "/no/such/requests.jsonl", "-o", "out.jsonl"], "is not a file"),
        (["-i", "IN", "-o", "/no/such/folder/out.jsonl"], "does not exist"),
    ],
)
def test_bad_paths_end_with_one_line(tmp_path: Path, flags: list[str], words: str) -> None:
    """Before the model loads (a fraction of a second), with no traceback."""
    source = tmp_path / "in.jsonl"
    source.write_text(line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    flags = [str(source) if flag == "IN" else flag for flag in flags]
    done = run_batch(*flags)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("pagedserve run-batch: error:"), done.stderr
    assert words in done.stderr
