"""Unit tests of the grammar engine's parts: the bitmask on the logits, rollback, the
reasoning gate, request-time validation (milliseconds each, beyond the tokenizer tables)."""

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
import xgrammar as xgr

from pagedserve import SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.reasoning import ReasoningParser
from pagedserve.request import Request
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.step import GrammarOutput
from pagedserve.structured_output.backend_xgrammar import validate_structured_outputs
from pagedserve.structured_output.manager import StructuredOutputManager
from pagedserve.worker.grammar_bitmask import apply_grammar_bitmask, unpack_bitmask

from .conftest import TOKENIZER_DIR

VOCAB = 151936


def test_bitmask_matches_xgrammar_and_bans_the_padded_vocabulary() -> None:
    torch.manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 10), dtype=torch.int32)
    logits = torch.randn(5, 300)  # narrower than the mask's 320 bits
    expected = logits.clone()
    for mask_row, row in enumerate([4, 0, 2]):
        view = expected[row : row + 1]
        xgr.apply_token_bitmask_inplace(view, bitmask[mask_row : mask_row + 1], vocab_size=300)
    grammar = GrammarOutput(["e", "a", "c"], bitmask.numpy())
    apply_grammar_bitmask(logits, grammar, ["a", "b", "c", "d", "e"])
    assert torch.equal(logits, expected)
    wide = unpack_bitmask(bitmask, 330)  # logits wider than 32 * 10: the rest is banned
    assert not wide[:, 320:].any() and torch.equal(wide[:, :300], unpack_bitmask(bitmask, 300))


class _EndsAtToken(ReasoningParser):
    """Thinking ends at token 999 (a stand-in for `</think>`)."""

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        return 999 in token_ids

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        return None, text


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _manager(tokenizer: Any, reasoning_parser: str | None = None) -> StructuredOutputManager:
    return StructuredOutputManager(
        lambda: tokenizer, VOCAB, [tokenizer.eos_token_id], reasoning_parser
    )


def _request(prompt: list[int], **constraint: Any) -> Request:
    params = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(**constraint))
    return Request("r", prompt, params)


def _ready(manager: StructuredOutputManager, request: Request) -> None:
    manager.init_request(request)
    request.structured_output.compiled.result(timeout=120)
    assert manager.is_ready(request)


def test_reasoning_gates_the_mask(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedserve.reasoning.base as reasoning

    monkeypatch.setitem(reasoning._REGISTRY, "qwen3", _EndsAtToken)
    manager = _manager(tokenizer, "qwen3")
    request = _request([1, 2, 3], choice=["yes"])
    _ready(manager, request)
    for token_id in (5, 6):  # thinking: free, and not fed to the grammar
        assert not manager.should_fill_bitmask(request)
        request.append_output_token_ids([token_id])
        assert not manager.accept_token(request, token_id)
    request.append_output_token_ids([999])
    manager.accept_token(request, 999)  # the end of the thinking: not fed either
    assert manager.should_fill_bitmask(request)
    bitmask = manager.grammar_bitmask([request])
    allowed = unpack_bitmask(torch.from_numpy(bitmask), VOCAB)[0].nonzero().flatten().tolist()
    yes = tokenizer.encode("yes")
    assert yes[0] in allowed and 5 not in allowed
    for token_id in yes:
        request.append_output_token_ids([token_id])
        assert not manager.accept_token(request, token_id)
    request.append_output_token_ids([tokenizer.eos_token_id])
    assert manager.accept_token(request, tokenizer.eos_token_id)  # terminated: "stop"
    # A prompt that closes the thinking (enable_thinking=False) constrains from the start.
    closed = _request([1, 999, 3], choice=["yes"])
    _ready(manager, closed)
    assert manager.should_fill_bitmask(closed)
    manager.shutdown()


def test_rollback_after_preemption_matches_kept_tokens(tokenizer: Any) -> None:
    manager = _manager(tokenizer)
    request = _request([1], regex="ab+")
    _ready(manager, request)
    tokens = [tokenizer.encode(c)[0] for c in "abb"]
    for token_id in tokens:
        request.append_output_token_ids([token_id])
        manager.accept_token(request, token_id)
    grammar = request.structured_output.grammar
    assert grammar.num_processed_tokens == 3
    del request.all_token_ids[-1]  # a token accepted, then dropped
    manager.sync_after_preemption(request)
    assert grammar.num_processed_tokens == 2
    mask = manager.grammar_bitmask([request])
    assert unpack_bitmask(torch.from_numpy(mask), VOCAB)[0, tokens[2]]
    manager.shutdown()


def test_compile_runs_off_the_caller_and_caches(tokenizer: Any) -> None:
    manager = _manager(tokenizer)
    first, second = _request([1], json={"type": "integer"}), _request([2], json={"type": "integer"})
    manager.init_request(first)
    manager.init_request(second)  # same constraint: the same compile
    assert first.structured_output.compiled is second.structured_output.compiled
    first.structured_output.compiled.result(timeout=120)
    assert manager.is_ready(first) and manager.is_ready(second)
    stats = manager.stats()
    assert (stats.num_cache_hits, stats.num_cache_misses) == (1, 1) and stats.hit_rate == 0.5
    manager.shutdown()


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "JSON schema"),
        ({"regex": "(a"}, "parenthesis"),
        ({"grammar": 'root ::= "a" b'}, "not defined"),
        ({"structural_tag": "{not json"}, "structural_tag"),
        ({"choice": ["a"], "whitespace_pattern": 5}, "whitespace_pattern"),
    ],
)
def test_invalid_constraints_name_their_field(constraint: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validate_structured_outputs(StructuredOutputsParams(**constraint), "guided_json")
    assert info.value.param in ("guided_json", "structured_outputs")
    assert words in str(info.value)
    assert "/project/cpp" not in str(info.value)  # xgrammar's source position is cut


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("abc", "got str"),
        ([{"json": {}}], "got list"),
        ({"json": {}, "foo": 1}, "unknown fields ['foo']"),
        ({"json": {}, "disable_any_whitespace": "yes"}, "disable_any_whitespace must be a bool"),
        ({"json_object": "yes"}, "json_object must be a boolean"),
    ],
)
def test_undecodable_structured_outputs_in_sampling_params_name_the_field(
    value: Any, words: str
) -> None:
    """Offline, a SamplingParams whose structured_outputs is not a StructuredOutputsParams (or
    a dict of its fields) is refused at construction, not an AttributeError in the engine."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(structured_outputs=value)
    assert info.value.param == "structured_outputs" and words in str(info.value)


def test_a_whitespace_pattern_is_refused_not_ignored() -> None:
    """xgrammar cannot set JSON's whitespace regex: offline, the engine's check refuses it."""
    params = StructuredOutputsParams(json={"type": "object"}, whitespace_pattern="[ ]?")
    with pytest.raises(InvalidRequestError) as info:
        validate_structured_outputs(params, "structured_outputs")
    assert info.value.param == "structured_outputs.whitespace_pattern"
    assert "whitespace_pattern is not supported" in str(info.value)


def test_a_dict_of_structured_outputs_fields_is_taken() -> None:
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")


def test_bitmask_rows_are_int32_words(tokenizer: Any) -> None:
    manager = _manager(tokenizer)
    request = _request([1], choice=["a"])
    _ready(manager, request)
    bitmask = manager.grammar_bitmask([request])
    assert bitmask.dtype == np.int32 and bitmask.shape == (1, (VOCAB + 31) // 32)
    manager.shutdown()


def test_bitmask_buffers_are_used_in_turn_and_hold_the_same_masks(tokenizer: Any) -> None:
    """`use_bitmask_buffers` (pinned host memory on a GPU): each step's mask is a view of one
    of two buffers, in turn, equal to the copy the manager hands out otherwise; a step's mask
    stays intact while the next step fills (the engine uses it until then)."""
    plain, buffered = _manager(tokenizer), _manager(tokenizer)
    made: list[tuple[int, int]] = []

    def allocate(shape: tuple[int, int]) -> np.ndarray:
        made.append(shape)
        return np.full(shape, 7, np.int32)  # garbage: every used row must be overwritten

    buffered.use_bitmask_buffers(allocate)
    requests = {m: [_request([1], choice=["ab", "cd"]), _request([1], regex="[0-9]+")]
                for m in (plain, buffered)}  # fmt: skip
    for manager, pair in requests.items():
        for request in pair:
            _ready(manager, request)
    first = buffered.grammar_bitmask(requests[buffered])
    kept = first.copy()
    second = buffered.grammar_bitmask(requests[buffered][:1])
    assert not np.shares_memory(first, second)  # the other buffer
    np.testing.assert_array_equal(first, kept)  # untouched by the next step's fill
    np.testing.assert_array_equal(first, plain.grammar_bitmask(requests[plain]))
    np.testing.assert_array_equal(second, plain.grammar_bitmask(requests[plain][:1]))
    third = buffered.grammar_bitmask(requests[buffered])
    assert np.shares_memory(first, third)  # back to the first buffer
    assert [rows for rows, _ in made] == [0, 0, 2, 1]  # two empty buffers, each grown once
    plain.shutdown()
    buffered.shutdown()
