"""`pagedserve bench serve` against the real server process: vLLM's summary table, and a saved
JSON whose counts match the workload."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedserve.entrypoints.cli import main as cli_main

from .conftest import API_KEY, REPO, Server


def run_bench_serve(
    server: Server, argv: list[str], tmp_path: Path, capsys: Any
) -> tuple[str, dict[str, Any]]:
    save = ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    target = ["--base-url", server.url, "--api-key", API_KEY]
    assert cli_main(["bench", "serve", *target, *argv, *save]) == 0
    text = (tmp_path / "r.json").read_text()
    return capsys.readouterr().out, json.loads(text, parse_constant=reject_non_json)


def reject_non_json(name: str) -> None:
    raise AssertionError(f"the result is not strict JSON: {name}")


def test_bench_serve_random_completions(server: Server, tmp_path: Path, capsys: Any) -> None:
    out, result = run_bench_serve(
        server,
        ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "6",
         "--ignore-eos", "--request-rate", "40", "--burstiness", "0.5", "--max-concurrency", "2",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90"],
        tmp_path,
        capsys,
    )  # fmt: skip
    assert "============ Serving Benchmark Result ============" in out
    for line in ("Successful requests:", "Maximum request concurrency:", "Mean TTFT (ms):",
                 "Median TPOT (ms):", "P90 ITL (ms):", "P50 E2EL (ms):",
                 "Request rate configured (RPS):", "Output token throughput (tok/s):"):  # fmt: skip
        assert line in out
    assert result["completed"] == 4 and result["failed"] == 0 and result["num_prompts"] == 4
    assert result["total_input_tokens"] == 64 and result["total_output_tokens"] == 24
    assert result["output_lens"] == [6] * 4 and result["errors"] == [""] * 4
    assert result["max_concurrency"] == 2 and 1 <= result["max_concurrent_requests"] <= 2
    assert result["model_id"] == server.model and result["endpoint"] == "/v1/completions"
    assert result["output_throughput"] * result["duration"] == pytest.approx(24)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"p50_{key}_ms"] <= result[f"p90_{key}_ms"], key
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert all(len(gaps) <= 5 for gaps in result["itls"])  # at most one gap per later token


def test_bench_serve_sharegpt_chat(server: Server, tmp_path: Path, capsys: Any) -> None:
    data = [
        {"conversations": [{"from": "human", "value": f"Tell me a story about number {i}."},
                           {"from": "gpt", "value": "Once upon a time, a number was happy."}]}
        for i in range(3)
    ]  # fmt: skip
    (tmp_path / "chats.json").write_text(json.dumps(data))
    out, result = run_bench_serve(
        server,
        ["--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt",
         "--dataset-path", str(tmp_path / "chats.json"), "--num-prompts", "3",
         "--sharegpt-output-len", "5", "--ignore-eos"],
        tmp_path,
        capsys,
    )  # fmt: skip
    assert "Mean TTFT (ms):" in out and "P99 ITL (ms):" in out and "E2EL" not in out
    assert result["completed"] == 3 and result["total_output_tokens"] == 15
    assert result["backend"] == "openai-chat" and "p99_tpot_ms" in result
    assert result["request_rate"] == "inf" and result["burstiness"] == 1.0
    assert "mean_e2el_ms" not in result  # only the default ttft,tpot,itl


def test_bench_serve_without_a_tokenizer_is_one_line(server: Server, tmp_path: Path) -> None:
    target = ["--base-url", server.url, "--api-key", API_KEY]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "serve", *target, "--tokenizer", str(tmp_path / "none")])
    message = str(exit_info.value.code)
    assert message.startswith("pagedserve bench serve: error: cannot load the tokenizer")
    assert "--tokenizer FOLDER" in message and "\n" not in message


def test_serving_script_keeps_its_flags(server: Server) -> None:
    """benchmarks/serving.py (word prompts, ignore_eos by default) on bench serve's code."""
    command = [sys.executable, "benchmarks/serving.py", "--base-url", server.url,
               "--api-key", API_KEY, "--num-prompts", "3", "--request-rate", "30",
               "--input-len", "12", "--output-len", "5", "--max-concurrency", "2"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "============ Serving Benchmark Result ============" in done.stdout
    assert "P90 TTFT (ms):" in done.stdout and "P99 E2EL (ms):" in done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["completed"] == 3 and summary["total_output_tokens"] == 15
    assert summary["total_input_tokens"] == 36 and "first_error" not in summary
    assert summary["p90_ttft_ms"] <= summary["p99_ttft_ms"]
