"""Async scheduling (step N+1 scheduled and launched before step N's tokens are applied) gives
exactly the outputs of one-step-at-a-time scheduling, on a real model, on the CPU."""

from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.llm_engine import LLMEngine

SHARED = Path(__file__).resolve().parents[3] / "shared"
MODEL = str(SHARED / "models" / "tinystories-656k")
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They",
    "One day, a big bird",
    "Sam had a red ball",
    "Mom said",
    "The sun was hot and",
    "Once upon a time, there was a little girl named Lily.",
]


def make_llm(async_scheduling: bool, **kwargs: object) -> LLM:
    options: dict[str, object] = dict(
        dtype="float32",
        device="cpu",
        max_model_len=128,
        block_size=4,
        num_gpu_blocks_override=32,  # 128 tokens for 8 requests: forces preemption
        max_num_batched_tokens=24,  # chunks the longer prompts
        async_scheduling=async_scheduling,
    )
    options.update(kwargs)
    llm = LLM(MODEL, **options)  # type: ignore[arg-type]
    assert llm.llm_engine.engine_core.async_scheduling == async_scheduling
    return llm


def summary(llm: LLM, params: list[SamplingParams]) -> list[list[tuple]]:
    """Per request, per sample: text, tokens, finish and stop reasons, and the logprobs as
    (token id, rank, decoded text) and, last, their values. Compare with `assert_same`."""
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        [
            (
                c.text,
                c.token_ids,
                c.finish_reason,
                c.stop_reason,
                None
                if c.logprobs is None
                else [
                    [(t, lp.rank, lp.decoded_token) for t, lp in sorted(d.items())]
                    for d in c.logprobs
                ],
                None
                if c.logprobs is None
                else [lp.logprob for d in c.logprobs for _, lp in sorted(d.items())],
            )
            for c in o.outputs
        ]
        for o in outputs
    ]


def assert_same(got: list[list[tuple]], expected: list[list[tuple]]) -> None:
    """Everything equal but the logprob values, which agree within 1e-5: the two engines
    batch different requests together in a step, and a float32 CPU matmul's rounding can
    depend on the batch's row count (seen: differences of 2e-6)."""
    assert [[c[:-1] for c in o] for o in got] == [[c[:-1] for c in o] for o in expected]
    for o, e in zip(got, expected, strict=True):
        for c, ce in zip(o, e, strict=True):
            assert (c[-1] is None) == (ce[-1] is None)
            if c[-1] is not None:
                assert c[-1] == pytest.approx(ce[-1], abs=1e-5, rel=0)


def test_greedy_equals_sync_through_preemption_and_stops() -> None:
    """Stop tokens (a request stopping at step N is already in step N+1), length caps of all
    sizes, chunked prefill and preemption by recompute with a token in flight."""
    sync = make_llm(False)
    comma = sync.get_tokenizer().convert_tokens_to_ids(",▁")  # frequent in these stories
    params = [
        SamplingParams(temperature=0, max_tokens=20 + 12 * i, ignore_eos=i % 2 == 1)
        if i % 2
        else SamplingParams(temperature=0, max_tokens=20 + 12 * i, stop_token_ids=[comma])
        for i in range(len(PROMPTS))
    ]
    expected = summary(sync, params)
    llm = make_llm(True)
    assert_same(summary(llm, params), expected)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert any(o[0][3] == comma for o in expected), "some request should stop at a token"


def test_sampling_features_equal_sync() -> None:
    """Seeded sampling, parallel sampling, logprobs, stop strings and
    min_tokens run ahead; penalties and bad words make steps wait (no placeholders for
    them); every output equals the one-step-at-a-time engine's."""
    kinds = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=30, n=3, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, stop=[" the", "."]),
        SamplingParams(temperature=1.0, seed=7, top_p=0.9, top_k=20, max_tokens=25),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=15, logprobs=1),
        SamplingParams(temperature=0.7, seed=3, max_tokens=30, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=5, max_tokens=30, n=2),
        SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=30, bad_words=["the"]),
    ]
    expected = summary(make_llm(False, num_gpu_blocks_override=200), kinds)
    assert_same(summary(make_llm(True, num_gpu_blocks_override=200), kinds), expected)


def test_a_step_stays_in_flight_unless_a_request_needs_its_tokens() -> None:
    engine: LLMEngine = make_llm(True, num_gpu_blocks_override=200).llm_engine
    core = engine.engine_core
    plain = SamplingParams(temperature=0.8, seed=1, max_tokens=12, stop=["."], logprobs=1)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, plain)
    while core.scheduler.has_unfinished_requests():
        engine.step()
        assert core._in_flight is not None
    engine.add_request("penalized", PROMPTS[0], SamplingParams(max_tokens=8, presence_penalty=1))
    while engine.has_unfinished_requests():
        engine.step()
        assert core.scheduler.can_schedule_ahead == ("penalized" not in core.scheduler.requests)


def test_abort_with_a_step_in_flight_frees_everything() -> None:
    llm = make_llm(True, num_gpu_blocks_override=200)
    engine: LLMEngine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    for _ in range(6):
        engine.step()
    assert engine.engine_core._in_flight is not None
    engine.abort_request(["1", "4", "7"])
    finished: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = len(output.outputs[0].token_ids)
    assert set(finished) == {"0", "2", "3", "5", "6"}
    assert all(n == 40 for n in finished.values())
    kv_cache = engine.engine_core.kv_cache
    kv_cache.check_invariants()
    assert kv_cache.usage == 0


def test_reused_request_id_gets_no_stale_token() -> None:
    """An id reused right after an abort, while the aborted request's step is in flight:
    that step's token for the old request must not reach the new one."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        engine: LLMEngine = make_llm(async_scheduling, num_gpu_blocks_override=200).llm_engine
        engine.add_request("a", {"prompt_token_ids": [1, 500, 600, 700]}, greedy)
        for _ in range(4):
            engine.step()
        engine.abort_request("a")
        short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": [1, 20, 30, 40, 50]}, short)
        final = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    final = output.outputs[0].token_ids
        engine.engine_core.kv_cache.check_invariants()
        results.append(final)
    assert results[0] == results[1]
    assert results[1] is not None and len(results[1]) == 5


def test_follow_up_prompt_hits_the_block_the_last_token_filled() -> None:
    """Multi-turn reuse (next prompt = prompt + output): the block completed by the last
    token fed, a placeholder when it was scheduled, is in the prefix-cache index too."""
    prompt = [1, 11, 12, 13, 14, 15, 16]  # 7 tokens; blocks of 4
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    hits = []
    for async_scheduling in (False, True):
        llm = make_llm(async_scheduling, num_gpu_blocks_override=200)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        follow = prompt + out.outputs[0].token_ids + [20, 21, 22, 23]
        again = llm.generate({"prompt_token_ids": follow}, params, use_tqdm=False)[0]
        hits.append(again.num_cached_tokens)
    assert hits == [8, 8]  # 7 prompt tokens + the first output fed = 2 full blocks
