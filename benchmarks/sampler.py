"""Sampler micro-benchmark: one decode step's sampling for a batch of mixed requests.

Times `SamplingStateManager.build_metadata` (host side: gathering each row's parameters) and
`Sampler.forward` (the tensor work) separately, on random logits of a real vocabulary size
(Gaussian, standard deviation --logit-std: peaked like a language model's). Requests cycle
through eight kinds: greedy, temperature, top-p, top-k, min-p + seed, greedy + penalties,
top-k + top-p + seed + logprobs, logit_bias + min_tokens. Prints one JSON line per mix.

  python benchmarks/sampler.py --num-requests 256 --vocab-size 32000 --device cpu
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.step import ScheduledRequest  # noqa: E402
from pagedserve.worker.sampler import Sampler  # noqa: E402
from pagedserve.worker.sampling_metadata import SamplingStateManager  # noqa: E402

EOS = 2


def mixed_params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=0.7, top_k=50),
        dict(temperature=1.0, min_p=0.05, seed=i),
        dict(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=0.9, top_k=100, top_p=0.95, seed=i, logprobs=5),
        dict(
            temperature=1.0,
            logit_bias={t: 1.5 for t in range(100, 110)},
            min_tokens=200,
            max_tokens=256,
        ),
    ]
    return SamplingParams(eos_token_ids=(EOS,), **kinds[i % len(kinds)])  # type: ignore[arg-type]


MIXES = {
    "mixed": mixed_params,
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature": lambda i: SamplingParams(temperature=0.8),
}


def setup(mix: str, args: argparse.Namespace, device: torch.device) -> SamplingStateManager:
    """Register the requests, each with a prompt and some generated tokens already fed."""
    generator = torch.Generator().manual_seed(0)
    manager = SamplingStateManager(args.vocab_size, device)
    for i in range(args.num_requests):
        prompt = torch.randint(args.vocab_size, (args.prompt_len,), generator=generator).tolist()
        outputs = torch.randint(args.vocab_size, (args.output_len,), generator=generator).tolist()
        request_id = str(i)
        manager.add_request(request_id, MIXES[mix](i), prompt)
        manager.record_fed_tokens([ScheduledRequest(request_id, prompt + outputs, 0, [], True)])
    return manager


def bench(mix: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    manager = setup(mix, args, device)
    request_ids = [str(i) for i in range(args.num_requests)]
    seq_lens = [args.prompt_len + args.output_len] * args.num_requests
    generator = torch.Generator(device).manual_seed(1)
    logits = torch.randn(args.num_requests, args.vocab_size, generator=generator, device=device)
    logits *= args.logit_std
    sampler = Sampler()
    build_ms, forward_ms = [], []
    for i in range(args.warmup + args.iters):
        sync(device)
        start = time.perf_counter()
        metadata = manager.build_metadata(request_ids, seq_lens)
        sync(device)
        built = time.perf_counter()
        sampler.forward(logits.clone(), metadata).sampled_token_ids.tolist()
        done = time.perf_counter()
        if i >= args.warmup:
            build_ms.append((built - start) * 1e3)
            forward_ms.append((done - built) * 1e3)
    total = [b + f for b, f in zip(build_ms, forward_ms, strict=True)]
    return {
        "benchmark": "sampler",
        "mix": mix,
        "device": device_name(device),
        "torch_threads": torch.get_num_threads(),
        "commit": git_commit(),
        "num_requests": args.num_requests,
        "vocab_size": args.vocab_size,
        "iters": args.iters,
        "build_metadata_ms_p50": round(statistics.median(build_ms), 3),
        "forward_ms_p50": round(statistics.median(forward_ms), 3),
        "total_ms_p50": round(statistics.median(total), 3),
        "total_ms_mean": round(statistics.fmean(total), 3),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--logit-std", type=float, default=4.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--mix", choices=[*MIXES, "all"], default="all")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for mix in MIXES if args.mix == "all" else [args.mix]:
        print(json.dumps(bench(mix, args)), flush=True)


if __name__ == "__main__":
    main()
