"""Tensor parallelism on a 2-GPU machine, in one command: equality, throughput, a 70B model.

    python benchmarks/tp_gpu_check.py                 # all three stages (about 5-8 minutes)
    python benchmarks/tp_gpu_check.py --stages equality throughput

Stages (each prints one JSON line; the exit code is 1 if an equality check fails):
  equality    greedy tokens of tensor_parallel_size 2 == 1 (float32, NCCL, CUDA graphs on) on
              the bundled stories260k (real weights) and on tiny random Llama-GQA (2 KV heads),
              Llama-MQA (1 KV head < tp_size), Qwen3 and GPT-2 models saved at run time; bf16
              agreement is reported, not asserted (rounding may flip near-ties).
  throughput  benchmarks/throughput.py --preset llama-3.1-8b (dummy bf16 weights, 128/128,
              2,000 prompts, max_num_seqs 512: issue 5's P2) at tensor_parallel_size 1 and 2.
  70b         benchmarks/throughput.py --preset llama-2-70b in bf16 (~138 GB of weights: does
              not fit one GPU), 128/128, --num-prompts (256) at tensor_parallel_size 2.
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    """Random tiny models (peaked logits: no near-ties) plus the bundled real stories260k."""
    import torch
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
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder / name)
        paths[name] = folder / name
    return paths


def greedy(model: Path, tp_size: int, dtype: str, device: str) -> list[list[int]]:
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
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def stage_equality(device: str) -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in tiny_models(Path(tmp)).items():
            result: dict[str, object] = {"stage": "equality", "model": name}
            for dtype in ("float32", "bfloat16"):
                start = time.perf_counter()
                single, double = greedy(path, 1, dtype, device), greedy(path, 2, dtype, device)
                same = sum(a == b for a, b in zip(single, double, strict=True))
                result[dtype] = f"{same}/{len(single)} identical"
                result[f"{dtype}_mean_common_prefix"] = sum(
                    _common_prefix(a, b) for a, b in zip(single, double, strict=True)
                ) / len(single)
                result[f"{dtype}_seconds"] = round(time.perf_counter() - start, 1)
                ok &= dtype == "bfloat16" or same == len(single)
            print(json.dumps(result), flush=True)
    print(json.dumps({"stage": "equality", "passed": ok}), flush=True)
    return ok


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_throughput(preset: str, tp_size: int, extra: list[str]) -> None:
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "throughput.py"),
        "--preset",
        preset,
        "--dtype",
        "bfloat16",
        "--input-len",
        "128",
        "--output-len",
        "128",
        "--tensor-parallel-size",
        str(tp_size),
        *extra,
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    record = {
        "stage": "throughput",
        "preset": preset,
        "tensor_parallel_size": tp_size,
        "exit_code": done.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "result": json.loads(lines[-1]) if done.returncode == 0 and lines else None,
    }
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
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the equality stage")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    ok = True
    if "equality" in args.stages:
        ok = stage_equality(args.device)
    if "throughput" in args.stages:
        p2 = ["--num-prompts", "2000", "--max-model-len", "512", "--max-num-seqs", "512"]
        for tp_size in (1, 2):
            run_throughput("llama-3.1-8b", tp_size, p2)
    if "70b" in args.stages:
        common = ["--num-prompts", str(args.num_prompts), "--max-model-len", "2048"]
        run_throughput("llama-2-70b", 2, common)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
