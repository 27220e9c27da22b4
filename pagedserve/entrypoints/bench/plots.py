"""`--plot` of `pagedserve bench`: matplotlib PNGs of a run.

- `plot_steps`: each engine step's time against its roofline floor (`bench throughput`), the
  floor being max(bytes / peak bandwidth, FLOPs / peak FLOP/s) of what the step ran
  (`roofline.step_cost`), with the MBU and MFU of every step below it.
- `plot_sweep`: output throughput against latency over a concurrency sweep (`bench serve
  --max-concurrency 1,4,16,...`), one panel per latency metric, each point labelled with its
  concurrency: the throughput-latency curve of a server.

matplotlib is an optional dependency (the `bench` extra); without it `--plot` fails with one
line saying how to install it.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedserve.roofline import Peaks, StepRecord, run_summary, utilization

INSTALL_HINT = "--plot needs matplotlib: pip install 'pagedserve[bench]' (or matplotlib)"


def check_matplotlib() -> None:
    """Raise ImportError with `INSTALL_HINT` when matplotlib cannot be imported (called
    before a run, so a missing library does not cost the run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None


def _pyplot() -> Any:
    check_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_path(path: str) -> Path:
    """--plot's file, checked before the benchmark runs (so that a typo does not cost the
    run): `path`, with ".png" added when it has no suffix (matplotlib adds it unasked, and the
    command would name a file it did not write). Raises ImportError without matplotlib (with
    `INSTALL_HINT`), ValueError for a folder or a suffix matplotlib cannot write."""
    check_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    file = Path(path)
    if file.is_dir():
        raise ValueError(f"--plot {path}: is a folder; name the PNG to write")
    if not file.suffix:
        return file.with_name(file.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if file.suffix[1:].lower() not in formats:
        raise ValueError(
            f"--plot {path}: matplotlib cannot write {file.suffix!r} files "
            f"(it writes {', '.join('.' + f for f in sorted(formats))})"
        )
    return file


def _save(fig: Any, path: str | Path) -> None:
    """Write `fig` to `path`, making its folder as --result-dir does. Raises OSError."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def step_floors(records: Sequence[StepRecord], peaks: Peaks) -> list[float | None]:
    """Each step's roofline floor in seconds: max(step_bytes / bandwidth, step_flops / flops)
    over the peaks that are known; None for a step without a forward or without any peak."""
    floors: list[float | None] = []
    for r in records:
        bounds = []
        if peaks.bandwidth:
            bounds.append(r.step_bytes / peaks.bandwidth)
        if peaks.flops:
            bounds.append(r.step_flops / peaks.flops)
        floors.append(max(bounds) if bounds and r.num_tokens > 0 else None)
    return floors


def plot_steps(
    records: Sequence[StepRecord], peaks: Peaks, path: str | Path, title: str
) -> dict[str, Any]:
    """Draw the steps that ran a forward into the PNG `path`: top, step time (ms) against the
    step's tokens, measured and its roofline floor (log-log); bottom, each step's MBU and MFU
    (%) in run order. Without peaks (a CPU, an unlisted GPU: see `roofline.device_peaks`) only
    the measured times are drawn. Returns the run's summary: num_steps, the steps' seconds,
    and MBU / MFU (None where unknown). Raises ValueError when no step ran a forward."""
    plt = _pyplot()
    steps = [r for r in records if r.num_tokens > 0 and r.seconds > 0]
    if not steps:
        raise ValueError("no engine step ran a forward: nothing to plot")
    floors = step_floors(steps, peaks)
    mbu, mfu = utilization(steps, peaks)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), height_ratios=[3, 2])
    tokens = [r.num_tokens for r in steps]
    top.scatter(tokens, [r.seconds * 1e3 for r in steps], s=8, alpha=0.5, label="measured step")
    if any(f is not None for f in floors):
        known = [(n, f * 1e3) for n, f in zip(tokens, floors, strict=True) if f is not None]
        top.scatter(*zip(*known, strict=True), s=8, marker="x", color="black",
                    label="roofline floor: max(bytes/BW, FLOPs/peak)")  # fmt: skip
    top.set(xscale="log", yscale="log", xlabel="tokens in the step", ylabel="step time (ms)")
    top.grid(True, which="both", alpha=0.3)
    top.legend(loc="upper left")
    figures = [("MBU", mbu, peaks.bandwidth, "step_bytes"), ("MFU", mfu, peaks.flops, "step_flops")]
    for name, whole, peak, key in figures:
        if peak:
            shares = [100 * getattr(r, key) / r.seconds / peak for r in steps]
            bottom.plot(shares, lw=0.8, label=f"{name} (run: {100 * (whole or 0):.1f}%)")
    bottom.set(xlabel="step (forwards, in run order)", ylabel="% of peak")
    bottom.grid(True, alpha=0.3)
    if peaks.bandwidth or peaks.flops:
        bottom.legend(loc="upper right")
    else:
        bottom.text(0.5, 0.5, "no device peaks known (a CPU): no MBU / MFU", ha="center",
                    transform=bottom.transAxes)  # fmt: skip
    fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return run_summary(steps, peaks)


def plot_sweep(
    results: Sequence[dict[str, Any]], metrics: Sequence[str], path: str | Path, title: str
) -> None:
    """Draw `bench serve` results (one per concurrency, in sweep order) into the PNG `path`:
    for each latency metric of `metrics` (keys of `serve_metrics.METRICS` whose medians the
    results hold), output throughput (tok/s) against its median (ms), each point labelled with
    its max_concurrency. Runs with no completed request are left out. Raises ValueError when
    no request completed or no result holds any of those medians."""
    plt = _pyplot()
    results = [r for r in results if r.get("completed", 1)]
    if not results:
        raise ValueError("no request completed in any run: nothing to plot")
    keys = [k for k in metrics if all(f"median_{k}_ms" in r for r in results)]
    if not keys:
        raise ValueError(f"no result holds the median of any of {', '.join(metrics)}")
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4.5), squeeze=False)
    throughput = [r["output_throughput"] for r in results]
    for axis, key in zip(axes[0], keys, strict=True):
        latency = [r[f"median_{key}_ms"] for r in results]
        axis.plot(latency, throughput, marker="o")
        for x, y, r in zip(latency, throughput, results, strict=True):
            label = r.get("max_concurrency") or "all"
            axis.annotate(str(label), (x, y), textcoords="offset points", xytext=(4, 4))
        axis.set(xlabel=f"median {key.upper()} (ms)", ylabel="output throughput (tok/s)")
        axis.grid(True, alpha=0.3)
    fig.suptitle(f"{title} (points: max concurrency)")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
