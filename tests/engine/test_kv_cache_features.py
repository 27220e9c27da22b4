"""Prefix caching, chunked prefill, preemption and parallel sampling, end to end on a real model."""

from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.llm_engine import LLMEngine

SHARED = Path(__file__).resolve().parents[3] / "shared"
MODEL = str(SHARED / "models" / "tinystories-656k")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make_llm(**kwargs: object) -> LLM:
    options = dict(
        dtype="float32", device="cpu", max_model_len=256, block_size=16, num_gpu_blocks_override=64
    )
    options.update(kwargs)
    return LLM(MODEL, **options)  # type: ignore[arg-type]


def story_prompts(llm: LLM, num: int) -> list[list[int]]:
    """Prompts sharing a 3-block (48-token) prefix, each with its own tail."""
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.encode(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in "
        "the park with her friends. One day, she saw a big red ball near the old tree and "
        "ran to get it. Her friend Tom wanted the ball too. They both pulled and pulled until "
        "the ball went up into the sky and landed in the pond. The ducks swam to the ball"
    )
    assert len(prefix) >= 48
    prefix = prefix[:48]
    tails = [" she ran", " the dog", " her mom said", " a bird sang", " Tom came", " it rained"]
    return [
        prefix + tokenizer.encode(tails[i % len(tails)], add_special_tokens=False)
        for i in range(num)
    ]


def test_second_request_reuses_the_shared_prefix() -> None:
    llm = make_llm()
    first, second = story_prompts(llm, 2)
    scheduler = llm.llm_engine.scheduler
    out1 = llm.generate({"prompt_token_ids": first}, GREEDY, use_tqdm=False)[0]
    before = scheduler.num_scheduled_tokens_total
    out2 = llm.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    computed = scheduler.num_scheduled_tokens_total - before
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == 48
    # 24 outputs: 23 fed back (the last is never computed) + the uncached prompt tail.
    assert computed == len(second) - 48 + 23

    no_cache = make_llm(enable_prefix_caching=False)
    expected = no_cache.generate(
        [{"prompt_token_ids": p} for p in (first, second)], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in expected] == [
        out1.outputs[0].token_ids,
        out2.outputs[0].token_ids,
    ]
    assert expected[1].num_cached_tokens == 0


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    llm = make_llm()
    prompt = story_prompts(llm, 1)[0][:48]  # exactly 3 blocks
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # the block holding the last token is recomputed
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_concurrent_shared_prefix_equals_sequential() -> None:
    llm = make_llm()
    prompts = story_prompts(llm, 6)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    fresh = make_llm(enable_prefix_caching=False)
    one_by_one = [
        fresh.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts
    ]
    assert [o.outputs[0].token_ids for o in together] == [
        o.outputs[0].token_ids for o in one_by_one
    ]
    assert sum(o.num_cached_tokens for o in together) > 0


def test_tiny_budget_and_cache_equal_ample_ones() -> None:
    ample = make_llm(num_gpu_blocks_override=256)
    llm = make_llm(
        max_num_batched_tokens=8, num_gpu_blocks_override=18, max_num_seqs=8, max_model_len=128
    )
    prompts = story_prompts(llm, 8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = ample.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert llm.llm_engine.kv_cache.num_free_blocks == 18
    llm.llm_engine.kv_cache.check_invariants()


def peak_blocks(engine: LLMEngine) -> int:
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv_cache.block_pool.num_blocks - engine.kv_cache.num_free_blocks)
    return peak


def test_parallel_sampling_shares_prompt_blocks() -> None:
    llm = make_llm()
    prompt = story_prompts(llm, 1)[0]  # 3 full blocks + a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("n4", {"prompt_token_ids": prompt}, params)
    shared = peak_blocks(engine)
    separate = make_llm(enable_prefix_caching=False).llm_engine
    for i in range(4):
        separate.add_request(
            str(i),
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True),
        )
    unshared = peak_blocks(separate)
    assert unshared == 4 * 4 and shared == 3 + 4  # the 3 full prompt blocks are held once
    assert engine.kv_cache.num_free_blocks == 64


def test_seeded_n_is_reproducible_and_best_of_picks_the_most_likely() -> None:
    llm = make_llm()
    prompt = {"prompt_token_ids": story_prompts(llm, 1)[0]}
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, logprobs=1)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    best = llm.generate(
        prompt,
        SamplingParams(n=2, best_of=4, temperature=1.0, seed=11, max_tokens=10),
        use_tqdm=False,
    )[0]
    ranked = sorted(first.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert best.outputs[0].logprobs is None  # not asked for
    for got, want in zip(best.outputs, ranked, strict=True):
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-5)


def test_parallel_sampling_shares_prompt_blocks_without_prefix_caching() -> None:
    llm = make_llm(enable_prefix_caching=False)
    prompt = story_prompts(llm, 1)[0]  # 3 full blocks + a partial one
    engine = llm.llm_engine
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    engine.add_request("n4", {"prompt_token_ids": prompt}, params)
    assert peak_blocks(engine) == 3 + 4
    # Unrelated requests still share nothing, even with the same prompt.
    for i in range(2):
        engine.add_request(
            str(i),
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True),
        )
    assert peak_blocks(engine) == 2 * 4
    same = make_llm().generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in same.outputs] == [c.token_ids for c in again.outputs]


def test_siblings_share_the_prompt_blocks_with_prefix_caching_off() -> None:
    """n sequences run as n requests of one sharing group: the prompt's full blocks are
    computed once and shared by reference count (in the step they are scheduled in); each
    sequence computes the partly filled last block itself (issue 14: the fork/copy-on-write
    path was no faster, see BENCHMARKS.md)."""
    llm = make_llm(enable_prefix_caching=False)
    prompt = story_prompts(llm, 1)[0]  # 3 full blocks + a partial one
    engine = llm.llm_engine
    block_size = engine.kv_cache.block_size
    num_full = len(prompt) // block_size
    assert num_full == 3 and len(prompt) % block_size
    scheduler = engine.engine_core.scheduler
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    before = scheduler.num_scheduled_tokens_total
    engine.add_request(
        "n3",
        {"prompt_token_ids": prompt},
        SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
    )
    engine.step()  # all three in one step: the full blocks once, the partial one each
    tail = len(prompt) - num_full * block_size
    assert scheduler.num_scheduled_tokens_total - before == len(prompt) + 2 * tail
    used = engine.kv_cache.block_pool.num_blocks - engine.kv_cache.num_free_blocks
    assert used == num_full + 3
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    # Shared blocks hold the right K/V: every greedy sequence equals the single request.
    assert [c.token_ids for c in outputs[0].outputs] == [alone.outputs[0].token_ids] * 3
    assert engine.kv_cache.num_free_blocks == 64
    engine.kv_cache.check_invariants()


def test_siblings_survive_preemption_and_aborts() -> None:
    llm = make_llm(num_gpu_blocks_override=12, max_model_len=128, max_num_batched_tokens=16)
    prompts = story_prompts(llm, 3)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in make_llm().generate(
            [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False
        )
    ]
    params = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected]
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, params)
    engine.abort_request("a")  # both sequences
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, params)
    engine.engine_core.abort_requests(["0_b"])  # one sequence: the other runs on
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.num_free_blocks == 12
    engine.kv_cache.check_invariants()
