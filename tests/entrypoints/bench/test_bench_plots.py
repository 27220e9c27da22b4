"""`--plot` of `pagedserve bench`: the roofline floors the step plot draws, its summary, the
sweep plot's inputs, and PNGs written (matplotlib, Agg)."""

from pathlib import Path

import pytest

from pagedserve.entrypoints.bench.plots import plot_path, plot_steps, plot_sweep, step_floors
from pagedserve.roofline import Peaks, StepRecord

PNG = b"\x89PNG\r\n\x1a\n"

# A prefill step (compute bound at these peaks), a decode step (memory bound), an idle step.
RECORDS = [
    StepRecord(0.010, 512, 2e9, 8e12),
    StepRecord(0.004, 8, 3e9, 1e11),
    StepRecord(0.001, 0, 0.0, 0.0),
]
PEAKS = Peaks(bandwidth=1e12, flops=1e15)


def test_floors_are_the_slower_of_bandwidth_and_compute() -> None:
    """Prefill: max(2e9 / 1e12, 8e12 / 1e15) = 8 ms; decode: max(3 ms, 0.1 ms) = 3 ms;
    a step without a forward has none; one known peak alone bounds the step."""
    assert step_floors(RECORDS, PEAKS) == [pytest.approx(0.008), pytest.approx(0.003), None]
    assert step_floors(RECORDS, Peaks(bandwidth=1e12)) == [
        pytest.approx(0.002), pytest.approx(0.003), None,
    ]  # fmt: skip
    assert step_floors(RECORDS, Peaks()) == [None, None, None]


def test_step_plot_summary_and_png(tmp_path: Path) -> None:
    """The run's MBU is 5e9 B over 14 ms at 1e12 B/s, its MFU 8.1e12 FLOPs over 14 ms at
    1e15; the idle step is left out of both and of the count."""
    path = tmp_path / "steps.png"
    summary = plot_steps(RECORDS, PEAKS, path, "test run")
    assert summary["num_steps"] == 2
    assert summary["step_seconds"] == pytest.approx(0.014)
    assert summary["mbu"] == pytest.approx(5e9 / 0.014 / 1e12)
    assert summary["mfu"] == pytest.approx(8.1e12 / 0.014 / 1e15)
    assert path.read_bytes().startswith(PNG)
    # Without any peak (a CPU): measured times only, no figures.
    bare = plot_steps(RECORDS, Peaks(), tmp_path / "bare.png", "cpu run")
    assert bare["mbu"] is None and bare["mfu"] is None
    assert (tmp_path / "bare.png").read_bytes().startswith(PNG)


def test_step_plot_without_a_forward_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no engine step ran a forward"):
        plot_steps(RECORDS[2:], PEAKS, tmp_path / "x.png", "idle")
    assert not (tmp_path / "x.png").exists()


def test_sweep_plot(tmp_path: Path) -> None:
    results = [
        {"max_concurrency": c, "output_throughput": 100.0 * c, "median_ttft_ms": 5.0 * c,
         "median_tpot_ms": 2.0 + c}
        for c in (1, 4, 16)
    ]  # fmt: skip
    path = tmp_path / "sweep.png"
    plot_sweep(results, ["ttft", "tpot"], path, "sweep")
    assert path.read_bytes().startswith(PNG)
    with pytest.raises(ValueError, match="no result holds the median of any of e2el"):
        plot_sweep(results, ["e2el"], tmp_path / "none.png", "sweep")
    failed = [dict(r, completed=0) for r in results]
    with pytest.raises(ValueError, match="no request completed in any run"):
        plot_sweep(failed, ["ttft"], tmp_path / "none.png", "sweep")


def test_plot_path_is_checked_before_the_run(tmp_path: Path) -> None:
    """A name without a suffix gets the ".png" matplotlib would add unasked (the command names
    the file it writes); a folder or a format matplotlib lacks is refused."""
    assert plot_path(str(tmp_path / "steps")) == tmp_path / "steps.png"
    assert plot_path(str(tmp_path / "steps.svg")) == tmp_path / "steps.svg"
    with pytest.raises(ValueError, match="is a folder"):
        plot_path(str(tmp_path))
    with pytest.raises(ValueError, match="cannot write '.pnj' files"):
        plot_path(str(tmp_path / "steps.pnj"))


def test_plots_make_their_folder(tmp_path: Path) -> None:
    """As --result-dir: a folder that does not exist yet is made (not a FileNotFoundError
    after the whole run)."""
    path = tmp_path / "new" / "deeper" / "steps.png"
    plot_steps(RECORDS, PEAKS, path, "test run")
    assert path.read_bytes().startswith(PNG)
    results = [{"max_concurrency": 1, "output_throughput": 1.0, "median_ttft_ms": 1.0}]
    plot_sweep(results, ["ttft"], tmp_path / "other" / "sweep.png", "sweep")
    assert (tmp_path / "other" / "sweep.png").read_bytes().startswith(PNG)
