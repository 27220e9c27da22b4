"""Parallel sampling (`n`): the fork/copy-on-write path against prefix-cache sharing alone.

Issue 14 item 2. Both mechanisms run in one engine, alternating, on the same prompts:

  fork    today's engine: child 0 computes the prompt, the other children wait for it and
          fork its block table (every block shared by reference count, the partly filled last
          block copied on first write) and sample their first token from its logits.
  prefix  vLLM's way: the n children are plain requests; they share the prompt's full blocks
          through the prefix cache (hashed as soon as child 0's tokens are scheduled) and each
          recomputes the partly filled last block and its own last-token logits.

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


def use_mechanism(mechanism: str) -> None:
    """Make new requests' children fork ("fork", the engine's default) or not ("prefix")."""
    import pagedserve.engine.llm_engine as llm_engine

    original = getattr(llm_engine, "_original_child_requests", llm_engine.child_requests)
    llm_engine._original_child_requests = original  # type: ignore[attr-defined]
    if mechanism == "fork":
        llm_engine.child_requests = original
        return

    def without_fork(*args: Any, **kwargs: Any) -> Any:
        children = original(*args, **kwargs)
        for child in children:
            child.fork_of = None
        return children

    llm_engine.child_requests = without_fork


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
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per mechanism")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--kv-cache-memory-bytes", type=int)
    parser.add_argument("--no-enable-prefix-caching", action="store_true")
    args = parser.parse_args()

    from pagedserve import LLM

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
    print(
        f"{'n':>3} {'mechanism':>9} {'seconds':>8} {'out tok/s':>10} {'prompt computed':>16} "
        f"{'preempt':>8}"
    )
    for n in args.n:
        use_mechanism("fork")  # warm-up (graphs, caches) at this n
        warm = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(8)]}]
        llm.generate(warm, use_tqdm=False)
        for repeat in range(args.repeats):
            for mechanism in ("fork", "prefix") if repeat % 2 == 0 else ("prefix", "fork"):
                use_mechanism(mechanism)
                # Fresh prompts every run: no run hits another's prefix cache.
                prompts = [
                    {
                        "prompt_token_ids": [
                            rng.randrange(10, vocab - 10) for _ in range(args.input_len)
                        ]
                    }
                    for _ in range(args.num_prompts)
                ]
                result = run_once(llm, prompts, n, args.output_len, seed=repeat)
                print(
                    f"{n:>3} {mechanism:>9} {result['seconds']:>8.2f} "
                    f"{result['output_tok_s']:>10.0f} {result['prompt_tokens_computed']:>16} "
                    f"{result['preemptions']:>8}"
                )
                print(json.dumps({"n": n, "mechanism": mechanism, "repeat": repeat, **result}))
    use_mechanism("fork")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
