"""The batched grammar calls (one xgrammar call per step for the fill and for the accept)
against xgrammar's one-matcher calls, and the CPU mask apply against the torch reference."""

from typing import Any

import numpy as np
import pytest
import torch

import pagedserve.structured_output.batch_matcher as batch_module
import pagedserve.worker.grammar_bitmask as grammar_bitmask
from pagedserve import SamplingParams
from pagedserve.request import Request
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.step import GrammarOutput
from pagedserve.structured_output.batch_matcher import fill_threads
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.worker.grammar_bitmask import apply_grammar_bitmask, unpack_bitmask

from .conftest import QWEN3_VOCAB_SIZE, TOKENIZER_DIR

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
# (constraint, text fed before the fill); "<eos>": the tokenizer's EOS after the text.
CASES: list[tuple[dict[str, Any], str]] = [
    ({"json": SCHEMA}, ""),
    ({"json": SCHEMA}, '{"name": "ab'),
    ({"json": SCHEMA}, '{"name": "x", "n": 4'),
    ({"json": SCHEMA}, '{"name": "x", "n": 4}<eos>'),  # terminated
    ({"regex": r"[a-z]{2,5}\d"}, "ab"),
    ({"choice": ["yes", "no"]}, "yes<eos>"),  # terminated
    ({"choice": ["yes", "no"]}, ""),
    ({"grammar": 'root ::= "(" [0-9]+ ")"'}, "(12"),
    ({"json_object": True}, '{"k": [1, '),
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _manager(tokenizer: Any) -> StructuredOutputManager:
    return StructuredOutputManager(lambda: tokenizer, QWEN3_VOCAB_SIZE, [tokenizer.eos_token_id])


def _advanced(manager: StructuredOutputManager, tokenizer: Any, index: int) -> Request:
    """A ready request of CASES[index % len(CASES)], fed its text through `accept_tokens`."""
    constraint, text = CASES[index % len(CASES)]
    params = SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(**constraint))
    request = Request(f"r{index}", [1, 2], params)
    manager.init_request(request)
    request.structured_output.compiled.result(timeout=120)  # type: ignore[union-attr]
    assert manager.is_ready(request)
    tokens = tokenizer.encode(text.removesuffix("<eos>"), add_special_tokens=False)
    if text.endswith("<eos>"):
        tokens.append(tokenizer.eos_token_id)
    for i, token in enumerate(tokens):
        request.append_output_token_ids([token])
        ended = manager.accept_tokens([(request, token, None)])
        assert (request.request_id in ended) == (i == len(tokens) - 1 and text.endswith("<eos>"))
    grammar = request.structured_output.grammar  # type: ignore[union-attr]
    assert grammar is not None and grammar.num_processed_tokens == len(tokens)
    return request


@pytest.mark.parametrize("threads", [1, 3])
def test_batched_fill_equals_one_matcher_fills(
    tokenizer: Any, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_module, "fill_threads", lambda: threads)
    manager = _manager(tokenizer)
    requests = [_advanced(manager, tokenizer, i) for i in range(3 * len(CASES))]
    grammars = [r.structured_output.grammar for r in requests]  # type: ignore[union-attr]
    ended = [g.is_terminated() for g in grammars]  # type: ignore[union-attr]
    assert sum(ended) == 6 and ended == [g.terminated for g in grammars]  # type: ignore[union-attr]
    for rows in (requests, [r for r, end in zip(requests, ended, strict=True) if not end]):
        batched = manager.grammar_bitmask(rows)
        one_by_one = np.zeros_like(batched)
        for row, request in enumerate(rows):
            if request.structured_output.grammar.terminated:  # type: ignore[union-attr]
                one_by_one[row] = -1  # no mask (xgrammar raises): every token allowed
            else:
                request.structured_output.grammar.fill_bitmask(one_by_one, row)  # type: ignore[union-attr]
        np.testing.assert_array_equal(batched, one_by_one)
    # The masks differ by state: the test would see rows swapped or left unfilled.
    assert len({row.tobytes() for row in batched}) == len(CASES) - 2  # the live states
    manager.shutdown()


def test_batched_accept_rejects_an_invalid_token_as_before(tokenizer: Any) -> None:
    manager = _manager(tokenizer)
    choice, number = _advanced(manager, tokenizer, 6), _advanced(manager, tokenizer, 7)
    before = manager.grammar_bitmask([choice, number])
    fed = number.structured_output.grammar.num_processed_tokens  # type: ignore[union-attr]
    bad = tokenizer.encode("x", add_special_tokens=False)[0]  # neither "yes" nor "no"
    good = tokenizer.encode("3", add_special_tokens=False)[0]
    for request, token in ((choice, bad), (number, good)):
        request.append_output_token_ids([token])
    ended = manager.accept_tokens([(choice, bad, None), (number, good, None)])
    assert ended == set()
    state = choice.structured_output
    assert state is not None and state.grammar is not None
    # Rejected: the grammar stays where it was; the token counts as unconstrained output.
    assert state.grammar.num_processed_tokens == 0 and state.num_output_tokens_before == 1
    after = manager.grammar_bitmask([choice, number])
    np.testing.assert_array_equal(after[0], before[0])
    assert number.structured_output.grammar.num_processed_tokens == fed + 1  # type: ignore[union-attr]
    assert not np.array_equal(after[0], after[1])
    # EOS before the choice is complete is rejected too; after it, it terminates.
    yes = tokenizer.encode("yes", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    for token in (eos, *yes, eos):
        choice.append_output_token_ids([token])
        ended = manager.accept_tokens([(choice, token, None)])
    assert ended == {choice.request_id} and state.grammar.is_terminated()
    assert state.grammar.num_processed_tokens == len(yes) + 1
    manager.shutdown()


def test_batched_accept_equals_one_request_at_a_time(tokenizer: Any) -> None:
    """`accept_tokens` (one xgrammar call for the step) against `accept_token` per request:
    the same grammars end, the same tokens are fed or escape, the same next masks."""
    tokens = [tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", '"', "1", "}", "x")]
    outcomes = []
    for batched in (True, False):
        manager = _manager(tokenizer)
        requests = [_advanced(manager, tokenizer, i) for i in range(8 * len(CASES))]
        live = [r for r in requests if not r.structured_output.grammar.terminated]  # type: ignore[union-attr]
        applied = []
        for i, request in enumerate(live):
            token = tokens[i % len(tokens)]
            request.append_output_token_ids([token])
            applied.append((request, token, None))
        if batched:
            ended = manager.accept_tokens(applied)
        else:
            ended = {r.request_id for r, t, _ in applied if manager.accept_token(r, t)}
        grammars = [r.structured_output.grammar for r in live]  # type: ignore[union-attr]
        fed = [g.num_processed_tokens for g in grammars]  # type: ignore[union-attr]
        escaped = [r.structured_output.num_output_tokens_before for r in live]  # type: ignore[union-attr]
        outcomes.append((ended, fed, escaped, manager.grammar_bitmask(live)))
        manager.shutdown()
    (ended, fed, escaped, bitmask), single = outcomes
    assert 0 < sum(escaped) < len(escaped)  # some tokens rejected, some accepted
    assert ended == single[0] and fed == single[1] and escaped == single[2]
    np.testing.assert_array_equal(bitmask, single[3])


def test_fill_threads_follow_affinity_and_reserved_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_module.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("PAGEDSERVE_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert fill_threads() == 4
    monkeypatch.setenv("PAGEDSERVE_CPU_NUM_OF_RESERVED_CPU", "2")
    assert fill_threads() == 3
    monkeypatch.setattr(batch_module.os, "sched_getaffinity", lambda pid: {0})
    assert fill_threads() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_xgrammar", [True, False])
def test_cpu_apply_equals_the_reference(
    dtype: torch.dtype, with_xgrammar: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xgrammar's CPU kernel by runs of rows, and the torch fallback without xgrammar."""
    if not with_xgrammar:
        monkeypatch.setattr(grammar_bitmask, "_xgrammar_apply", lambda: None)
    torch.manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, 10), dtype=torch.int32)
    rows = [0, 1, 2, 5, 6, 3]  # runs 0-2, 5-6, 3; rows 4 and 7 unconstrained
    for width in (300, 330):  # narrower and wider than the mask's 320 bits
        logits = torch.randn(8, width).to(dtype)
        expected = logits.clone()
        allowed = unpack_bitmask(bitmask, width)
        for mask_row, row in enumerate(rows):
            expected[row].masked_fill_(~allowed[mask_row], float("-inf"))
        ids = [f"r{i}" for i in range(8)]
        apply_grammar_bitmask(logits, GrammarOutput([ids[r] for r in rows], bitmask.numpy()), ids)
        assert torch.equal(logits, expected)
