"""`pagedserve bench serve` against the real server process: vLLM's summary table, and a saved
JSON whose counts match the workload."""

import json
from pathlib import Path
from typing import Any

import pytest

from pagedserve.entrypoints.cli import main as cli_main

from .conftest import API_KEY, Server


def run_bench_serve(
    server: Server, argv: list[str], tmp_path: Path, capsys: Any
) -> tuple[str, dict[str, Any]]:
    save = ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    target = ["--base-url", server.url, "--api-key", API_KEY]
    assert cli_main(["bench", "serve", *target, *argv, *save]) == 0
    return capsys.readouterr().out, json.loads((tmp_path / "r.json").read_text())


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
    assert "mean_e2el_ms" not in result  # only the default ttft,tpot,itl
