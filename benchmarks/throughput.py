"""Offline throughput (vLLM's `bench throughput` semantics), optionally against transformers.

The engine's side is timed and counted by `pagedserve bench throughput`'s code
(pagedserve/entrypoints/bench/throughput.py), which also has vLLM's datasets (random with
--random-range-ratio, ShareGPT) and --save-result; this script adds the presets (dummy
weights of published architectures), "LOW:HIGH" lengths and the transformers baselines.

Random token prompts, fixed or uniformly random input/output lengths, `ignore_eos`. Prints a
short table and one JSON line. With --hf-sequential it also runs transformers `generate` one
request at a time on the same model (the classic baseline); with --hf-batch, transformers
`generate` on the whole batch at once (static batching, left padding).

  python benchmarks/throughput.py --preset tiny-llama-4m --num-prompts 32 --input-len 64 \
      --output-len 64 --device cpu --hf-sequential
  python benchmarks/throughput.py --preset llama-3.1-8b --quantization gptq   # 4-bit g128
  python benchmarks/throughput.py --preset mixtral-8x7b --tensor-parallel-size 2 \
      --enable-expert-parallel   # MoE: whole experts per rank
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from benchmarks.presets import (  # noqa: E402
    PRESETS,
    add_quantization_args,
    materialize,
    quantization_config,
)


def parse_len(text: str) -> tuple[int, int]:
    """ "128" -> (128, 128); "100:1024" -> uniform in [100, 1024]."""
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def make_requests(
    num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        requests.append(([rng.randrange(10, vocab - 10) for _ in range(n_in)], n_out))
    return requests


def run_pagedserve(args: argparse.Namespace, model: str, requests: list) -> dict:
    from pagedserve import LLM, SamplingParams
    from pagedserve.entrypoints.bench.datasets import SampleRequest
    from pagedserve.entrypoints.bench.throughput import (
        print_throughput,
        run_generate,
        throughput_metrics,
    )

    kwargs = dict(
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs,
        skip_tokenizer_init=args.skip_tokenizer_init,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    for name in (
        "max_model_len",
        "max_num_batched_tokens",
        "kv_cache_memory_bytes",
        "attention_backend",
        "quantization",
        "kv_cache_dtype",
        "model_impl",
    ):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    llm = LLM(model, **kwargs)
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        for _, n in requests
    ]
    run_generate(llm, prompts[:4], params[:4])  # warm-up
    elapsed, outputs = run_generate(llm, prompts, params)
    samples = [SampleRequest(ids, len(ids), n) for ids, n in requests]
    metrics = throughput_metrics(samples, outputs, elapsed)
    num_out = metrics["total_output_tokens"]
    assert num_out == sum(n for _, n in requests), "ignore_eos must fix output lengths"
    llm.llm_engine.shutdown()
    print_throughput(metrics)  # `pagedserve bench throughput`'s lines
    return {"seconds": elapsed, "output_tokens": num_out}


def load_hf(args: argparse.Namespace, model: str):  # type: ignore[no-untyped-def]
    import torch
    import transformers

    device = torch.device(
        "cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    )
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    dtype = dtypes.get(args.dtype, torch.float16 if device.type == "cuda" else torch.float32)
    config = transformers.AutoConfig.from_pretrained(model)
    if args.load_format == "dummy":
        with device:  # random init on the device: an 8B model takes minutes on the CPU
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    hf = hf.to(device).eval()
    hf.generation_config.eos_token_id = None
    return hf, device


def _sync(device) -> None:  # type: ignore[no-untyped-def]
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _free_gpu_memory() -> None:
    """Let the next engine in this process have the GPU memory of the previous one."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_hf(args: argparse.Namespace, model: str, requests: list, batched: bool) -> dict:
    """transformers `generate`, one request at a time or the whole batch (left padding)."""
    import torch

    hf, device = load_hf(args, model)

    def generate(batch: list) -> int:
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (prompt, _) in enumerate(batch):  # left padding
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        n_out = max(n for _, n in batch)
        with torch.no_grad():
            hf.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=n_out,
                min_new_tokens=n_out,
                do_sample=False,
                pad_token_id=0,
            )
        return sum(n for _, n in batch)  # tokens that were asked for

    generate(requests[:1])  # warm-up
    _sync(device)
    start = time.perf_counter()
    num_out = generate(requests) if batched else sum(generate([r]) for r in requests)
    _sync(device)
    return {"seconds": time.perf_counter() - start, "output_tokens": num_out}


def run_hf_continuous(args: argparse.Namespace, model: str, requests: list) -> dict:
    """transformers' own continuous batching (`generate_batch`), greedy, one output length."""
    import transformers

    hf, device = load_hf(args, model)
    max_out = max(n for _, n in requests)
    config = transformers.GenerationConfig(
        max_new_tokens=max_out, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    hf.generate_batch(inputs=[requests[0][0]], generation_config=config)  # warm-up
    _sync(device)
    start = time.perf_counter()
    outputs = hf.generate_batch(inputs=[ids for ids, _ in requests], generation_config=config)
    _sync(device)
    seconds = time.perf_counter() - start
    num_out = sum(len(o.generated_tokens) for o in outputs.values())
    return {"seconds": seconds, "output_tokens": num_out}


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model and workload flags that `throughput.py` and `step_profile.py` share."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="local HF model folder")
    source.add_argument("--preset", choices=sorted(PRESETS), help="architecture, dummy weights")
    parser.add_argument("--input-len", type=parse_len, default=(128, 128))
    parser.add_argument("--output-len", type=parse_len, default=(128, 128))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--enforce-eager", action="store_true")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--kv-cache-memory-bytes", type=int)
    parser.add_argument("--attention-backend")
    parser.add_argument("--kv-cache-dtype", help="auto (default), fp8, fp8_e4m3 or fp8_e5m2")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: whole experts per tensor-parallel rank (the engine's option)",
    )
    parser.add_argument(
        "--model-impl",
        choices=("auto", "pagedserve", "vllm", "transformers"),
        help="auto (default: native when we have the architecture), pagedserve or transformers",
    )
    add_quantization_args(parser)
    parser.add_argument(
        "--hf-sequential",
        action="store_true",
        help="also run transformers generate one request at a time",
    )
    parser.add_argument(
        "--hf-batch",
        action="store_true",
        help="also run transformers generate on the whole batch at once",
    )
    parser.add_argument(
        "--hf-continuous",
        action="store_true",
        help="also run transformers generate_batch (its continuous batching)",
    )
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    if args.preset:
        model = str(materialize(args.preset, Path(tmp.name), quantization_config(args)))
        args.load_format, args.skip_tokenizer_init = "dummy", True
    else:
        from pagedserve.config import DEFAULT_MODEL

        model, args.skip_tokenizer_init = args.model or DEFAULT_MODEL, False
    config = json.loads((Path(model) / "config.json").read_text())
    requests = make_requests(
        args.num_prompts, args.input_len, args.output_len, config["vocab_size"], args.seed
    )
    results = {"pagedserve": run_pagedserve(args, model, requests)}
    _free_gpu_memory()
    if args.hf_sequential:
        results["transformers (sequential)"] = run_hf(args, model, requests, batched=False)
    if args.hf_batch:
        results["transformers (static batch)"] = run_hf(args, model, requests, batched=True)
    if args.hf_continuous:
        results["transformers (generate_batch)"] = run_hf_continuous(args, model, requests)
    num_in = sum(len(ids) for ids, _ in requests)
    print(f"{'engine':<30}{'seconds':>10}{'req/s':>10}{'out tok/s':>12}{'total tok/s':>13}")
    for name, r in results.items():
        print(
            f"{name:<30}{r['seconds']:>10.2f}{len(requests) / r['seconds']:>10.2f}"
            f"{r['output_tokens'] / r['seconds']:>12.1f}"
            f"{(num_in + r['output_tokens']) / r['seconds']:>13.1f}"
        )
    ours = results["pagedserve"]["seconds"]
    for name, r in results.items():
        if name != "pagedserve":
            print(f"speed-up over {name}: {r['seconds'] / ours:.1f}x")
    commit = git_commit()
    print(
        json.dumps(
            {
                "benchmark": "throughput",
                "model": args.preset or model,
                "commit": commit,
                "num_prompts": len(requests),
                "input_len": args.input_len,
                "output_len": args.output_len,
                "device": args.device,
                "dtype": args.dtype,
                "quantization": quantization_config(args) or args.quantization,
                "kv_cache_dtype": args.kv_cache_dtype or "auto",
                "model_impl": args.model_impl or "auto",
                "tensor_parallel_size": args.tensor_parallel_size,
                "enable_expert_parallel": args.enable_expert_parallel,
                "results": {
                    k: {**v, "output_tok_s": v["output_tokens"] / v["seconds"]}
                    for k, v in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
