"""Sampling end to end on the bundled model: penalties, seeds, logprobs, prompt logprobs, token
constraints, output kinds and validation, under chunked prefill, prefix caching and preemption."""

import math
from collections import Counter

import pytest
import torch
import transformers

from pagedserve import LLM, RequestOutputKind, SamplingParams
from pagedserve.config import DEFAULT_MODEL
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput, RequestOutput

PROMPT = "Lily Lily Lily Lily went to the park with Lily"  # repeats a token


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def tight_llm() -> LLM:
    """Prefills chunked to 8 tokens a step, and a KV cache too small for four requests at once:
    running requests get preempted and resumed (with prefix-cache hits on their own blocks)."""
    return LLM(
        dtype="float32",
        device="cpu",
        max_model_len=128,
        block_size=8,
        num_gpu_blocks_override=16,
        max_num_batched_tokens=8,
        max_logprobs=6,
    )


@pytest.fixture(scope="module")
def hf_model() -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)


def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].double()


def penalized(row: torch.Tensor, params: SamplingParams, seen: list[int], outputs: list[int]):
    """vLLM's penalties, one row, from the definitions."""
    row = row.clone()
    for token_id in set(seen) | set(outputs):
        value = row[token_id]
        row[token_id] = (
            value / params.repetition_penalty if value > 0 else (value * params.repetition_penalty)
        )
    for token_id, count in Counter(outputs).items():
        row[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return row


def check_logprobs(
    model: transformers.PreTrainedModel,
    prompt: list[int],
    params: SamplingParams,
    out: CompletionOutput,
) -> None:
    """Every generated position: the engine's logprobs are log-softmax of transformers' logits
    after the penalties and the temperature (1 for greedy), and greedy picks their argmax."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    logits = hf_logits(model, prompt + out.token_ids)
    temperature = 1.0 if params.is_greedy else params.temperature
    for i, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        outputs = out.token_ids[:i]
        row = penalized(logits[len(prompt) - 1 + i], params, prompt, outputs)
        reference = (row / temperature).log_softmax(-1)
        if params.is_greedy:
            assert token_id == int(reference.argmax()), i
        assert token_id in entry
        for candidate, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(reference[candidate]), abs=2e-4)
        assert params.logprobs is not None
        assert set(reference.topk(params.logprobs).indices.tolist()) <= set(entry)
        assert len(entry) in (params.logprobs, params.logprobs + 1)
        rank = int((reference > reference[token_id] + 1e-6).sum()) + 1
        assert entry[token_id].rank == rank


PENALTY_PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, logprobs=5, repetition_penalty=1.8),
    SamplingParams(
        temperature=0, max_tokens=24, logprobs=5, presence_penalty=1.5, frequency_penalty=0.8
    ),
    SamplingParams(
        temperature=0, max_tokens=24, logprobs=5, repetition_penalty=0.7, frequency_penalty=0.5
    ),
    SamplingParams(temperature=0, max_tokens=24, logprobs=5),
]


def test_penalties_match_reference_through_chunking_caching_and_preemption(
    llm: LLM, tight_llm: LLM, hf_model: transformers.PreTrainedModel
) -> None:
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(PROMPT)
    assert Counter(prompt).most_common(1)[0][1] >= 4
    plain = llm.generate([PROMPT] * 4, PENALTY_PARAMS, use_tqdm=False)
    for params, output in zip(PENALTY_PARAMS, plain, strict=True):
        check_logprobs(hf_model, prompt, params, output.outputs[0])
    assert len({tuple(o.outputs[0].token_ids) for o in plain}) == 4  # the penalties matter
    # Again on the tight engine, twice over so that the second round hits the prefix cache.
    before = tight_llm.llm_engine.scheduler.num_preemptions_total
    tight = tight_llm.generate([PROMPT] * 8, PENALTY_PARAMS * 2, use_tqdm=False)
    assert tight_llm.llm_engine.scheduler.num_preemptions_total > before
    for expected, output in zip(plain * 2, tight, strict=True):
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    assert any(o.num_cached_tokens > 0 for o in tight)
    tight_llm.llm_engine.kv_cache.check_invariants()


def test_logprobs_of_a_sampled_request_follow_the_processed_logits(
    llm: LLM, hf_model: transformers.PreTrainedModel
) -> None:
    params = SamplingParams(
        temperature=0.8, top_k=20, repetition_penalty=1.2, seed=3, max_tokens=16, logprobs=4
    )
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    check_logprobs(hf_model, llm.get_tokenizer().encode(PROMPT), params, out)
    assert out.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs or [], strict=True)),
        abs=1e-4,
    )


def mixed_params(seeded: SamplingParams) -> list[SamplingParams]:
    others = [
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=0.9, max_tokens=30, top_p=0.8),
        SamplingParams(temperature=1.2, max_tokens=7, top_k=5, seed=5),
        SamplingParams(temperature=0.7, max_tokens=25, repetition_penalty=1.4),
        SamplingParams(temperature=1.0, max_tokens=12, presence_penalty=1.0, logprobs=3),
        SamplingParams(temperature=0.5, max_tokens=20, min_p=0.1, logit_bias={300: 3.0}),
        SamplingParams(temperature=1.0, max_tokens=18, allowed_token_ids=list(range(250, 400))),
        SamplingParams(temperature=1.0, max_tokens=11, bad_words=["Lily", "park"]),
        SamplingParams(temperature=0.3, max_tokens=5, min_tokens=4, frequency_penalty=0.7),
        SamplingParams(temperature=1.1, max_tokens=22, seed=99, top_k=50, top_p=0.95),
        SamplingParams(temperature=0, max_tokens=14, prompt_logprobs=2),
        SamplingParams(temperature=1.0, max_tokens=6, n=2),
        SamplingParams(temperature=0.6, max_tokens=28),
        SamplingParams(temperature=1.4, max_tokens=17, min_p=0.05, seed=7),
        SamplingParams(temperature=1.0, max_tokens=10),
    ]
    return others[:6] + [seeded] + others[6:]


def test_seeded_request_is_the_same_alone_in_a_mixed_batch_and_in_another_order(
    llm: LLM,
) -> None:
    seeded = SamplingParams(
        temperature=1.0, top_p=0.95, seed=1234, max_tokens=30, repetition_penalty=1.1
    )
    prompt = "Once upon a time"
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    params = mixed_params(seeded)
    prompts = [f"{prompt} {i}" if p is not seeded else prompt for i, p in enumerate(params)]
    assert len(params) == 16
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert batch[6].outputs[0].token_ids == alone
    reversed_batch = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)
    assert reversed_batch[9].outputs[0].token_ids == alone
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.95, seed=1235, max_tokens=30, repetition_penalty=1.1
    )
    assert llm.generate(prompt, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def check_prompt_logprobs(
    model: transformers.PreTrainedModel, output: RequestOutput, num_logprobs: int
) -> None:
    prompt = output.prompt_token_ids
    reference = hf_logits(model, prompt).log_softmax(-1)
    prompt_logprobs = output.prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = prompt_logprobs[position]
        assert entry is not None
        row = reference[position - 1]
        token_id = prompt[position]
        assert entry[token_id].logprob == pytest.approx(float(row[token_id]), abs=2e-4)
        assert entry[token_id].rank == int((row > row[token_id] + 1e-6).sum()) + 1
        top = row.topk(num_logprobs)
        assert set(top.indices.tolist()) <= set(entry)
        assert len(entry) in (num_logprobs, num_logprobs + 1)
        for candidate, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(row[candidate]), abs=2e-4)
            assert logprob.decoded_token is not None


def test_prompt_logprobs_match_transformers_also_after_a_prefix_cache_hit(
    llm: LLM, tight_llm: LLM, hf_model: transformers.PreTrainedModel
) -> None:
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside"
    greedy = SamplingParams(temperature=0, max_tokens=4)
    warm = llm.generate(prompt, greedy, use_tqdm=False)[0]  # fills the prefix cache
    assert len(warm.prompt_token_ids) > 16 and warm.prompt_logprobs is None
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens > 0
    asking = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3, n=2)
    out = llm.generate(prompt, asking, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # every prompt position ran through the model
    check_prompt_logprobs(hf_model, out, 3)
    # Chunked over 8-token steps, beside other requests, some preempted.
    params = [SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=k) for k in (0, 5)]
    outs = tight_llm.generate([prompt, PROMPT] * 2, params * 2, use_tqdm=False)
    for output, k in zip(outs, [0, 5, 0, 5], strict=True):
        check_prompt_logprobs(hf_model, output, k)


def test_prompt_logprobs_come_once_with_delta_outputs(llm: LLM) -> None:
    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0, max_tokens=5, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request("delta-plp", "Once upon a time", params)
    outputs = drain(engine)
    assert outputs[0].prompt_logprobs is not None and len(outputs[0].prompt_logprobs) == 5
    assert all(o.prompt_logprobs == [] for o in outputs[1:])


def drain(engine) -> list[RequestOutput]:  # type: ignore[no-untyped-def]
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_output_kinds(llm: LLM) -> None:
    engine = llm.llm_engine
    base = dict(temperature=0.0, max_tokens=8, logprobs=1)
    for kind in RequestOutputKind:
        engine.add_request(kind.name, "Once upon a time", SamplingParams(**base, output_kind=kind))
    outputs = drain(engine)
    by_kind = {k: [o for o in outputs if o.request_id == k.name] for k in RequestOutputKind}
    final = by_kind[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished
    full = final[0].outputs[0]
    cumulative = by_kind[RequestOutputKind.CUMULATIVE]
    assert len(cumulative) == 8 and cumulative[-1].outputs[0].token_ids == full.token_ids
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 9))
    delta = by_kind[RequestOutputKind.DELTA]
    assert [t for o in delta for t in o.outputs[0].token_ids] == full.token_ids
    assert "".join(o.outputs[0].text for o in delta) == full.text
    assert sum(len(o.outputs[0].logprobs or []) for o in delta) == 8


def test_logit_bias_allowed_token_ids_and_bad_words(llm: LLM) -> None:
    prompt = "Once upon a time"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[
        0
    ].outputs[0]
    assert "Lily" in base.text
    biased = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=6, logit_bias={"300": 100}), use_tqdm=False
    )
    assert biased[0].outputs[0].token_ids == [300] * 6
    allowed = [261, 262, 300, 301]
    out = llm.generate(
        prompt,
        SamplingParams(temperature=1.0, max_tokens=20, seed=0, allowed_token_ids=allowed),
        use_tqdm=False,
    )
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    banned = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, bad_words=["Lily", "little girl"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Lily" not in banned.text and "little girl" not in banned.text
    assert banned.text[:10] == base.text[:10]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    tokens = llm.get_tokenizer().encode("Once upon a time, there was a little girl")
    params = SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=4)
    out = llm.generate({"prompt_token_ids": tokens}, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == tokens[-4:]
    same = llm.generate(
        {"prompt_token_ids": tokens[-4:]},
        SamplingParams(temperature=0, max_tokens=5),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {512: 1.0}}, r"logit_bias contains token id 512.*\[0, 512\)"),
        ({"allowed_token_ids": [5, 600]}, r"allowed_token_ids contains token id 600"),
        ({"logprobs": 7}, r"logprobs \(7\) is more than max_logprobs \(6\)"),
        ({"prompt_logprobs": 9}, r"prompt_logprobs \(9\) is more than max_logprobs \(6\)"),
        ({"truncate_prompt_tokens": 129}, r"truncate_prompt_tokens \(129\).*max_model_len"),
    ],
)
def test_engine_checks_name_the_parameter(tight_llm: LLM, kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        tight_llm.generate("Once", SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {3: "big"}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": ["x"], "detokenize": False}, "stop"),
        ({"n": 2, "best_of": 3, "output_kind": RequestOutputKind.DELTA}, "best_of"),
    ],
)
def test_invalid_new_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)


def test_logit_bias_is_clamped_and_keys_become_ints() -> None:
    params = SamplingParams(logit_bias={"5": 250, 7: -300.0, 9: 1.5})
    assert params.logit_bias == {5: 100.0, 7: -100.0, 9: 1.5}


@pytest.mark.gpu
def test_on_cuda_penalties_seeds_and_prompt_logprobs(
    hf_model: transformers.PreTrainedModel,
) -> None:
    llm = LLM(dtype="float32", device="cuda", max_model_len=256)
    prompt = llm.get_tokenizer().encode(PROMPT)
    outs = llm.generate([PROMPT] * 4, PENALTY_PARAMS, use_tqdm=False)
    for params, output in zip(PENALTY_PARAMS, outs, strict=True):
        check_logprobs(hf_model, prompt, params, output.outputs[0])
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=30)
    alone = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    params = mixed_params(seeded)
    prompts = [
        f"Once upon a time {i}" if p is not seeded else "Once upon a time"
        for i, p in enumerate(params)
    ]
    assert llm.generate(prompts, params, use_tqdm=False)[6].outputs[0].token_ids == alone
    reversed_batch = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)
    assert reversed_batch[9].outputs[0].token_ids == alone
    asking = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    check_prompt_logprobs(hf_model, llm.generate(PROMPT, asking, use_tqdm=False)[0], 3)
