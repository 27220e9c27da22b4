"""KV blocks in CPU memory (issue 19): swap against recompute under memory pressure, and the
prefix cache's CPU tier against recomputing evicted prefixes. Dummy weights of a preset,
random token prompts, `ignore_eos`; each case in a fresh engine in this process.

1. Preemption: NUM_PROMPTS requests of INPUT_LEN in / OUTPUT_LEN out on a KV cache of
   --num-blocks blocks (too few for the batch: requests are preempted), with
   preemption_mode "recompute" and "swap" (--swap-space GiB). Prints seconds, preemptions,
   swaps, and tokens fed to the model (recompute feeds the preempted prompts again).
2. CPU tier: --num-prefixes shared prefixes of --prefix-len tokens, each asked again after
   the others have evicted it from a GPU cache of --tier-blocks blocks (rounds of one
   request per prefix, a few new tokens each), without and with --kv-offload-gb. Prints the
   seconds of the rounds after the first and the prefix-cache hits (GPU and CPU tier).

  python benchmarks/kv_offload.py --preset qwen3-0.6b            # one GPU
  python benchmarks/kv_offload.py --preset tiny-llama-4m --device cpu --num-prompts 16 \
      --input-len 64 --output-len 16 --num-blocks 40 --num-prefixes 4 --prefix-len 64 \
      --tier-blocks 12 --swap-space 0.05 --kv-offload-gb 0.05     # smoke test
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from benchmarks.presets import materialize  # noqa: E402
from benchmarks.throughput import _free_gpu_memory  # noqa: E402


def engine(args: argparse.Namespace, model: Path, **kwargs: Any) -> Any:
    from pagedserve import LLM

    return LLM(str(model), load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
               device=args.device, max_model_len=args.max_model_len, seed=0,
               **kwargs)  # fmt: skip


def preemption(args: argparse.Namespace, model: Path, mode: str) -> dict[str, Any]:
    from pagedserve import SamplingParams

    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, args.vocab_size) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    llm = engine(args, model, num_gpu_blocks_override=args.num_blocks, preemption_mode=mode,
                 swap_space=args.swap_space, max_num_seqs=args.num_prompts)  # fmt: skip
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    scheduler = llm.llm_engine.scheduler
    fed_before = scheduler.num_scheduled_tokens_total
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result = dict(seconds=seconds, preemptions=scheduler.num_preemptions_total,
                  swap_outs=scheduler.num_swap_outs_total,
                  tokens_fed=scheduler.num_scheduled_tokens_total - fed_before)  # fmt: skip
    llm.llm_engine.shutdown()
    return result


def cpu_tier(args: argparse.Namespace, model: Path, offload_gb: float) -> dict[str, Any]:
    from pagedserve import SamplingParams

    rng = random.Random(1)
    prefixes = [
        [rng.randrange(10, args.vocab_size) for _ in range(args.prefix_len)]
        for _ in range(args.num_prefixes)
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm = engine(args, model, num_gpu_blocks_override=args.tier_blocks, kv_offload_gb=offload_gb)
    core = llm.llm_engine.engine_core
    seconds = 0.0
    for round_ in range(args.rounds + 1):
        # A new suffix each round: only the prefix can hit.
        batch = [{"prompt_token_ids": p + [11 + round_, 12 + round_]} for p in prefixes]
        start = time.perf_counter()
        for prompt in batch:  # one at a time: each evicts the one before from the GPU cache
            llm.generate(prompt, params, use_tqdm=False)
        if round_ > 0:  # the first round computes every prefix once
            seconds += time.perf_counter() - start
    stats = core.stats()
    result = dict(seconds=seconds, prefix_cache_hits=stats.prefix_cache_hits,
                  cpu_prefix_cache_hits=stats.cpu_prefix_cache_hits)  # fmt: skip
    llm.llm_engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=2048, help="16-token blocks")
    parser.add_argument("--swap-space", type=float, default=16.0)
    parser.add_argument("--num-prefixes", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--tier-blocks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-offload-gb", type=float, default=8.0)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        model = materialize(args.preset, Path(folder))
        args.vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
        for mode in ("recompute", "swap"):
            results[f"preemption {mode}"] = preemption(args, model, mode)
            _free_gpu_memory()
        for gb in (0.0, args.kv_offload_gb):
            results[f"prefixes, kv_offload_gb {gb:g}"] = cpu_tier(args, model, gb)
            _free_gpu_memory()
    print(f"{args.preset}, {args.device}, {args.dtype}, commit {git_commit()}")
    print(f"preemption: {args.num_prompts} x {args.input_len} in / {args.output_len} out on "
          f"{args.num_blocks} blocks")  # fmt: skip
    print(f"{'case':34} {'seconds':>8} {'preempt':>8} {'swaps':>6} {'tokens fed':>11}")
    for mode in ("recompute", "swap"):
        r = results[f"preemption {mode}"]
        print(f"{mode:34} {r['seconds']:8.2f} {r['preemptions']:8d} {r['swap_outs']:6d} "
              f"{r['tokens_fed']:11d}")  # fmt: skip
    print(f"prefixes: {args.num_prefixes} x {args.prefix_len} tokens, {args.rounds} rounds "
          f"after the first, GPU cache {args.tier_blocks} blocks")  # fmt: skip
    print(f"{'case':34} {'seconds':>8} {'hits':>8} {'CPU hits':>9}")
    for gb in (0.0, args.kv_offload_gb):
        r = results[f"prefixes, kv_offload_gb {gb:g}"]
        print(f"{'kv_offload_gb ' + format(gb, 'g'):34} {r['seconds']:8.2f} "
              f"{r['prefix_cache_hits']:8d} {r['cpu_prefix_cache_hits']:9d}")  # fmt: skip
    print(json.dumps({"commit": git_commit(), "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
