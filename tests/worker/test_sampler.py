"""The batched sampler against a row-by-row reference and transformers' logits processors."""

import math
from collections import Counter

import pytest
import torch
import transformers.generation.logits_process as hf

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ScheduledRequest
from pagedserve.worker.sampler import (
    Sampler,
    apply_logits_processors,
    inverse_cdf_sample,
    sampling_probs,
    seeded_uniform,
)
from pagedserve.worker.sampling_metadata import (
    SamplingMetadata,
    SamplingStateManager,
    bad_word_bans,
)

VOCAB = 64
EOS = 2
CPU = torch.device("cpu")

Spec = tuple[SamplingParams, list[int], list[int]]  # params, prompt, outputs so far


def params(**kwargs: object) -> SamplingParams:
    return SamplingParams(eos_token_ids=(EOS,), **kwargs)  # type: ignore[arg-type]


def feed(manager: SamplingStateManager, request_id: str, prompt: list[int], outputs: list[int]):
    """Feed the tokens as the engine does: the prompt as a prefill, then every output token
    as the input of the next decode step."""
    steps = [ScheduledRequest(request_id, prompt, 0, [], True)]
    steps += [
        ScheduledRequest(request_id, [t], len(prompt) + i, [], True) for i, t in enumerate(outputs)
    ]
    for step in steps:
        manager.record_fed_tokens([step])


def build(specs: list[Spec], manager: SamplingStateManager | None = None) -> SamplingMetadata:
    manager = manager or SamplingStateManager(VOCAB, CPU)
    assert all(isinstance(p, SamplingParams) for p, _, _ in specs)
    for i, (p, prompt, outputs) in enumerate(specs):
        manager.add_request(f"r{i}", p, prompt)
        feed(manager, f"r{i}", prompt, outputs)
    return manager.build_metadata(
        [f"r{i}" for i in range(len(specs))], [len(prompt) + len(out) for _, prompt, out in specs]
    )


def processed(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Our final logits: processors, temperature, min-p/top-k/top-p (dropped tokens at -inf)."""
    logits = logits.clone()
    apply_logits_processors(logits, metadata)
    logits /= metadata.temperature[:, None]
    sampling_probs(logits, metadata)  # cuts `logits` in place
    return logits


def reference_logits(logits: torch.Tensor, spec: Spec) -> torch.Tensor:
    """One row, straight from the definitions (vLLM v1's order), in float64."""
    p, prompt, outputs = spec
    row = logits.double().clone()
    if p.allowed_token_ids is not None:
        allowed = torch.zeros(len(row), dtype=torch.bool)
        allowed[p.allowed_token_ids] = True
        row[~allowed] = -math.inf
    for word in p.bad_words_token_ids or []:
        if len(word) == 1 or outputs[len(outputs) - len(word) + 1 :] == word[:-1]:
            row[word[-1]] = -math.inf
    if len(outputs) < p.min_tokens:
        row[sorted(p.all_stop_token_ids)] = -math.inf
    for token_id, bias in (p.logit_bias or {}).items():
        row[token_id] += bias
    for token_id in set(prompt) | set(outputs):
        value = row[token_id]
        row[token_id] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token_id, count in Counter(outputs).items():
        row[token_id] -= p.frequency_penalty * count + p.presence_penalty
    if p.is_greedy:
        return row
    row /= p.temperature
    if p.min_p > 0:
        probs = row.softmax(-1)
        row[probs < p.min_p * probs.max()] = -math.inf
    if p.top_k > 0:
        row[row < row.topk(p.top_k).values[-1]] = -math.inf
    if p.top_p < 1:
        values, order = row.sort(descending=True)
        probs = values.softmax(-1)
        dropped = order[probs.cumsum(-1) - probs >= p.top_p]
        row[dropped] = -math.inf
    return row


def assert_same_logits(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(reference.float()))
    finite = torch.isfinite(ours)
    torch.testing.assert_close(ours[finite].double(), reference[finite], rtol=1e-5, atol=1e-4)


MIXED: list[Spec] = [
    (params(temperature=0), [5, 6, 7], [8]),
    (params(temperature=0.7), [5, 6], [9, 9]),
    (params(temperature=1.3, top_k=5), [1, 2, 3], []),
    (params(temperature=0.9, top_p=0.6), [4], [10, 11]),
    (params(temperature=1.0, min_p=0.2), [4, 4], [12]),
    (params(temperature=1.0, min_p=1e-4), [4], []),  # keeps more tokens than top-p reads
    (params(temperature=0.8, top_k=12, top_p=0.8, min_p=0.02), [7, 8], [3]),
    (params(temperature=0, repetition_penalty=1.7), [20, 20, 21, 30], [22, 20]),
    (params(temperature=1.1, presence_penalty=1.5, frequency_penalty=0.6), [25, 25], [26, 26, 27]),
    (params(temperature=0.6, repetition_penalty=0.8, frequency_penalty=-1.0), [30, 31], [31, 32]),
    (params(temperature=1.0, logit_bias={3: 100.0, 4: -50.0, 5: 2.5}), [9], [1]),
    (params(temperature=0.5, allowed_token_ids=[7, 8, 9, 40]), [9], []),
    (params(temperature=1.0, bad_words_token_ids=[[13], [14, 15], [16, 17, 18]]), [14], [16, 17]),
    (params(temperature=1.0, min_tokens=3, stop_token_ids=[6]), [1], [7]),
    (params(temperature=1.0, min_tokens=1, stop_token_ids=[6]), [1], [7]),  # past min_tokens
    (params(temperature=1.2, top_k=3, seed=11, repetition_penalty=1.2, logit_bias={0: 3}), [0], []),
]


@pytest.mark.parametrize("vocab_size", [VOCAB, 3000])  # 3000: top-p reads 1024 candidates
def test_processed_logits_match_reference_on_a_mixed_batch(vocab_size: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED), vocab_size) * 3
    ours = processed(logits, build(MIXED, SamplingStateManager(vocab_size, CPU)))
    for row, spec in enumerate(MIXED):
        reference = reference_logits(logits[row], spec)
        if spec[0].is_greedy:
            assert ours[row].argmax() == reference.argmax(), row
        else:
            assert_same_logits(ours[row], reference)


def test_batch_order_and_companions_do_not_change_a_row() -> None:
    torch.manual_seed(1)
    logits = torch.randn(len(MIXED), VOCAB) * 3
    whole = processed(logits, build(MIXED))
    order = list(reversed(range(len(MIXED))))
    reordered = processed(logits[order], build([MIXED[i] for i in order]))
    assert torch.equal(whole[order], reordered)
    alone = processed(logits[8:9], build([MIXED[8]]))
    assert torch.equal(alone[0], whole[8])


def test_processors_match_transformers() -> None:
    """Each row one parameter whose semantics equal a transformers processor."""
    prompt, outputs = [3, 3, 3, 9, 40], [42, 41, 3]
    input_ids = torch.tensor([prompt + outputs])
    cases = [
        (params(temperature=0.5), hf.TemperatureLogitsWarper(0.5)),
        (params(top_k=7), hf.TopKLogitsWarper(7)),
        (params(top_p=0.7), hf.TopPLogitsWarper(0.7)),
        (params(min_p=0.1), hf.MinPLogitsWarper(0.1)),
        (params(temperature=0, repetition_penalty=1.5), hf.RepetitionPenaltyLogitsProcessor(1.5)),
        (params(temperature=0, repetition_penalty=0.7), hf.RepetitionPenaltyLogitsProcessor(0.7)),
        (
            params(temperature=0, min_tokens=5, stop_token_ids=[EOS]),
            hf.MinNewTokensLengthLogitsProcessor(len(prompt), 5, EOS),
        ),
        (
            params(temperature=0, logit_bias={11: 4.0, 12: -3.0}),
            hf.SequenceBiasLogitsProcessor({(11,): 4.0, (12,): -3.0}),
        ),
        (
            params(temperature=0, bad_words_token_ids=[[41, 3, 50], [3, 51], [60], [9, 61]]),
            hf.NoBadWordsLogitsProcessor([[41, 3, 50], [3, 51], [60], [9, 61]]),
        ),
    ]
    torch.manual_seed(2)
    logits = torch.randn(len(cases), VOCAB) * 2
    ours = processed(logits, build([(p, prompt, outputs) for p, _ in cases]))
    for row, (_, processor) in enumerate(cases):
        theirs = processor(input_ids, logits[row : row + 1].clone())[0]
        assert_same_logits(ours[row], theirs.double())
    assert torch.isinf(ours[8, [50, 51, 60]]).all() and torch.isfinite(ours[8, 61])


def test_repetition_counts_the_prompt_but_presence_and_frequency_do_not() -> None:
    prompt, outputs = [7, 7, 7, 7, 9], [11, 11, 9]
    specs = [
        (params(temperature=0, repetition_penalty=2.0), prompt, outputs),
        (params(temperature=0, presence_penalty=1.0), prompt, outputs),
        (params(temperature=0, frequency_penalty=1.0), prompt, outputs),
    ]
    logits = torch.full((3, VOCAB), 4.0)
    logits[:, 20] = -4.0
    out = logits.clone()
    apply_logits_processors(out, build(specs))
    # repetition: every token of prompt or output, once however often it occurs
    assert out[0, [7, 9, 11]].tolist() == [2.0, 2.0, 2.0] and out[0, 20] == -4.0
    # presence and frequency: only generated tokens; the prompt's four 7s count for nothing
    assert out[1, 7] == 4.0 and out[1, [9, 11]].tolist() == [3.0, 3.0]
    assert out[2, 7] == 4.0 and out[2, 9] == 3.0 and out[2, 11] == 2.0


def test_token_counts_survive_chunks_and_preemption() -> None:
    """Counts come from fed tokens, once each: a resumed request re-feeds its history (here
    partly spared by the prefix cache) without counting it again."""
    manager = SamplingStateManager(VOCAB, CPU)
    p = params(frequency_penalty=1.0)
    prompt = [1, 2, 3, 4, 5, 6]
    manager.add_request("a", p, prompt)
    manager.record_fed_tokens([ScheduledRequest("a", prompt[:4], 0, [], False)])
    manager.record_fed_tokens([ScheduledRequest("a", prompt[4:], 4, [], True)])
    for i, token in enumerate([8, 9, 8]):
        manager.record_fed_tokens([ScheduledRequest("a", [token], 6 + i, [], True)])
    # preempted with 10 tokens (last output 10 not fed yet); resumed after a 4-token cache hit
    manager.add_request("a", p, prompt)  # NewRequestData again: state kept
    history = prompt + [8, 9, 8, 10]
    manager.record_fed_tokens([ScheduledRequest("a", history[4:], 4, [], True)])
    row = manager.records["a"].penalty_row
    assert row is not None
    counts = manager.token_counts.output_counts[row]
    assert {t: int(counts[t]) for t in counts.nonzero().flatten().tolist()} == {8: 2, 9: 1, 10: 1}
    assert manager.token_counts.prompt_mask[row].nonzero().flatten().tolist() == prompt
    manager.remove_request("a")
    assert row in manager.token_counts.free_rows


def test_token_count_table_grows_and_reuses_rows() -> None:
    manager = SamplingStateManager(VOCAB, CPU)
    for i in range(20):
        manager.add_request(f"r{i}", params(presence_penalty=0.5), [i])
    assert manager.token_counts.num_rows >= 20
    rows = {manager.records[f"r{i}"].penalty_row for i in range(20)}
    assert len(rows) == 20
    for i in range(20):
        assert manager.token_counts.prompt_mask[manager.records[f"r{i}"].penalty_row, i]
    manager.remove_request("r3")
    manager.add_request("new", params(presence_penalty=0.5), [50])
    row = manager.records["new"].penalty_row
    assert manager.token_counts.prompt_mask[row].nonzero().flatten().tolist() == [50]


def test_bad_word_bans_follow_vllm() -> None:
    words = [[5], [6, 7], [8, 9, 10]]
    assert bad_word_bans(words, []) == [5]
    assert bad_word_bans(words, [1, 6]) == [5, 7]
    assert bad_word_bans(words, [8, 9]) == [5, 10]
    assert bad_word_bans(words, [9]) == [5]


def test_seeded_rows_do_not_depend_on_row_or_batch() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB)
    seeded = (params(temperature=1.0, seed=1234), [1, 2], [3, 4])
    sampler = Sampler()
    alone = [sampler.forward(logits.clone(), build([seeded])).sampled_token_ids[0]]
    companions = [(params(temperature=0.5, seed=i), [1], []) for i in range(5)]
    batch = companions[:2] + [seeded] + companions[2:]
    batch_logits = torch.cat([torch.randn(2, VOCAB), logits, torch.randn(3, VOCAB)])
    in_batch = sampler.forward(batch_logits, build(batch)).sampled_token_ids[2]
    assert in_batch == alone[0]
    # each position, and each seed, draws another number
    draws = seeded_uniform(torch.full((1000,), 1234), torch.arange(1000))
    assert len(set(draws.tolist())) > 990
    assert seeded_uniform(torch.tensor([-5, 2**62]), torch.tensor([3, 3])).unique().numel() == 2


def test_seeded_inverse_cdf_samples_the_distribution() -> None:
    probs = torch.tensor([0.0, 0.4, 0.25, 0.15, 0.0, 0.1, 0.05, 0.05, 0.0])
    num = 40000
    uniform = seeded_uniform(torch.arange(num) * 7919, torch.full((num,), 17))
    assert float(uniform.min()) >= 0 and float(uniform.max()) < 1
    assert abs(uniform.double().mean().item() - 0.5) < 0.005
    samples = inverse_cdf_sample(probs.repeat(num, 1), uniform)
    frequencies = torch.bincount(samples, minlength=len(probs)).double() / num
    std = (probs.double() * (1 - probs.double()) / num).sqrt()
    assert bool(((frequencies - probs).abs() <= 5 * std + 1e-12).all()), frequencies
    # the extremes never pick a token of probability 0, nor run past the vocabulary
    edges = inverse_cdf_sample(probs.repeat(2, 1), torch.tensor([0.0, 1.0 - 2.0**-24]))
    assert edges.tolist() == [1, 7]


def test_top_p_nucleus_larger_than_the_candidates() -> None:
    """A flat distribution over 4096 tokens: the nucleus reaches past the first 1024 candidates,
    and the fallback over the whole vocabulary must give the exact cut."""
    vocab = 4096
    torch.manual_seed(4)
    logits = torch.randn(3, vocab) * 0.1
    specs = [
        (SamplingParams(top_p=0.9), [1], []),
        (SamplingParams(top_p=0.5, top_k=2000), [1], []),
        (SamplingParams(top_p=0.05), [1], []),
    ]
    manager = SamplingStateManager(vocab, CPU)
    ours = processed(logits, build(specs, manager))
    for row, (p, _, _) in enumerate(specs):
        reference = logits[row].double().clone()
        if p.top_k:
            reference[reference < reference.topk(p.top_k).values[-1]] = -math.inf
        values, order = reference.sort(descending=True)
        probs = values.softmax(-1)
        reference[order[probs.cumsum(-1) - probs >= p.top_p]] = -math.inf
        assert_same_logits(ours[row], reference)
    assert int(torch.isfinite(ours[0]).sum()) > 1024


def test_logprobs_are_log_softmax_of_the_processed_logits() -> None:
    specs = [
        (params(temperature=0, logprobs=3), [1], []),
        (params(temperature=0.7, top_k=4, repetition_penalty=1.3, logprobs=5), [1, 5], [6]),
        (params(temperature=1.5, logit_bias={9: 2.0}), [1], []),
        (params(temperature=1.0, top_p=0.5, logprobs=0, seed=5), [2], []),
    ]
    torch.manual_seed(5)
    logits = torch.randn(len(specs), VOCAB) * 2
    metadata = build(specs)
    out = Sampler().forward(logits.clone(), metadata)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.sampled_ranks is not None
    expected = logits.clone()
    apply_logits_processors(expected, metadata)
    expected = (expected / metadata.temperature[:, None]).log_softmax(-1)
    sampled = out.sampled_token_ids
    wanted = [(row, p) for row, (p, _, _) in enumerate(specs) if p.logprobs is not None]
    assert out.logprob_token_ids.shape == (len(wanted), 6)  # only the rows that ask
    for i, (row, p) in enumerate(wanted):
        assert p.logprobs is not None
        assert out.logprob_token_ids[i, 0] == sampled[row]
        torch.testing.assert_close(out.logprobs[i, 0], expected[row, sampled[row]])
        top = expected[row].topk(p.logprobs)
        assert out.logprob_token_ids[i, 1 : 1 + p.logprobs].tolist() == top.indices.tolist()
        torch.testing.assert_close(out.logprobs[i, 1 : 1 + p.logprobs], top.values)
        rank = int((expected[row] > expected[row, sampled[row]]).sum()) + 1
        assert out.sampled_ranks[i] == rank
    assert out.sampled_ranks[0] == 1  # greedy


@pytest.mark.parametrize("top_k", [1, 3])
def test_samples_stay_inside_the_cut(top_k: int) -> None:
    torch.manual_seed(6)
    logits = torch.randn(1, VOCAB).repeat(200, 1)
    specs = [(params(temperature=2.0, top_k=top_k, seed=i), [1], []) for i in range(200)]
    sampled = Sampler().forward(logits.clone(), build(specs)).sampled_token_ids
    allowed = set(logits[0].topk(top_k).indices.tolist())
    assert set(sampled.tolist()) == allowed


def test_extreme_values_never_sample_banned_tokens() -> None:
    """Adversarial values (regressions): a top_p that rounds to 0 in float32
    used to keep no token and crash the step (index -1); a huge repetition penalty used to push
    the only allowed token to -inf, so that the row sampled from the whole vocabulary."""
    torch.manual_seed(7)
    logits = torch.randn(1, VOCAB).repeat(6, 1)
    logits[:, 5] = -3.0  # negative: a repetition penalty multiplies it
    huge = 3e38  # float32 max is 3.4e38
    specs = [
        (params(temperature=0.7, top_p=1e-46), [1], []),
        (params(temperature=0.7, top_p=1e-300, seed=3), [1], []),
        (params(temperature=0.5, repetition_penalty=huge, allowed_token_ids=[5]), [5], [5]),
        (params(temperature=0.01, repetition_penalty=huge, allowed_token_ids=[5, 9]), [5, 9], []),
        (
            params(temperature=0, repetition_penalty=huge, allowed_token_ids=[5], logprobs=1),
            [5],
            [],
        ),
        (params(temperature=1.0, repetition_penalty=1e-30, allowed_token_ids=[5]), [5], []),
    ]
    out = Sampler().forward(logits.clone(), build(specs))
    sampled = out.sampled_token_ids.tolist()
    top = int(logits[0].argmax())
    assert sampled[0] == top and sampled[1] == top  # top_p ~ 0 keeps the most likely token
    assert sampled[2] == 5 and sampled[3] in (5, 9) and sampled[4] == 5 and sampled[5] == 5
    assert out.logprobs is not None and torch.isfinite(out.logprobs[0, 0])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": 1e39}, "temperature"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ],
)
def test_values_that_do_not_fit_float32_are_rejected(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} .*float32"):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_tiny_temperatures_are_raised_to_vllms_minimum() -> None:
    assert SamplingParams(temperature=1e-3).temperature == 0.01  # as vLLM (_MAX_TEMP)
    assert SamplingParams(temperature=1e-6).is_greedy  # below the greedy epsilon


@pytest.mark.gpu
def test_cuda_matches_cpu_and_the_reference() -> None:
    """The same mixed batch on the GPU: processed logits as on the CPU, seeded draws equal."""
    cuda = torch.device("cuda")
    torch.manual_seed(7)
    logits = torch.randn(len(MIXED), 3000) * 3
    on_cpu = processed(logits, build(MIXED, SamplingStateManager(3000, CPU)))
    on_gpu = processed(logits.to(cuda), build(MIXED, SamplingStateManager(3000, cuda))).cpu()
    assert torch.equal(torch.isinf(on_cpu), torch.isinf(on_gpu))
    finite = torch.isfinite(on_cpu)
    torch.testing.assert_close(on_gpu[finite], on_cpu[finite], rtol=1e-5, atol=1e-4)
    seeds, positions = torch.arange(-50, 50) * 104729, torch.arange(100) * 3
    assert torch.equal(
        seeded_uniform(seeds.to(cuda), positions.to(cuda)).cpu(), seeded_uniform(seeds, positions)
    )
    metadata = build(MIXED, SamplingStateManager(3000, cuda))
    out = Sampler().forward(logits.to(cuda), metadata)
    assert out.sampled_token_ids.shape == (len(MIXED),) and out.logprobs is None
