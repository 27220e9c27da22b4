"""Where a tensor-parallel step's time goes: the engine's host work, its wait on the ranks,
and each rank's launch, wait and idle time (multiprocessing executor).

    python benchmarks/tp_probe.py --tensor-parallel-size 2 --preset llama-3.1-8b \
        --num-prompts 2000 --input-len 128 --output-len 128 --max-num-seqs 512

Wraps the engine's and the workers' step functions with host timers (no device syncs are
added). The workers are started with the "spawn" method, which imports this file again as
`__mp_main__`, so the wrappers installed at import time run in them too. Rank 0's worker
prints its running totals every `--worker-every` launches (to stderr, prefixed WORKER):
`launch` = build the inputs and launch step N+1, `wait` = wait for step N's tokens,
`idle` = from replying to the next launch request (the engine's host work and the IPC).
With TP=1 (uniproc executor) the same wrappers run in the engine process.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pagedserve.distributed.parallel_state as parallel_state  # noqa: E402
import pagedserve.engine.llm_engine as llm_engine  # noqa: E402
import pagedserve.executor.multiproc_executor as multiproc_executor  # noqa: E402
import pagedserve.scheduler as scheduler  # noqa: E402
import pagedserve.step as step  # noqa: E402
import pagedserve.worker.model_runner as model_runner  # noqa: E402

TOTALS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
_last_reply: list[float | None] = [None]


def _wrap(owner: Any, name: str, key: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[key] += time.perf_counter() - start
            COUNTS[key] += 1

    setattr(owner, name, timed)


def _install() -> None:
    launch_fn = model_runner.ModelRunner.execute_model_async
    result_fn = step.AsyncModelRunnerOutput.result
    every = int(os.environ.get("TP_PROBE_WORKER_EVERY", "300"))

    def launch(self: Any, scheduler_output: Any) -> Any:
        start = time.perf_counter()
        if _last_reply[0] is not None:
            TOTALS["rank_idle"] += start - _last_reply[0]
        out = launch_fn(self, scheduler_output)
        TOTALS["rank_launch"] += time.perf_counter() - start
        COUNTS["rank_launch"] += 1
        if COUNTS["rank_launch"] % every == 0 and parallel_state.get_tp_rank() == 0:
            totals = {k: round(v, 3) for k, v in TOTALS.items() if k.startswith("rank_")}
            print("WORKER", COUNTS["rank_launch"], json.dumps(totals), file=sys.stderr, flush=True)
        return out

    def result(self: Any) -> Any:
        start = time.perf_counter()
        out = result_fn(self)
        TOTALS["rank_wait"] += time.perf_counter() - start
        _last_reply[0] = time.perf_counter()
        return out

    model_runner.ModelRunner.execute_model_async = launch  # type: ignore[method-assign]
    step.AsyncModelRunnerOutput.result = result  # type: ignore[method-assign]
    _wrap(multiproc_executor.MultiprocExecutor, "_collect", "engine_wait_ranks")
    _wrap(scheduler.Scheduler, "schedule", "engine_schedule")
    _wrap(scheduler.Scheduler, "update_from_output", "engine_update")
    _wrap(llm_engine.LLMEngine, "step", "engine_step")


_install()


def main() -> None:
    from benchmarks.presets import PRESETS, materialize
    from benchmarks.throughput import make_requests
    from pagedserve import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--worker-every", type=int, default=300)
    args = parser.parse_args()
    os.environ["TP_PROBE_WORKER_EVERY"] = str(args.worker_every)  # inherited by the workers

    tmp = tempfile.TemporaryDirectory()
    model = str(materialize(args.preset, Path(tmp.name)))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    llm = LLM(
        model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
        device=args.device, tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
    )  # fmt: skip
    lens = (args.input_len, args.input_len), (args.output_len, args.output_len)
    requests = make_requests(args.num_prompts, *lens, vocab, 0)
    params = SamplingParams(
        temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
    )
    llm.generate([{"prompt_token_ids": ids} for ids, _ in requests[:8]], params, use_tqdm=False)
    TOTALS.clear()
    COUNTS.clear()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids, _ in requests], params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = COUNTS["engine_step"]
    per_step = {k: round(v / steps * 1e3, 3) for k, v in sorted(TOTALS.items())}
    print(f"tp={args.tensor_parallel_size}: {wall:.2f} s, {steps} steps, "
          f"{wall / steps * 1e3:.2f} ms a step")  # fmt: skip
    print(f"{'engine-process timer':<22}{'ms a step':>10}")
    for key, ms in per_step.items():
        print(f"{key:<22}{ms:>10.3f}")
    print(json.dumps({"benchmark": "tp_probe", "preset": args.preset,
                      "tensor_parallel_size": args.tensor_parallel_size,
                      "num_prompts": args.num_prompts, "seconds": wall, "steps": steps,
                      "ms_per_step": per_step}))  # fmt: skip


if __name__ == "__main__":
    main()
