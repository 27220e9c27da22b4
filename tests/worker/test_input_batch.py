"""`build_model_input` (the worker's flattening of a step into model inputs) against the
reference flattening that the model tests use (`tests/models/_metadata.py`), for random
batches: prefill chunks, whole prompts after prefix-cache hits, decodes (some with the
placeholder of async scheduling), block tables longer than needed."""

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from pagedserve.worker.input_batch import CachedRequestState, build_model_input
from tests.models._metadata import build_step

NUM_BLOCKS = 64


@dataclass
class Batch:
    block_size: int
    requests: list[ScheduledRequest]
    block_ids: list[list[int]]  # each request's block table


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_reqs = draw(st.integers(1, 6))
    requests, tables = [], []
    for i in range(num_reqs):
        kind = draw(st.sampled_from(["prefill", "chunk", "decode"]))
        # computed: tokens already in the cache (earlier chunks, prefix-cache hits, output)
        computed = draw(st.integers(0, 40))
        new = 1 if kind == "decode" else draw(st.integers(1, 40))
        sample = kind != "chunk"  # a partial prefill chunk samples nothing
        token_ids = draw(st.lists(st.integers(0, 1000), min_size=new, max_size=new))
        if kind == "decode" and draw(st.booleans()):
            token_ids[-1] = PLACEHOLDER_TOKEN_ID  # the step in flight samples it
        num_needed = -(-(computed + new) // block_size)
        num_spare = draw(st.integers(0, 2))  # blocks allocated ahead are not read
        # Shared prefix blocks make ids repeat across requests.
        table = draw(
            st.lists(
                st.integers(0, NUM_BLOCKS - 1),
                min_size=num_needed + num_spare,
                max_size=num_needed + num_spare,
            )
        )
        requests.append(ScheduledRequest(f"r{i}", token_ids, computed, [], sample))
        tables.append(table)
    return Batch(block_size, requests, tables)


@settings(max_examples=200, deadline=None)
@given(batch=batches())
def test_build_model_input_equals_the_reference_flattening(batch: Batch) -> None:
    params = SamplingParams()
    states = {
        r.request_id: CachedRequestState(r.request_id, 1, params, [0], list(table))
        for r, table in zip(batch.requests, batch.block_ids, strict=True)
    }
    output = SchedulerOutput(new_requests=[], scheduled_requests=batch.requests)
    model_input = build_model_input(output, states, batch.block_size, torch.device("cpu"))

    computed = [r.num_computed_tokens for r in batch.requests]
    new = [r.num_new_tokens for r in batch.requests]
    positions, expected = build_step(computed, new, batch.block_ids, batch.block_size)
    got = model_input.attn_metadata
    assert torch.equal(model_input.positions, positions)
    for name in (
        "query_start_loc", "seq_lens", "block_tables", "slot_mapping", "query_start_loc_cpu",
        "seq_lens_cpu",
    ):  # fmt: skip
        value, reference = getattr(got, name), getattr(expected, name)
        assert value.dtype == reference.dtype, name
        assert torch.equal(value, reference), name
    assert (got.max_query_len, got.max_seq_len) == (expected.max_query_len, expected.max_seq_len)

    # What the reference does not build: the tokens, the sampled rows and the placeholders.
    flat = [t for r in batch.requests for t in r.token_ids]
    assert model_input.input_ids.tolist() == flat
    sampled_ids, last_rows, seq_lens = [], [], []
    end = 0
    for r in batch.requests:
        end += r.num_new_tokens
        if r.sample:
            sampled_ids.append(r.request_id)
            last_rows.append(end - 1)
            seq_lens.append(r.num_computed_tokens + r.num_new_tokens)
    assert model_input.sampled_request_ids == sampled_ids
    assert model_input.logits_indices.tolist() == last_rows
    assert model_input.sampled_seq_lens == seq_lens
    placeholders = [i for i, t in enumerate(flat) if t == PLACEHOLDER_TOKEN_ID]
    assert model_input.placeholder_positions.tolist() == placeholders
    owners = [r.request_id for r in batch.requests for t in r.token_ids]
    assert model_input.placeholder_request_ids == [owners[i] for i in placeholders]


def test_mrope_positions_of_chunks_hits_and_decodes() -> None:
    """An M-RoPE model's positions [3, num_tokens]: prompt tokens from the request's
    mrope_positions wherever the step starts in them (a chunk crossing the prompt's end, a
    prefix-cache hit), later tokens their index + mrope_position_delta on all three axes;
    the KV slots still follow the token index."""
    import numpy as np

    prompt = np.array([[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]])
    params = SamplingParams()
    states = {
        "chunk": CachedRequestState("chunk", 7, params, [5] * 7, [0, 1],
                                    mrope_positions=prompt, mrope_position_delta=-2),
        "decode": CachedRequestState("decode", 7, params, [5] * 7, [2, 3, 5],
                                     mrope_positions=prompt, mrope_position_delta=-2),
        "text": CachedRequestState("text", 3, params, [5] * 3, [4]),
    }  # fmt: skip
    scheduled = [
        ScheduledRequest("chunk", [5] * 5, 3, [], True),  # prompt 3..6, then (resumed) token 7
        ScheduledRequest("decode", [PLACEHOLDER_TOKEN_ID], 9, [], True),
        ScheduledRequest("text", [5, 5], 1, [], True),
    ]
    model_input = build_model_input(
        SchedulerOutput([], scheduled, set()), states, 4, torch.device("cpu"), mrope=True
    )
    expected = [[2, 2, 2, 4, 5, 7, 1, 2], [2, 3, 3, 4, 5, 7, 1, 2], [3, 2, 3, 4, 5, 7, 1, 2]]
    assert model_input.positions.tolist() == expected
    assert model_input.attn_metadata.slot_mapping.tolist() == [3, 4, 5, 6, 7, 21, 17, 18]
