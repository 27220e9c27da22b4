"""Structured outputs: output throughput with a JSON schema on every request vs none, the
time to compile a typical schema, and the compile cache's hit rate.

Qwen3-0.6B's architecture (`--preset qwen3-0.6b`, dummy weights) with the real Qwen3
tokenizer (the grammar is compiled against its vocabulary). Random-token prompts, temperature
1. The schema's string fields have no length bound, so random weights fill them until
max_tokens: both runs produce (nearly) the same number of tokens; the table prints how many
requests ran to max_tokens. Prints a table and one JSON line per run.

GPU (the lead's machine; the tokenizer copied to .gpu_assets/tokenizers/qwen3):
  python3 benchmarks/structured_outputs.py --preset qwen3-0.6b --dtype bfloat16 --device cuda \
      --tokenizer .gpu_assets/tokenizers/qwen3 --num-prompts 256 --input-len 256 --output-len 256
CPU smoke run:
  python benchmarks/structured_outputs.py --preset tiny-qwen3 --device cpu --num-prompts 8 \
      --input-len 16 --output-len 16
"""

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from benchmarks.presets import PRESETS, materialize  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = REPO.parent / "shared" / "tokenizers" / "qwen3"

# A typical extraction schema: nested object, enum, bounded number, array, required fields.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "category": {"enum": ["book", "film", "song", "game"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "author": {
            "type": "object",
            "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
            "required": ["first", "last"],
        },
        "summary": {"type": "string"},
    },
    "required": ["name", "category", "rating", "tags", "author", "summary"],
}


def run_once(llm: Any, prompts: list, output_len: int, schema: dict | None, seed: int) -> dict:
    from pagedserve import SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    constraint = None if schema is None else StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=output_len,
            ignore_eos=True,
            detokenize=False,
            seed=seed * 100_000 + i,
            structured_outputs=constraint,
        )  # fmt: skip
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    completions = [c for o in outputs for c in o.outputs]
    num_out = sum(len(c.token_ids) for c in completions)
    return {
        "seconds": seconds,
        "output_tokens": num_out,
        "output_tok_s": num_out / seconds,
        "num_at_max_tokens": sum(c.finish_reason == "length" for c in completions),
    }


class PhaseClock:
    """`--phases`: host milliseconds per engine step spent in each phase of the step loop,
    by wrapping the engine's methods with step_profile.py's StepClock (no device syncs added:
    the wait for the device shows in `wait_result`). Nested phases overlap: `finish_in_flight`
    holds `wait_result` and `update_from_output`, which holds `accept_tokens`;
    `deferred_fill` holds `fill` (or, with the grammar process, `wait_fill`); `sample_tokens`
    holds `apply_bitmask` (the host's part of the mask's apply, with the executor in this
    process)."""

    def __init__(self, llm: Any) -> None:
        import pagedserve.worker.model_runner as model_runner
        from benchmarks.step_profile import StepClock
        from pagedserve.step import AsyncModelRunnerOutput

        self.clock = StepClock()
        core = llm.llm_engine.engine_core
        manager = core.structured_output_manager
        targets = [
            ("step", llm.llm_engine, "step"),
            ("core_step", core, "step"),
            ("schedule", core.scheduler, "schedule"),
            ("launch_forward", core.executor, "launch_forward"),
            ("execute_model_async", core.executor, "execute_model_async"),
            ("finish_in_flight", core, "_finish_in_flight"),
            ("update_from_output", core.scheduler, "update_from_output"),
            ("accept_tokens", manager, "accept_tokens"),
            ("deferred_fill", core.scheduler, "deferred_grammar_output"),
            ("fill", manager, "grammar_bitmask"),
            ("wait_fill", manager, "prefetched_output"),  # the grammar process's fill
            ("send_tokens", manager, "send_step_tokens"),
            ("sample_tokens", core.executor, "sample_tokens"),
            ("apply_bitmask", model_runner, "apply_grammar_bitmask"),
            ("process_outputs", llm.llm_engine.output_processor, "process_outputs"),
        ]
        for name, owner, attr in targets:
            if hasattr(owner, attr):
                setattr(owner, attr, self.clock.wrap(name, getattr(owner, attr)))
        AsyncModelRunnerOutput.result = self.clock.wrap(  # type: ignore[method-assign]
            "wait_result", AsyncModelRunnerOutput.result
        )

    def report(self, label: str, num_steps: int) -> None:
        """Print ms per step of each phase since the last report, then start again."""
        parts = [f"{k} {1e3 * v / max(num_steps, 1):.2f}" for k, v in self.clock.phases.items()]
        print(f"  phases ({label}, ms per step over {num_steps} steps): " + ", ".join(parts))
        self.clock.phases.clear()


def compile_seconds(llm: Any, schemas: list[dict]) -> float:
    """Mean compile time of `schemas` (new to the cache) from the manager's counters."""
    from pagedserve import SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    manager = llm.llm_engine.engine_core.structured_output_manager
    before = manager.stats()
    params = [
        SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=s))
        for s in schemas
    ]
    prompts = [{"prompt_token_ids": [100 + i]} for i in range(len(schemas))]
    llm.generate(prompts, params, use_tqdm=False)
    after = manager.stats()
    compiles = after.num_cache_misses - before.num_cache_misses
    return (after.compile_seconds - before.compile_seconds) / max(compiles, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER),
                        help="folder of the Qwen3 tokenizer (tokenizer.json)")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory-bytes", type=int)
    parser.add_argument("--phases", action="store_true",
                        help="print host ms per step of each phase of the step loop")  # fmt: skip
    args = parser.parse_args()

    from pagedserve import LLM, SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    model = materialize(args.preset, Path(tempfile.mkdtemp()))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(args.tokenizer) / name, model / name)
    kwargs: dict[str, Any] = dict(
        dtype=args.dtype, device=args.device, load_format="dummy", seed=0,
        max_num_seqs=args.max_num_seqs, max_model_len=args.input_len + args.output_len + 8,
    )  # fmt: skip
    if args.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    llm = LLM(str(model), **kwargs)
    engine_core = llm.llm_engine.engine_core
    manager = engine_core.structured_output_manager
    vocab = PRESETS[args.preset]["vocab_size"]
    rng = random.Random(0)

    # The first constraint builds xgrammar's tables of the vocabulary, then compiles.
    start = time.perf_counter()
    first = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], first, use_tqdm=False)
    first_seconds = time.perf_counter() - start
    variants = [{**SCHEMA, "title": f"variant {i}"} for i in range(8)]  # new to the cache
    typical_compile_s = compile_seconds(llm, variants)
    llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=4), use_tqdm=False)
    print(
        f"{args.preset} {args.num_prompts} prompts x {args.input_len} tokens -> "
        f"{args.output_len}; async scheduling {'on' if engine_core.async_scheduling else 'off'}; "
        f"{git_commit()}"
    )
    print(f"first constraint (vocabulary tables + compile + 2 tokens): {first_seconds:.2f} s")
    print(f"compile of a typical schema: {typical_compile_s * 1e3:.1f} ms (mean of 8)")
    clock = PhaseClock(llm) if args.phases else None
    steps = [0]
    if clock is not None:  # count core steps that ran something
        step_fn = engine_core.step

        def counted_step() -> Any:
            steps[0] += 1
            return step_fn()

        engine_core.step = counted_step
    print(f"{'run':>6} {'seconds':>8} {'out tok/s':>10} {'at max':>7}")
    rates: dict[str, list[float]] = {"none": [], "json": []}
    for repeat in range(args.repeats):
        prompts = [
            {"prompt_token_ids": [rng.randrange(10, vocab - 400) for _ in range(args.input_len)]}
            for _ in range(args.num_prompts)
        ]
        for label, schema in (("none", None), ("json", SCHEMA)):
            result = run_once(llm, prompts, args.output_len, schema, repeat)
            rates[label].append(result["output_tok_s"])
            print(
                f"{label:>6} {result['seconds']:>8.2f} {result['output_tok_s']:>10.0f} "
                f"{result['num_at_max_tokens']:>7}"
            )
            print(json.dumps({"run": label, "repeat": repeat, **result}))
            if clock is not None:
                clock.report(label, steps[0])
                steps[0] = 0
    stats = manager.stats()
    none, with_json = max(rates["none"]), max(rates["json"])
    loss = 100.0 * (1.0 - with_json / none)
    print(f"output tok/s, best run: none {none:.0f}, json schema {with_json:.0f}: loss {loss:.1f}%")
    print(
        f"grammar cache: {stats.num_cache_hits} hits, {stats.num_cache_misses} misses "
        f"(hit rate {100 * stats.hit_rate:.1f}%); compile total {stats.compile_seconds:.2f} s"
    )
    print(json.dumps({
        "none_tok_s": none, "json_tok_s": with_json, "loss_percent": loss,
        "typical_compile_ms": typical_compile_s * 1e3, "first_constraint_s": first_seconds,
        "cache_hits": stats.num_cache_hits, "cache_misses": stats.num_cache_misses,
        "hit_rate": stats.hit_rate,
    }))  # fmt: skip
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
