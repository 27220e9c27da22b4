"""Tensor parallelism on a multi-GPU machine, in one command: equality, throughput, 70B.

    python benchmarks/tp_gpu_check.py                 # 2 GPUs, all three stages (~7 minutes)
    python benchmarks/tp_gpu_check.py --stages equality throughput
    python benchmarks/tp_gpu_check.py --tp-sizes 1 2 4 8 --70b-tp-sizes 4 8   # issue 8, 8 GPUs

Stages (each prints one JSON line per run; the exit code is 1 if an equality check fails):
  equality    greedy tokens of each tensor_parallel_size in --tp-sizes == those of size 1
              (float32, NCCL, CUDA graphs on) on the bundled stories260k (real weights), on
              tinystories-656k (real weights; from $PAGEDSERVE_TEST_MODELS, splits 8 ways) and
              on tiny random Llama-GQA (2 KV heads), Llama-MQA (1 KV head), Qwen3 and GPT-2
              models saved at run time, each at the sizes its heads divide; bf16 agreement is
              reported, not asserted (rounding may flip near-ties).
  throughput  benchmarks/throughput.py --preset llama-3.1-8b (dummy bf16 weights, 128/128,
              2,000 prompts, max_num_seqs 512: issue 5's P2) at each of --tp-sizes.
  70b         --preset llama-2-70b in bf16 (~138 GB of weights: does not fit one GPU) at each
              of --70b-tp-sizes: 128/128 throughput (--num-prompts) and batch-1 decode latency
              (one prompt of 128 tokens, 256 output tokens: seconds per output token).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.2,
    vocab_size=512,
)


def tiny_models(folder: Path) -> dict[str, Path]:
    """Random tiny models (peaked logits: no near-ties) plus the real stories260k (bundled)
    and tinystories-656k (from $PAGEDSERVE_TEST_MODELS, when set)."""
    import transformers

    configs = {
        "llama_gqa": transformers.LlamaConfig(**_TINY, num_key_value_heads=2),
        "llama_mqa": transformers.LlamaConfig(**_TINY, num_key_value_heads=1),
        "qwen3": transformers.Qwen3Config(**_TINY, num_key_value_heads=2, head_dim=32),
        "gpt2": transformers.GPT2Config(
            vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2
        ),
    }
    paths = {"stories260k": REPO / "pagedserve" / "assets" / "stories260k"}
    shared = Path(os.environ.get("PAGEDSERVE_TEST_MODELS", REPO.parent / "shared" / "models"))
    if (shared / "tinystories-656k").is_dir():
        paths["tinystories-656k"] = shared / "tinystories-656k"
    return paths | save_random_models(folder, configs)


def save_random_models(folder: Path, configs: dict[str, Any]) -> dict[str, Path]:
    """Each config's model, seeded random float32 weights, saved in `folder`/name."""
    import torch
    import transformers

    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder / name)
        paths[name] = folder / name
    return paths


def greedy(
    model: Path, tp_size: int, dtype: str, device: str, **engine_kwargs: Any
) -> list[list[int]]:
    """Greedy tokens of 32 random prompts (64 out) at `tp_size` (and `engine_kwargs`)."""
    from pagedserve import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(4, 100))]}
        for _ in range(32)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with LLM(
        str(model),
        dtype=dtype,
        device=device,
        tensor_parallel_size=tp_size,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 28,
        max_model_len=256,
        max_num_seqs=32,  # 32 prompts; fewer CUDA graphs to capture per engine
        **engine_kwargs,
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _splits(model: Path, tp_size: int) -> bool:
    """Whether the model's heads, MLP and vocabulary divide over `tp_size` ranks."""
    config = json.loads((model / "config.json").read_text())
    heads = config.get("num_attention_heads", config.get("n_head"))
    hidden = config.get("hidden_size", config.get("n_embd"))
    mlp = config.get("intermediate_size") or config.get("n_inner") or 4 * hidden
    return heads % tp_size == 0 and mlp % tp_size == 0


def stage_equality(device: str, tp_sizes: list[int]) -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in tiny_models(Path(tmp)).items():
            for dtype in ("float32", "bfloat16"):
                single = greedy(path, 1, dtype, device)
                for tp_size in tp_sizes:
                    if tp_size == 1 or not _splits(path, tp_size):
                        continue
                    start = time.perf_counter()
                    other = greedy(path, tp_size, dtype, device)
                    same = sum(a == b for a, b in zip(single, other, strict=True))
                    record = {
                        "stage": "equality",
                        "model": name,
                        "dtype": dtype,
                        "tensor_parallel_size": tp_size,
                        "identical": f"{same}/{len(single)}",
                        "mean_common_prefix": sum(
                            _common_prefix(a, b) for a, b in zip(single, other, strict=True)
                        )
                        / len(single),
                        "seconds": round(time.perf_counter() - start, 1),
                    }
                    print(json.dumps(record), flush=True)
                    ok &= dtype == "bfloat16" or same == len(single)
    print(json.dumps({"stage": "equality", "passed": ok}), flush=True)
    return ok


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_throughput(preset: str, tp_size: int, extra: list[str], stage: str) -> None:
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "throughput.py"),
        "--preset",
        preset,
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        str(tp_size),
        *extra,
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    record: dict[str, object] = {
        "stage": stage,
        "preset": preset,
        "tensor_parallel_size": tp_size,
        "exit_code": done.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "result": result,
    }
    if result is not None and stage == "latency":
        run = result["results"]["pagedserve"]
        record["seconds_per_output_token"] = run["seconds"] / run["output_tokens"]
    if done.returncode != 0:
        record["stderr_tail"] = done.stderr[-3000:]
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stages",
        nargs="+",
        default=["equality", "throughput", "70b"],
        choices=["equality", "throughput", "70b"],
    )
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--70b-tp-sizes", dest="tp_sizes_70b", type=int, nargs="+", default=[2])
    parser.add_argument("--num-prompts", type=int, default=256, help="of the 70b stage")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the equality stage")
    args = parser.parse_args()
    import torch

    most = max(args.tp_sizes + args.tp_sizes_70b)
    if args.device == "cuda" and torch.cuda.device_count() < most:
        raise SystemExit(f"needs {most} GPUs, found {torch.cuda.device_count()}")
    ok = True
    if "equality" in args.stages:
        ok = stage_equality(args.device, args.tp_sizes)
    if "throughput" in args.stages:
        p2 = ["--num-prompts", "2000", "--input-len", "128", "--output-len", "128"]
        p2 += ["--max-model-len", "512", "--max-num-seqs", "512"]
        for tp_size in args.tp_sizes:
            run_throughput("llama-3.1-8b", tp_size, p2, "throughput")
    if "70b" in args.stages:
        for tp_size in args.tp_sizes_70b:
            common = ["--num-prompts", str(args.num_prompts), "--input-len", "128"]
            common += ["--output-len", "128", "--max-model-len", "2048"]
            run_throughput("llama-2-70b", tp_size, common, "throughput")
            single = ["--num-prompts", "1", "--input-len", "128", "--output-len", "256"]
            single += ["--max-model-len", "512", "--max-num-seqs", "1"]
            run_throughput("llama-2-70b", tp_size, single, "latency")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
