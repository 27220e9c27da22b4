"""Swap space (`preemption_mode="swap"`, `swap_space`) and the prefix cache's CPU tier
(`kv_offload_gb`) end to end on a real model on the CPU: greedy outputs equal unconstrained
runs, and the counters show that the blocks were copied (not recomputed)."""

import random
from typing import Any

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request
from tests.engine.test_kv_cache_features import MODEL, make_llm, story_prompts

TIGHT: dict[str, Any] = dict(
    max_num_batched_tokens=8, num_gpu_blocks_override=18, max_num_seqs=8, max_model_len=128
)
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def mixed_prompts(llm: LLM) -> list[list[int]]:
    """4 prompts sharing a 48-token prefix (prefix hits), 4 of 60 random tokens."""
    rng = random.Random(1)
    return story_prompts(llm, 4) + [[rng.randrange(10, 500) for _ in range(60)] for _ in range(4)]


def token_ids(outputs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def ample() -> LLM:
    return make_llm(num_gpu_blocks_override=256)


@pytest.fixture(scope="module")
def expected(ample: LLM) -> list[list[list[int]]]:
    prompts = mixed_prompts(ample)
    return token_ids(ample.generate([{"prompt_token_ids": p} for p in prompts], PARAMS))


def record_prefill_swaps(llm: LLM) -> list[bool]:
    """Wrap the engine's `swap_out`: per call, whether the request was mid-prefill."""
    kv_cache: KVCacheManager = llm.llm_engine.kv_cache
    calls: list[bool] = []
    swap_out = kv_cache.swap_out

    def recording(request: Request) -> bool:
        calls.append(request.num_computed_tokens < request.num_prompt_tokens)
        return swap_out(request)

    kv_cache.swap_out = recording  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize(
    "options",
    [{}, {"async_scheduling": True}, {"enable_prefix_caching": False}],
    ids=["sync", "async", "no-prefix-caching"],
)
def test_swapped_requests_resume_without_recomputing(
    ample: LLM, expected: list[list[list[int]]], options: dict[str, Any]
) -> None:
    """A tiny cache and an 8-token budget (chunked prefill) preempt requests, some mid-prefill;
    with swap space each resumes from its computed tokens: fewer tokens are fed to the model
    than with recomputation, and the outputs are the unconstrained run's."""
    llm = make_llm(**TIGHT, preemption_mode="swap", swap_space=0.01, **options)
    mid_prefill = record_prefill_swaps(llm)
    prompts = mixed_prompts(llm)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert token_ids(got) == expected
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_swap_outs_total == scheduler.num_preemptions_total > 0
    assert scheduler.num_swap_ins_total == scheduler.num_swap_outs_total
    assert any(mid_prefill) and not all(mid_prefill)
    stats = llm.llm_engine.engine_core.stats()
    assert stats.num_swap_outs_total == scheduler.num_swap_outs_total
    kv_cache = llm.llm_engine.kv_cache
    assert kv_cache.num_free_blocks == 18 and not kv_cache.swapped
    kv_cache.check_invariants()
    recompute = make_llm(**TIGHT, **options)
    recompute.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert recompute.llm_engine.scheduler.num_preemptions_total > 0
    # Recomputation feeds the preempted tokens again; swapping feeds each token once.
    fed = scheduler.num_scheduled_tokens_total
    assert fed < recompute.llm_engine.scheduler.num_scheduled_tokens_total


def test_full_swap_space_falls_back_to_recompute(expected: list[list[list[int]]]) -> None:
    block_gib = 2**-30
    llm = make_llm(**TIGHT, preemption_mode="swap", swap_space=block_gib)  # not one block
    engine = llm.llm_engine
    assert engine.kv_cache.swap_space.num_blocks == 0
    llm = make_llm(
        **TIGHT,
        preemption_mode="swap",
        swap_space=3 * engine.engine_core.executor.block_bytes * block_gib,
    )
    assert llm.llm_engine.kv_cache.swap_space.num_blocks == 3
    prompts = mixed_prompts(llm)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert token_ids(got) == expected
    scheduler = llm.llm_engine.scheduler
    assert 0 < scheduler.num_swap_outs_total < scheduler.num_preemptions_total
    llm.llm_engine.kv_cache.check_invariants()


def test_swapped_siblings_and_fp8_cache(ample: LLM) -> None:
    """n > 1 siblings share prompt blocks; an fp8 cache is copied byte for byte (its scales
    are per layer): both equal their runs without preemption."""
    prompts = story_prompts(ample, 3)
    params = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)
    for options in ({}, {"kv_cache_dtype": "fp8"}):
        roomy = make_llm(**options)
        want = token_ids(roomy.generate([{"prompt_token_ids": p} for p in prompts], params))
        llm = make_llm(
            num_gpu_blocks_override=12,
            max_model_len=128,
            max_num_batched_tokens=16,
            preemption_mode="swap",
            swap_space=0.01,
            **options,
        )
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert token_ids(got) == want, options
        assert llm.llm_engine.scheduler.num_swap_outs_total > 0
        assert llm.llm_engine.kv_cache.num_free_blocks == 12
        llm.llm_engine.kv_cache.check_invariants()


def test_evicted_prefix_comes_back_from_the_cpu_tier() -> None:
    """A 112-token prefix, then other prompts that evict it from a 12-block GPU cache, then the
    prefix again: its 7 blocks come back from the CPU tier (cached tokens, counters), and the
    output equals a run without the tier (which recomputes them)."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(n)]

    prefix = tokens(112)
    prompts = [prefix + tokens(5), *(tokens(100) for _ in range(4)), prefix + tokens(7)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for options in ({"kv_offload_gb": 0.01}, {}):
        llm = make_llm(num_gpu_blocks_override=12, max_model_len=128, **options)
        runs.append([llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts])
        if options:
            tier = llm
    with_tier, without = runs
    assert [o.num_cached_tokens for o in with_tier] == [0, 0, 0, 0, 0, 112]
    assert [o.num_cached_tokens for o in without] == [0] * 6
    assert token_ids(with_tier) == token_ids(without)
    stats = tier.llm_engine.engine_core.stats()
    assert stats.cpu_prefix_cache_hits == stats.prefix_cache_hits == 112
    tier.llm_engine.kv_cache.check_invariants()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"swap_space": -1.0}, "swap_space must be >= 0 GiB, got -1.0"),
        ({"kv_offload_gb": -0.5}, "kv_offload_gb must be >= 0 GiB, got -0.5"),
        (
            {"preemption_mode": "swap", "swap_space": 0},
            "preemption_mode 'swap' needs swap_space > 0 GiB, got 0",
        ),
        ({"preemption_mode": "swapped"}, "preemption_mode must be one of"),
        ({"kv_offload_gb": 1.0, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
        (
            {"preemption_mode": "swap", "swap_space": 2.0**40},
            r"swap_space \(1099511627776.00 GiB per GPU x 1\) exceed the host memory available",
        ),
        ({"kv_offload_gb": 2.0**40}, r"kv_offload_gb \(.*\) exceed .*; lower kv_offload_gb"),
        (
            {"preemption_mode": "swap", "swap_space": 2.0**39, "kv_offload_gb": 2.0**39},
            "; lower swap_space or kv_offload_gb",
        ),
    ],
)
def test_start_up_errors_name_the_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=MODEL, **options).create_engine_config()


def test_swap_space_is_not_checked_or_taken_without_swap_mode() -> None:
    config = EngineArgs(model=MODEL, swap_space=2.0**40).create_engine_config()
    assert config.cache_config.swap_space == 2.0**40
    llm = make_llm(num_gpu_blocks_override=18)  # the 4 GiB default, recompute
    assert llm.llm_engine.engine_core.executor.worker.runner.cpu_kv_cache is None
    assert llm.llm_engine.kv_cache.swap_space.num_blocks == 0


def test_prompt_logprobs_of_a_chunk_in_flight_when_its_request_is_swapped_out(
    ample: LLM,
) -> None:
    """Async scheduling swaps out requests mid-prefill while a chunk of theirs is in flight:
    that chunk's prompt logprobs still reach the output (the request resumes after it, so
    nothing scores those positions again); the prompt logprobs equal the unconstrained run's."""
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(ample)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)

    def scores(outputs: list[Any]) -> tuple[list[list[list[int]]], list[float]]:
        """Each prompt position's token ids, and all their logprobs flattened."""
        entries = [sorted(e.items()) for o in outputs for e in o.prompt_logprobs[1:]]
        tokens = [[sorted(e) for e in o.prompt_logprobs[1:]] for o in outputs]
        return tokens, [p.logprob for entry in entries for _, p in entry]

    expected_tokens, expected_logprobs = scores(ample.generate(prompts, params, use_tqdm=False))
    llm = make_llm(**TIGHT, preemption_mode="swap", swap_space=0.01, async_scheduling=True)
    mid_prefill = record_prefill_swaps(llm)
    tokens, logprobs = scores(llm.generate(prompts, params, use_tqdm=False))
    assert tokens == expected_tokens  # every position scored, once, in order
    # Other batch shapes sum in another order: float32 rounding, not other values.
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-3)
    assert any(mid_prefill)


def test_host_memory_check_counts_every_data_parallel_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each data-parallel core holds its own swap space and CPU tier: 2 GiB per GPU on two
    cores of one rank each need 4 GiB of the host's 3."""
    monkeypatch.setattr("pagedserve.config_checks.host_memory_bytes", lambda: 3 << 30)
    options: dict[str, Any] = dict(model=MODEL, preemption_mode="swap", swap_space=2.0)
    EngineArgs(**options).create_engine_config()  # one core: 2 GiB fit
    with pytest.raises(ValueError, match=r"swap_space \(2.00 GiB per GPU x 2\) exceed"):
        EngineArgs(**options, data_parallel_size=2).create_engine_config()
