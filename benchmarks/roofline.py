"""Decode step time against the memory roofline (MBU), on the GPU.

Runs one request (or --batch-size requests) of --context tokens, then times decode steps two
ways: the model forward alone (CUDA events around the CUDA-graph replay or eager forward,
median), and the whole engine step (host scheduling + inputs + forward + sampling: the wall
clock of --steps back-to-back steps, divided by --steps). The floor is
(weight bytes + KV bytes read) / HBM bandwidth, with the bandwidth measured here by a large
device-to-device copy (bytes read + written). MBU = floor / measured time.

  python benchmarks/roofline.py --preset llama-3.1-8b --context 1024 --batch-size 1
  python benchmarks/roofline.py --preset llama-3.1-8b --context 1024 --batch-size 1 \
      --quantization gptq          # GPTQ 4-bit g128 sym (--quant-* flags change it)

--profile-steps N then profiles N more steps (torch.profiler) and prints the kernels that take
the most device time, per step: where the time above the floor goes.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import (  # noqa: E402
    PRESETS,
    add_quantization_args,
    materialize,
    quantization_config,
)


def measure_copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus written."""
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * num_bytes / times[len(times) // 2]


def main() -> None:
    import torch

    from pagedserve import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="then profile this many steps' kernels"
    )
    parser.add_argument(
        "--model-impl", default="auto", choices=("auto", "pagedserve", "vllm", "transformers")
    )
    add_quantization_args(parser)
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model = str(materialize(args.preset, Path(tmp.name), quantization_config(args)))
    llm = LLM(
        model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.context + 2 * args.steps + args.profile_steps + 8,
        max_num_seqs=max(args.batch_size, 1),
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=0.9,
        quantization=args.quantization,
        model_impl=args.model_impl,
    )
    engine = llm.llm_engine
    runner = engine.engine_core.executor.worker.runner
    params = SamplingParams(
        temperature=0,
        max_tokens=2 * args.steps + args.profile_steps + 6,
        ignore_eos=True,
        detokenize=False,
    )
    for i in range(args.batch_size):
        engine.add_request(str(i), {"prompt_token_ids": [100 + i] * args.context}, params)
    engine.step()  # prefill
    for _ in range(3):  # warm-up decodes
        engine.step()

    # Time the forward alone with CUDA events, by wrapping the graph replay / model call.
    forward_times: list[float] = []
    graphs = runner.cuda_graphs
    target = graphs if graphs is not None else runner.model
    method = "run" if graphs is not None else "forward"
    original = getattr(target, method)

    def timed(*a, **k):  # type: ignore[no-untyped-def]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = original(*a, **k)
        end.record()
        end.synchronize()
        forward_times.append(start.elapsed_time(end) / 1e3)
        return out

    setattr(target, method, timed)
    for _ in range(args.steps):
        engine.step()
    setattr(target, method, original)
    # Then the whole step, back to back without syncs (async scheduling overlaps the host's
    # work for step N+1 with the device's step N, so a per-step sync would hide the gain).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / args.steps

    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    element = torch.tensor([], dtype=runner.model_dtype).element_size()
    per_token_kv = sum(
        2 * layer.num_kv_heads * layer.head_dim * element for layer in runner.attention_layers
    )
    seq_len = args.context + 3 + args.steps
    kv_bytes = args.batch_size * seq_len * per_token_kv
    bandwidth = measure_copy_bandwidth()
    floor = (weight_bytes + kv_bytes) / bandwidth
    step_med = step_s
    fwd_med = sorted(forward_times)[len(forward_times) // 2]
    print(f"GPU: {torch.cuda.get_device_name()}  copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    print(
        f"weights {weight_bytes / 1e9:.2f} GB + KV read {kv_bytes / 1e9:.3f} GB -> floor "
        f"{floor * 1e3:.3f} ms per decode step (batch {args.batch_size}, ~{seq_len} tokens)"
    )
    print(f"{'measured':<34}{'ms':>9}{'MBU':>8}")
    print(f"{'forward (CUDA events)':<34}{fwd_med * 1e3:>9.3f}{floor / fwd_med:>8.1%}")
    print(f"{'whole engine step (wall clock)':<34}{step_med * 1e3:>9.3f}{floor / step_med:>8.1%}")
    profile = None
    if args.profile_steps > 0:
        from benchmarks.step_profile import gpu_window

        def run_steps() -> float:
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                engine.step()
            return time.perf_counter() - t0

        profile = gpu_window(run_steps, top=25)
        per_step = 1e6 / args.profile_steps
        print(
            f"device busy {profile['gpu_busy_s'] * per_step:.1f} us per step, "
            f"{profile['num_kernels'] / args.profile_steps:.0f} kernels per step; top kernels:"
        )
        print(f"{'kernel':<62}{'us/step':>9}{'calls/step':>11}")
        rows = zip(profile["top_kernels_s"], profile["top_kernels_calls"], strict=True)
        for (name, seconds), calls in rows:
            print(f"{name:<62}{seconds * per_step:>9.1f}{calls / args.profile_steps:>11.1f}")
    print(
        json.dumps(
            {
                "benchmark": "roofline",
                "preset": args.preset,
                "model_impl": args.model_impl,
                "quantization": quantization_config(args) or args.quantization,
                "context": args.context,
                "batch_size": args.batch_size,
                "cuda_graphs": graphs is not None,
                "copy_bandwidth_Bps": bandwidth,
                "weight_bytes": weight_bytes,
                "kv_bytes": kv_bytes,
                "floor_s": floor,
                "forward_s": fwd_med,
                "step_s": step_med,
                "mbu_forward": floor / fwd_med,
                "mbu_step": floor / step_med,
                "profile": profile,
            }
        )
    )


if __name__ == "__main__":
    main()
