"""Parallel sampling (`n`): throughput and the prompt tokens the model computes.

The n sequences of a request are n engine-core requests of one sharing group; they share the
prompt's full blocks through the prefix cache (hashed as soon as the first sequence's tokens
are scheduled, so the others hit them in the same step), and each computes the partly filled
last block and its own last-token logits, as in vLLM. Issue 14 compared this with the
fork/copy-on-write path that it replaced (`git show cab5bad:benchmarks/parallel_sampling.py`
runs both): see BENCHMARKS.md.

Random token prompts, temperature 1, `ignore_eos`. Prints a table (seconds, output tokens/s,
prompt tokens the model computed, preemptions) and one JSON line per run.

  python benchmarks/parallel_sampling.py --preset tiny-llama-4m --device cpu --num-prompts 8 \
      --input-len 100 --output-len 16 --n 4 8
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
from benchmarks.presets import PRESETS, materialize  # noqa: E402


def run_once(llm: Any, prompts: list, n: int, output_len: int, seed: int) -> dict:
    from pagedserve import SamplingParams

    scheduler = llm.llm_engine.engine_core.scheduler
    computed_before = scheduler.num_scheduled_tokens_total
    preempted_before = scheduler.num_preemptions_total
    params = SamplingParams(
        n=n, temperature=1.0, max_tokens=output_len, ignore_eos=True, detokenize=False, seed=seed
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert num_out == len(prompts) * n * output_len, "ignore_eos must fix output lengths"
    computed = scheduler.num_scheduled_tokens_total - computed_before
    return {
        "seconds": seconds,
        "output_tokens": num_out,
        "output_tok_s": num_out / seconds,
        # Tokens fed to the model minus the sampled ones fed back: prompt tokens computed.
        "prompt_tokens_computed": computed - len(prompts) * n * (output_len - 1),
        "preemptions": scheduler.num_preemptions_total - preempted_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--n", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs per n")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--kv-cache-memory-bytes", type=int)
    parser.add_argument("--no-enable-prefix-caching", action="store_true")
    args = parser.parse_args()

    from pagedserve import LLM, SamplingParams

    model = materialize(args.preset, Path(tempfile.mkdtemp()))
    kwargs: dict[str, Any] = dict(
        dtype=args.dtype,
        device=args.device,
        load_format="dummy",
        max_num_seqs=args.max_num_seqs,
        skip_tokenizer_init=True,
        seed=0,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        max_model_len=args.max_model_len or args.input_len + args.output_len,
    )
    if args.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    llm = LLM(model, **kwargs)
    vocab = PRESETS[args.preset]["vocab_size"]
    rng = random.Random(0)
    print(
        f"{args.preset} {args.num_prompts} prompts x {args.input_len} tokens -> n x "
        f"{args.output_len}; {llm.llm_engine.engine_core.num_blocks} KV blocks; {git_commit()}"
    )
    print(f"{'n':>3} {'seconds':>8} {'out tok/s':>10} {'prompt computed':>16} {'preempt':>8}")
    for n in args.n:
        warm = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(8)]}]
        llm.generate(warm, SamplingParams(n=n), use_tqdm=False)  # warm-up at this n
        for repeat in range(args.repeats):
            # Fresh prompts every run: no run hits another's prefix cache.
            prompts = [
                {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]}
                for _ in range(args.num_prompts)
            ]
            result = run_once(llm, prompts, n, args.output_len, seed=repeat)
            print(
                f"{n:>3} {result['seconds']:>8.2f} {result['output_tok_s']:>10.0f} "
                f"{result['prompt_tokens_computed']:>16} {result['preemptions']:>8}"
            )
            print(json.dumps({"n": n, "repeat": repeat, **result}))
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
