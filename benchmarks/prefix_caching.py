"""Shared-prefix workload with automatic prefix caching on vs off.

N requests share one long system prompt and differ in a short tail (random tokens, seed 0),
`ignore_eos`. Prints time, throughput, tokens the model computed and the prefix hit rate.

  python benchmarks/prefix_caching.py --preset tiny-llama-4m --num-prompts 256 \
      --prefix-len 1000 --suffix-len 24 --output-len 16 --device cpu
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import PRESETS, materialize  # noqa: E402


def run(model: str, args: argparse.Namespace, caching: bool, prompts: list[list[int]]) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        model,
        load_format=args.load_format,
        skip_tokenizer_init=True,
        device=args.device,
        dtype=args.dtype,
        enable_prefix_caching=caching,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.prefix_len + args.suffix_len + args.output_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    )
    params = SamplingParams(
        temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
    )
    warm = [[7] * 32]
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    scheduler, kv_cache = llm.llm_engine.scheduler, llm.llm_engine.kv_cache
    tokens_before, hits_before = scheduler.num_scheduled_tokens_total, kv_cache.num_hit_tokens
    queries_before = kv_cache.num_query_tokens
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    queries = kv_cache.num_query_tokens - queries_before
    return {
        "seconds": seconds,
        "req_s": len(prompts) / seconds,
        "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / seconds,
        "computed_tokens": scheduler.num_scheduled_tokens_total - tokens_before,
        "hit_rate": (kv_cache.num_hit_tokens - hits_before) / queries if queries else 0.0,
        "outputs": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-llama-4m")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--suffix-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="fixed KV cache size (on a GPU: both runs share it, one engine after the other)",
    )
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(materialize(args.preset, Path(tmp.name)))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prefix = [rng.randrange(10, vocab) for _ in range(args.prefix_len)]
    prompts = [
        prefix + [rng.randrange(10, vocab) for _ in range(args.suffix_len)]
        for _ in range(args.num_prompts)
    ]
    results = {
        "caching on": run(model, args, True, prompts),
        "caching off": run(model, args, False, prompts),
    }
    same = results["caching on"]["outputs"] == results["caching off"]["outputs"]
    print(
        f"{'':<14}{'seconds':>9}{'req/s':>9}{'out tok/s':>11}{'computed tok':>14}{'hit rate':>10}"
    )
    for name, r in results.items():
        print(
            f"{name:<14}{r['seconds']:>9.2f}{r['req_s']:>9.2f}{r['output_tok_s']:>11.1f}"
            f"{r['computed_tokens']:>14}{r['hit_rate']:>10.1%}"
        )
    speedup = results["caching off"]["seconds"] / results["caching on"]["seconds"]
    print(f"speed-up from prefix caching: {speedup:.1f}x; identical greedy outputs: {same}")
    for r in results.values():
        del r["outputs"]
    print(
        json.dumps(
            {
                "benchmark": "prefix_caching",
                "model": args.model or args.preset,
                "num_prompts": args.num_prompts,
                "prefix_len": args.prefix_len,
                "results": results,
                "identical_outputs": same,
            }
        )
    )


if __name__ == "__main__":
    main()
