"""Swap space and the prefix cache's CPU tier on a GPU: pinned host blocks, copies on the
device's stream under async scheduling and CUDA graphs, fp8 caches copied byte for byte."""

import random
from typing import Any

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import DEFAULT_MODEL
from tests.gpu.test_gpu_end_to_end import num_equal_but_near_ties

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)


def prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 500) for _ in range(48)]
    token_lists = [prefix + [rng.randrange(3, 500) for _ in range(i + 2)] for i in range(4)]
    token_lists += [[rng.randrange(3, 500) for _ in range(60)] for _ in range(4)]
    return [{"prompt_token_ids": t} for t in token_lists]


def run(**kwargs: Any) -> tuple[LLM, list[Any]]:
    options: dict[str, Any] = dict(dtype="float32", device="cuda", max_model_len=128, block_size=16)
    options.update(kwargs)
    llm = LLM(DEFAULT_MODEL, **options)
    return llm, [o.outputs[0] for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_swap_on_the_gpu_equals_an_ample_cache(kv_cache_dtype: str) -> None:
    _, expected = run(num_gpu_blocks_override=256, kv_cache_dtype=kv_cache_dtype)
    llm, got = run(
        num_gpu_blocks_override=18,
        max_num_batched_tokens=8,
        max_num_seqs=8,
        preemption_mode="swap",
        swap_space=0.01,
        kv_cache_dtype=kv_cache_dtype,
    )
    scheduler = llm.llm_engine.scheduler
    assert llm.llm_engine.engine_core.async_scheduling
    assert llm.llm_engine.engine_core.executor.worker.runner.cpu_kv_cache.chunks[0].is_pinned()
    assert scheduler.num_swap_outs_total == scheduler.num_preemptions_total > 0
    assert scheduler.num_swap_ins_total == scheduler.num_swap_outs_total
    assert num_equal_but_near_ties(got, expected, 1e-3) >= 6


def test_cpu_tier_on_the_gpu() -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(112)]
    token_lists = [prefix + [5, 6, 7]]
    token_lists += [[rng.randrange(3, 500) for _ in range(100)] for _ in range(4)]
    token_lists += [prefix + [8, 9]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outputs = []
    for options in ({"kv_offload_gb": 0.01}, {}):
        llm = LLM(DEFAULT_MODEL, dtype="float32", device="cuda", max_model_len=128,
                  num_gpu_blocks_override=12, **options)  # fmt: skip
        outputs.append(
            [llm.generate({"prompt_token_ids": t}, params, use_tqdm=False)[0] for t in token_lists]
        )
        if options:
            assert llm.llm_engine.engine_core.stats().cpu_prefix_cache_hits == 112
    assert outputs[0][-1].num_cached_tokens == 112
    assert (
        num_equal_but_near_ties(
            [o.outputs[0] for o in outputs[0]], [o.outputs[0] for o in outputs[1]], 1e-3
        )
        >= 5
    )


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn"])
def test_copies_are_ordered_by_the_stream_without_host_waits(dtype: str) -> None:
    """Out, overwrite on the device, back in, with no synchronization between: the stream
    orders the DMAs and the kernels, so the blocks come back with their first bytes."""
    import torch

    from pagedserve.worker.cpu_kv_cache import CpuKVCache

    torch.manual_seed(0)
    caches = [torch.randn(2, 64, 16, 4, 64, device="cuda").to(getattr(torch, dtype))]
    original = caches[0].clone()
    cpu = CpuKVCache(caches, num_blocks=32)
    assert all(chunk.is_pinned() for chunk in cpu.chunks)
    pairs = [(gpu_id, 31 - k) for k, gpu_id in enumerate(range(0, 64, 2))]  # CPU ids 31..0
    cpu.swap(caches, pairs, [])
    caches[0].view(torch.uint8).fill_(7)
    cpu.swap(caches, [], [(cpu_id, gpu_id + 1) for gpu_id, cpu_id in pairs])
    torch.cuda.synchronize()
    for gpu_id, _ in pairs:
        assert torch.equal(
            caches[0][:, gpu_id + 1].view(torch.uint8), original[:, gpu_id].view(torch.uint8)
        )
