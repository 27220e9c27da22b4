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


def test_bench_serve_concurrency_sweep_and_plot(
    server: Server, tmp_path: Path, capsys: Any
) -> None:
    """--max-concurrency 1,3: two runs of the same requests, a summary and a saved JSON each,
    and --plot draws them."""
    plot = tmp_path / "sweep.png"
    argv = ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY,
            "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4",
            "--ignore-eos", "--max-concurrency", "1,3", "--plot", str(plot),
            "--save-result", "--result-dir", str(tmp_path)]  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2 and f"plot saved to {plot}" in out
    saved = sorted(tmp_path.glob("openai-infqps-concurrency*.json"))
    results = [json.loads(path.read_text()) for path in saved]
    assert sorted(r["max_concurrency"] for r in results) == [1, 3]
    for result in results:
        assert result["completed"] == 3 and result["total_output_tokens"] == 12
        assert result["max_concurrent_requests"] <= result["max_concurrency"]
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-concurrency", "0"], "argument --max-concurrency: '0' is not a positive integer"),
        (["--max-concurrency", "2,x"], "argument --max-concurrency: 'x' is not a positive integer"),
    ],
)
def test_bench_serve_bad_concurrency(argv: list[str], words: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "serve", *argv])
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_bench_serve_sweep_refuses_one_result_filename() -> None:
    argv = ["--max-concurrency", "1,2", "--save-result", "--result-filename", "r.json"]
    with pytest.raises(SystemExit, match="--result-filename names one file"):
        cli_main(["bench", "serve", *argv])


def test_bench_serve_plot_of_failed_runs_is_one_line(
    server: Server, tmp_path: Path, capsys: Any
) -> None:
    """Every request refused (prompts longer than the server's context): the runs' results are
    saved, and --plot, which has no point to draw, ends with one line, not a traceback."""
    argv = ["bench", "serve", "--base-url", server.url, "--api-key", API_KEY,
            "--num-prompts", "2", "--random-input-len", "2000", "--random-output-len", "2",
            "--max-concurrency", "1,2", "--plot", str(tmp_path / "sweep.png"),
            "--save-result", "--result-dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit, match="error: --plot: no request completed in any run"):
        cli_main(argv)
    assert capsys.readouterr().out.count("Serving Benchmark Result") == 2
    assert len(list(tmp_path.glob("openai-infqps-concurrency*.json"))) == 2
    assert not (tmp_path / "sweep.png").exists()
