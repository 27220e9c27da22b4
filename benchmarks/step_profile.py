"""Where an engine step's time goes: host time per phase, by step kind, and GPU busy time.

Runs a `throughput.py` workload step by step in one process (uniproc executor) and times each
phase of every step on the host with `perf_counter`, adding no device syncs: the wait for the
GPU shows up in `to_output`, where the sampled ids are copied to the host. Then, for a few
windows of consecutive steps, torch.profiler gives the GPU busy time (union of kernel
intervals) against wall time, and the kernels that take the most time.

  python benchmarks/step_profile.py --preset qwen3-0.6b --dtype bfloat16 --num-prompts 256 \
      --input-len 100:1024 --output-len 100:1024 --max-model-len 2048
"""

import argparse
import functools
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import materialize  # noqa: E402
from benchmarks.throughput import add_workload_args, make_requests  # noqa: E402

PHASES = ("schedule", "states", "inputs", "forward", "sample_meta", "sample", "to_output",
          "update", "output")  # fmt: skip


class StepClock:
    """Host seconds per phase of the current step."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.phases[name] += time.perf_counter() - start

        return timed


def instrument(llm: Any, clock: StepClock, shapes: list[tuple[int, int, int]]) -> None:
    """Wrap the engine's phases with `clock`; `shapes` gets (num_reqs, num_tokens,
    max_query_len) of every scheduled step."""
    import pagedserve.worker.model_runner as model_runner_module

    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.worker.runner  # UniprocExecutor (tensor_parallel_size 1)
    schedule = core.scheduler.schedule

    def schedule_and_record() -> Any:
        out = schedule()
        if out.scheduled_requests:
            lens = [r.num_new_tokens for r in out.scheduled_requests]
            shapes.append((len(lens), sum(lens), max(lens)))
        return out

    core.scheduler.schedule = clock.wrap("schedule", schedule_and_record)
    core.scheduler.update_from_output = clock.wrap("update", core.scheduler.update_from_output)
    engine.output_processor.process_outputs = clock.wrap(
        "output", engine.output_processor.process_outputs
    )
    runner._update_states = clock.wrap("states", runner._update_states)
    runner._sampling_metadata = clock.wrap("sample_meta", runner._sampling_metadata)
    runner.sampler.forward = clock.wrap("sample", runner.sampler.forward)
    model_runner_module.build_model_input = clock.wrap(
        "inputs", model_runner_module.build_model_input
    )
    model_runner_module._to_runner_output = clock.wrap(
        "to_output", model_runner_module._to_runner_output
    )
    model = runner.model
    model.forward = clock.wrap("forward", model.forward)
    if runner.cuda_graphs is not None:
        runner.cuda_graphs.run = clock.wrap("forward", runner.cuda_graphs.run)


def kind_of(shape: tuple[int, int, int]) -> str:
    num_reqs, num_tokens, max_query_len = shape
    if max_query_len == 1:
        return "decode"
    return "mixed" if num_tokens - max_query_len >= num_reqs - 1 and num_reqs > 1 else "prefill"


def gpu_window(steps: Callable[[], float], top: int) -> dict[str, Any]:
    """Profile `steps` (runs some engine steps, returns their wall seconds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = steps()
        torch.cuda.synchronize()
    intervals = []
    per_kernel: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.elapsed_us():
            start, end = event.time_range.start, event.time_range.end
            intervals.append((start, end))
            per_kernel[event.name[:60]] += (end - start) / 1e6
            calls[event.name[:60]] += 1
    intervals.sort()
    busy, cursor = 0.0, float("-inf")
    for start, end in intervals:
        if end > cursor:
            busy += end - max(start, cursor)
            cursor = end
    kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    host_ops = sorted(
        (e for e in prof.key_averages() if e.self_cpu_time_total > 0),
        key=lambda e: -e.self_cpu_time_total,
    )[:top]
    return {
        "host_ops_self_s": [
            (e.key[:60], round(e.self_cpu_time_total / 1e6, 5), e.count) for e in host_ops
        ],
        "wall_s": wall,
        "gpu_busy_s": busy / 1e6,
        "busy_fraction": busy / 1e6 / wall if wall else 0.0,
        "num_kernels": len(intervals),
        "top_kernels_s": [(name, round(t, 5)) for name, t in kernels],
        "top_kernels_calls": [calls[name] for name, _ in kernels],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument(
        "--gpu-windows",
        default="5,100,400",
        help="steps at which to start a 10-step torch.profiler window (GPU only)",
    )
    parser.add_argument(
        "--cprofile-steps",
        help="FIRST:LAST: run cProfile over these steps and print the top functions",
    )
    args = parser.parse_args()

    import torch

    from pagedserve import LLM, SamplingParams

    tmp = tempfile.TemporaryDirectory()
    kwargs: dict[str, Any] = dict(
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )
    if args.preset:
        model = str(materialize(args.preset, Path(tmp.name)))
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    else:
        from pagedserve.config import DEFAULT_MODEL

        model = args.model or DEFAULT_MODEL
    for name in ("max_model_len", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    config = json.loads((Path(model) / "config.json").read_text())
    requests = make_requests(
        args.num_prompts, args.input_len, args.output_len, config["vocab_size"], args.seed
    )
    llm = LLM(model, **kwargs)
    engine = llm.llm_engine
    clock = StepClock()
    shapes: list[tuple[int, int, int]] = []
    instrument(llm, clock, shapes)
    for i, (ids, n) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)

    on_gpu = torch.cuda.is_available() and args.device in ("auto", "cuda")
    windows = sorted(int(w) for w in args.gpu_windows.split(",") if w) if on_gpu else []
    records: list[tuple[str, float, dict[str, float]]] = []
    profiles: dict[str, Any] = {}

    def one_step() -> None:
        clock.phases.clear()
        before = len(shapes)
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        if len(shapes) > before:
            records.append((kind_of(shapes[-1]), wall, dict(clock.phases)))

    def run_steps(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            if engine.has_unfinished_requests():
                one_step()
        return time.perf_counter() - start

    cprofile_range = (
        tuple(int(x) for x in args.cprofile_steps.split(":")) if args.cprofile_steps else None
    )
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        if cprofile_range is not None and len(records) >= cprofile_range[0]:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            run_steps(cprofile_range[1] - cprofile_range[0])
            profiler.disable()
            print(f"cProfile, steps {cprofile_range[0]}-{cprofile_range[1] - 1}:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            cprofile_range = None
            continue
        if windows and len(records) >= windows[0]:
            at = windows.pop(0)
            first = len(records)
            profile = gpu_window(lambda: run_steps(10), top=12)
            profile["step_kinds"] = sorted({k for k, _, _ in records[first:]})
            profiles[f"steps {at}-{at + 9}"] = profile
            continue
        one_step()
    total = time.perf_counter() - start
    num_out = sum(n for _, n in requests)

    by_kind: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)
    for kind, wall, phases in records:
        by_kind[kind].append((wall, phases))
    header = f"{'kind':<8}{'steps':>6}{'total s':>9}{'ms/step':>9}" + "".join(
        f"{p:>12}" for p in PHASES
    )
    print(f"{num_out} output tokens in {total:.2f} s = {num_out / total:.1f} tok/s "
          f"(profiled windows included)")  # fmt: skip
    print("host ms per step, by phase (forward = launch or graph replay; to_output waits on GPU)")
    print(header)
    summary: dict[str, Any] = {}
    for kind, rows in sorted(by_kind.items()):
        walls = [w for w, _ in rows]
        means = {p: 1e3 * sum(ph.get(p, 0.0) for _, ph in rows) / len(rows) for p in PHASES}
        print(
            f"{kind:<8}{len(rows):>6}{sum(walls):>9.2f}{1e3 * sum(walls) / len(rows):>9.2f}"
            + "".join(f"{means[p]:>12.3f}" for p in PHASES)
        )
        summary[kind] = {
            "steps": len(rows),
            "seconds": sum(walls),
            "ms_per_step": 1e3 * sum(walls) / len(rows),
            "phase_ms": means,
        }
    for name, profile in profiles.items():
        print(
            f"GPU window {name} ({','.join(profile['step_kinds'])}): "
            f"wall {profile['wall_s']:.4f} s, "
            f"GPU busy {profile['gpu_busy_s']:.4f} s ({100 * profile['busy_fraction']:.1f}%), "
            f"{profile['num_kernels']} kernels"
        )
        for kernel, seconds in profile["top_kernels_s"]:
            print(f"    {seconds * 1e3:9.2f} ms  {kernel}")
        print("  host ops by self time:")
        for op, seconds, count in profile["host_ops_self_s"]:
            print(f"    {seconds * 1e3:9.2f} ms  {count:>7}x  {op}")
    print(
        json.dumps(
            {
                "benchmark": "step_profile",
                "model": args.preset or model,
                "num_prompts": len(requests),
                "input_len": args.input_len,
                "output_len": args.output_len,
                "seconds": total,
                "output_tok_s": num_out / total,
                "by_kind": summary,
                "gpu_windows": profiles,
            }
        )
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
