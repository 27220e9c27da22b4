"""Pipeline parallelism on a multi-GPU machine, in one command: equality and throughput.

    python benchmarks/pp_gpu_check.py                        # 2 GPUs: PP=2 (~5 minutes)
    python benchmarks/pp_gpu_check.py --pp-sizes 2 4 --tp-size 2    # 8 GPUs: PP x TP=2

Stages (each prints one JSON line per run; the exit code is 1 if an equality check fails):
  equality    greedy tokens of each pipeline_parallel_size in --pp-sizes (x --tp-size) ==
              those of one GPU (float32, NCCL, eager) on the bundled stories260k (5 layers:
              split [3, 2] at PP=2), a tiny random 4-layer Llama (tied embeddings), a tiny
              random 4-layer Qwen3, and the Llama again split by PAGEDSERVE_PP_LAYER_PARTITION
              "1,3"; bf16 agreement is reported, not asserted (rounding may flip near-ties).
  throughput  benchmarks/throughput.py --preset llama-3.1-8b (dummy bf16 weights, 128/128,
              2,000 prompts, max_num_seqs 512) at PP=1 and each of --pp-sizes: PP keeps
              pipeline_parallel_size steps in flight (the engine core's batch queue).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.tp_gpu_check import greedy as tp_greedy  # noqa: E402
from benchmarks.tp_gpu_check import save_random_models  # noqa: E402

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,  # peaked logits: no near-ties
)


def models(folder: Path) -> dict[str, Path]:
    """The bundled stories260k and tiny random 4-layer Llama and Qwen3 saved in `folder`."""
    import transformers

    configs = {
        "llama4": transformers.LlamaConfig(**_TINY, vocab_size=512, tie_word_embeddings=True),
        "qwen3": transformers.Qwen3Config(**_TINY, vocab_size=512, head_dim=32),
    }
    stories = {"stories260k": REPO / "pagedserve" / "assets" / "stories260k"}
    return stories | save_random_models(folder, configs)


def greedy(model: Path, pp_size: int, tp_size: int, dtype: str, device: str) -> list[list[int]]:
    """tp_gpu_check's greedy tokens at pipeline_parallel_size `pp_size` x `tp_size`."""
    return tp_greedy(model, tp_size, dtype, device, pipeline_parallel_size=pp_size)


def stage_equality(pp_sizes: list[int], tp_size: int, device: str) -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(name, path, None) for name, path in models(Path(tmp)).items()]
        cases.append(("llama4", Path(tmp) / "llama4", "1,3"))
        for name, path, partition in cases:
            for dtype in ("float32", "bfloat16"):
                single = greedy(path, 1, 1, dtype, device)
                for pp_size in pp_sizes:
                    if partition is not None and pp_size != 2:
                        continue
                    if partition is not None:
                        os.environ["PAGEDSERVE_PP_LAYER_PARTITION"] = partition
                    start = time.perf_counter()
                    try:
                        other = greedy(path, pp_size, tp_size, dtype, device)
                    finally:
                        os.environ.pop("PAGEDSERVE_PP_LAYER_PARTITION", None)
                    same = sum(a == b for a, b in zip(single, other, strict=True))
                    record = {
                        "stage": "equality",
                        "model": name,
                        "partition": partition,
                        "dtype": dtype,
                        "pipeline_parallel_size": pp_size,
                        "tensor_parallel_size": tp_size,
                        "identical": f"{same}/{len(single)}",
                        "seconds": round(time.perf_counter() - start, 1),
                    }
                    print(json.dumps(record), flush=True)
                    ok &= dtype == "bfloat16" or same == len(single)
    print(json.dumps({"stage": "equality", "passed": ok}), flush=True)
    return ok


def run_throughput(pp_size: int, tp_size: int) -> None:
    command = [sys.executable, str(REPO / "benchmarks" / "throughput.py")]
    command += ["--preset", "llama-3.1-8b", "--dtype", "bfloat16"]
    command += ["--pipeline-parallel-size", str(pp_size), "--tensor-parallel-size", str(tp_size)]
    command += ["--num-prompts", "2000", "--input-len", "128", "--output-len", "128"]
    command += ["--max-model-len", "512", "--max-num-seqs", "512"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    record: dict[str, object] = {
        "stage": "throughput",
        "pipeline_parallel_size": pp_size,
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
        default=["equality", "throughput"],
        choices=["equality", "throughput"],
    )
    parser.add_argument("--pp-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--tp-size", type=int, default=1, help="of every pipelined run")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the equality stage")
    args = parser.parse_args()
    import torch

    most = max(args.pp_sizes) * args.tp_size
    if args.device == "cuda" and torch.cuda.device_count() < most:
        raise SystemExit(f"needs {most} GPUs, found {torch.cuda.device_count()}")
    ok = True
    if "equality" in args.stages:
        ok = stage_equality(args.pp_sizes, args.tp_size, args.device)
    if "throughput" in args.stages:
        run_throughput(1, 1)
        for pp_size in args.pp_sizes:
            run_throughput(pp_size, args.tp_size)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
