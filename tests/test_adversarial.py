"""Adversarial inputs to the offline API and the engine: each case was a bug that crashed the
engine step, leaked requests, or raised something other than a ValueError naming the field."""

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", seed=0)


def _assert_idle(engine: LLMEngine) -> None:
    engine.kv_cache.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert engine.kv_cache.usage == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        # every token banned: only EOS allowed, but EOS is banned before min_tokens
        {"allowed_token_ids": [2], "min_tokens": 2},
        {"allowed_token_ids": [2], "min_tokens": 2, "top_p": 0.5, "seed": 3},
        # the smallest penalties float32 holds (1e-40, 0 there, is now a ValueError) made
        # logits infinite
        {"repetition_penalty": 2e-38},
        {"repetition_penalty": 2e-38, "top_p": 0.5},
        {"repetition_penalty": 2e-38, "min_p": 0.5, "logprobs": 2},
        # a top_p that is 0 in float32 kept no token (index -1: the engine core died)
        {"top_p": 1e-46},
    ],
)
def test_degenerate_distributions_sample_a_real_token(llm: LLM, kwargs: dict) -> None:
    """Used to sample token id == vocab_size (IndexError in the step, the server's engine core
    died) because the softmax of those rows was NaN."""
    params = SamplingParams(max_tokens=3, temperature=1.0, **kwargs)
    [output] = llm.generate("Once upon a time", params, use_tqdm=False)
    vocab_size = llm.llm_engine.input_processor.vocab_size
    assert all(0 <= t < vocab_size for t in output.outputs[0].token_ids)
    _assert_idle(llm.llm_engine)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 2**70}, "top_k"),
        ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
        ({"stop": ["a\ud800"]}, "stop"),
        ({"bad_words": ["\udfff"]}, "bad_words"),
    ],
)
def test_unrepresentable_values_are_refused_at_construction(kwargs: dict, field: str) -> None:
    """Huge ints overflowed the sampler's int64 tables inside the step; lone surrogates could
    not be tokenized or sent to the engine core."""
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)


def test_huge_top_k_and_min_tokens_within_int64_still_work(llm: LLM) -> None:
    params = SamplingParams(max_tokens=2, top_k=2**63 - 1, min_tokens=0)
    [output] = llm.generate("Once", params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2
    _assert_idle(llm.llm_engine)


def test_lone_surrogate_prompt_raises_value_error(llm: LLM) -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.generate("abc\ud800def", SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_idle(llm.llm_engine)


def test_request_id_colliding_with_a_child_id_is_refused() -> None:
    """A request "x" with n=2 runs as engine requests "0_x" and "1_x": a live request named
    "0_x" used to be hijacked (its output lost, both requests leaked forever)."""
    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu"))
    greedy = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("0_x", "Once upon", greedy)
    with pytest.raises(ValueError, match="'0_x'.*already in use"):
        engine.add_request("x", "The dog", SamplingParams(max_tokens=4, n=2))
    engine.add_request("y", "The dog", SamplingParams(max_tokens=4, n=2))
    with pytest.raises(ValueError, match="'1_y'.*already in use"):
        engine.add_request("1_y", "Once upon", greedy)
    engine.abort_request("unknown")
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert sorted(finished) == ["0_x", "y"]
    assert len(finished["y"].outputs) == 2
    engine.abort_request(["0_x", "y"])  # after they finished: ignored
    _assert_idle(engine)


def test_child_seeds_wrap_within_64_bits() -> None:
    from pagedserve.engine.llm_engine import child_requests

    params = SamplingParams(n=3, seed=2**63 - 2, max_tokens=4)
    seeds = [r.sampling_params.seed for r in child_requests("x", [1, 2], params)]
    assert seeds == [2**63 - 2, 2**63 - 1, -(2**63)]
    negative = SamplingParams(n=2, seed=-5, max_tokens=4)
    assert [r.sampling_params.seed for r in child_requests("y", [1], negative)] == [-5, -4]
