"""`pagedserve bench throughput` and `bench latency` on the bundled stories260k: the printed
metrics and the saved JSON."""

import json
from pathlib import Path
from typing import Any

import pytest

from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.llm_engine import load_tokenizer
from pagedserve.entrypoints.cli import main as cli_main

ENGINE = ["--device", "cpu", "--max-model-len", "128", "--kv-cache-memory-bytes", "8MiB"]


def run_bench(argv: list[str], tmp_path: Path, capsys: Any) -> tuple[str, dict[str, Any]]:
    """Run `pagedserve bench ...` with --save-result into tmp_path: (stdout, the JSON)."""
    save = ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    assert cli_main(["bench", *argv, *ENGINE, *save]) == 0
    return capsys.readouterr().out, json.loads((tmp_path / "r.json").read_text())


def test_throughput_on_random_prompts(tmp_path: Path, capsys: Any) -> None:
    out, result = run_bench(
        ["throughput", "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "5"],
        tmp_path,
        capsys,
    )
    assert "Throughput: " in out and "requests/s" in out and "output tokens/s" in out
    assert "total tokens/s" in out and "Total num output tokens:  15" in out
    assert result["num_requests"] == 3
    assert result["total_prompt_tokens"] == 24 and result["total_output_tokens"] == 15
    assert result["total_num_tokens"] == 39 and result["elapsed_time"] > 0
    elapsed = result["elapsed_time"]
    assert result["requests_per_second"] == pytest.approx(3 / elapsed)
    assert result["tokens_per_second"] == pytest.approx(39 / elapsed)
    assert result["output_tokens_per_second"] == pytest.approx(15 / elapsed)
    assert result["model_id"] == DEFAULT_MODEL


def test_throughput_roofline_and_plot(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With device peaks (set by the environment: a CPU has none) the run reports its MBU and
    MFU and --plot draws its steps; without them it says so."""
    argv = ["throughput", "--num-prompts", "3", "--random-input-len", "8",
            "--random-output-len", "5"]  # fmt: skip
    out, result = run_bench(argv, tmp_path, capsys)
    assert "Roofline: " in out and "MBU / MFU: no device peaks known" in out
    assert result["mbu"] is None and result["mfu"] is None and result["num_steps"] >= 5
    monkeypatch.setenv("PAGEDSERVE_PEAK_BANDWIDTH", "1e9")
    monkeypatch.setenv("PAGEDSERVE_PEAK_FLOPS", "1e9")
    plot = tmp_path / "steps.png"
    out, result = run_bench([*argv, "--plot", str(plot)], tmp_path, capsys)
    assert result["mbu"] > 0 and result["mfu"] > 0
    assert f"MBU: {100 * result['mbu']:.1f}%" in out and f"plot saved to {plot}" in out
    # 3 prompts of 8 tokens, then 4 more tokens each: at most 24 + 12 tokens in >= 5 steps
    assert 5 <= result["num_steps"] <= 24 + 12
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("plot", "env", "words"),
    [
        ("{tmp}", "", "--plot {tmp}: is a folder"),
        ("{tmp}/steps.pnj", "", "matplotlib cannot write '.pnj' files"),
        (None, "junk", "PAGEDSERVE_PEAK_BANDWIDTH must be a positive number, got 'junk'"),
    ],
)
def test_throughput_refuses_a_bad_plot_or_peak_before_the_run(
    plot: str | None,
    env: str,
    words: str,
    tmp_path: Path,
    capsys: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the summary and --plot need after the run is checked before it: one line, and
    no run thrown away (a traceback after it, the result unsaved, before)."""
    monkeypatch.setenv("PAGEDSERVE_PEAK_BANDWIDTH", env)
    argv = ["bench", "throughput", "--num-prompts", "1", "--random-input-len", "4",
            "--random-output-len", "2", *ENGINE]  # fmt: skip
    if plot is not None:
        argv += ["--plot", plot.format(tmp=tmp_path)]
    with pytest.raises(SystemExit, match="pagedserve bench throughput: error: ") as exit_info:
        cli_main(argv)
    assert words.format(tmp=tmp_path) in str(exit_info.value)
    assert "Throughput:" not in capsys.readouterr().out


def test_throughput_on_a_sharegpt_file(tmp_path: Path, capsys: Any) -> None:
    prompts = ["Once upon a time there was a little dog.", "The girl saw a big red ball."]
    data = [
        {"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": p.upper()}]}
        for p in prompts
    ]
    (tmp_path / "chats.json").write_text(json.dumps(data))
    dataset = ["--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "chats.json")]
    out, result = run_bench(
        ["throughput", *dataset, "--num-prompts", "2", "--sharegpt-output-len", "4"],
        tmp_path,
        capsys,
    )
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    assert result["num_requests"] == 2 and result["total_output_tokens"] == 8
    assert result["total_prompt_tokens"] == sum(len(tokenizer(p).input_ids) for p in prompts)
    assert "Total num output tokens:  8" in out


def test_latency(tmp_path: Path, capsys: Any) -> None:
    flags = ["--input-len", "8", "--output-len", "4", "--batch-size", "2"]
    iterations = ["--num-iters-warmup", "1", "--num-iters", "3"]
    out, result = run_bench(["latency", *flags, *iterations], tmp_path, capsys)
    assert "Avg latency: " in out
    for p in (10, 25, 50, 75, 90, 99):
        assert f"{p}% percentile latency: " in out
    latencies = result["latencies"]
    assert len(latencies) == 3 and all(t > 0 for t in latencies)
    assert result["avg_latency"] == pytest.approx(sum(latencies) / 3)
    percentiles = [result["percentiles"][str(p)] for p in (10, 25, 50, 75, 90, 99)]
    assert percentiles == sorted(percentiles)
    assert min(latencies) <= percentiles[0] and percentiles[-1] <= max(latencies)
    assert result["percentiles"]["50"] == pytest.approx(sorted(latencies)[1])


def test_latency_rejects_an_empty_batch(capsys: Any) -> None:
    with pytest.raises(SystemExit, match="--batch-size must be positive"):
        cli_main(["bench", "latency", "--batch-size", "0", *ENGINE])


def test_an_unknown_flag_names_the_bench_subcommand(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "serve", "--bogus"])
    assert exit_info.value.code == 2
    assert (
        "pagedserve bench serve: error: unrecognized arguments: --bogus" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["throughput", "--num-prompts", "-3"], "--num-prompts must be at least 1"),
        (["throughput", "--num-prompts", "0"], "--num-prompts must be at least 1"),
        (["throughput", "--random-prefix-len", "-2"], "--random-prefix-len must be at least 0"),
        (["throughput", "--random-input-len", "0"], "--random-input-len + --random-prefix-len"),
        (["throughput", "--num-prompts", "2", "--input-len", "4", "--n", "0"], "n must be"),
        (["throughput", "--num-prompts", "2", "--input-len", "200"], "too long"),
        (["latency", "--input-len", "200", "--num-iters-warmup", "0"], "too long"),
        (["latency", "--n", "0", "--num-iters-warmup", "0"], "n must be"),
    ],
)
def test_bad_counts_are_one_line(argv: list[str], words: str) -> None:
    """They were tracebacks (numpy's ValueError, the engine's InvalidRequestError), or a
    benchmark of no request."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", *argv, *ENGINE])
    message = str(exit_info.value.code)
    assert message.startswith(f"pagedserve bench {argv[0]}: error: ") and words in message
