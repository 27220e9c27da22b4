"""Per-request worker state and the flattening of a step into model inputs."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.multimodal import MultiModalFeature
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import PLACEHOLDER_TOKEN_ID, SchedulerOutput


@dataclass(slots=True)
class CachedRequestState:
    """What a worker remembers about a running request between steps."""

    request_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    prompt_token_ids: list[int]  # scored by prompt logprobs
    block_ids: list[int] = field(default_factory=list)  # block table
    mm_features: tuple[MultiModalFeature, ...] = ()  # the prompt's images
    # The encoder cache (`encoder_cache.build_inputs_embeds`): image index in mm_features ->
    # its embeddings [length, hidden_size], from the first step that feeds one of its tokens
    # to the step that feeds its last.
    encoder_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # M-RoPE models (Qwen2.5-VL): the prompt's (t, h, w) positions [3, num_prompt_tokens]
    # int64, and what later tokens add to their index (the same on all three axes).
    mrope_positions: np.ndarray | None = None
    mrope_position_delta: int = 0


@dataclass(slots=True)
class ModelInput:
    """One step's flat model inputs (tokens of all requests, back to back)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64; [3, num_tokens] for an M-RoPE model
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64, last token of each sampled request
    sampled_request_ids: list[str]
    sampled_seq_lens: list[int]  # seq_len of each sampled request (tokens incl. this step)
    # Async scheduling: where input_ids holds PLACEHOLDER_TOKEN_ID (the previous step's
    # sampled token goes there, on the device) and whose token each one is.
    placeholder_positions: torch.Tensor  # [num_placeholders] int64, CPU
    placeholder_request_ids: list[str]


def build_model_input(
    scheduler_output: SchedulerOutput,
    states: dict[str, CachedRequestState],
    block_size: int,
    device: torch.device,
    mrope: bool = False,
) -> ModelInput:
    """Flatten the scheduled requests into tensors. `mrope`: the model takes M-RoPE
    positions [3, num_tokens] (`mrope_positions`); the KV slots follow the token index.

    Example, block_size=4: a request with block table [7, 2], 5 computed tokens and 2 new
    ones feeds positions 5 and 6, which land in logical block 1 (physical 2) at offsets 1
    and 2: slots 9 and 10.
    """
    scheduled = scheduler_output.scheduled_requests
    num_reqs = len(scheduled)
    query_lens = np.fromiter((r.num_new_tokens for r in scheduled), np.int32, num_reqs)
    computed = np.fromiter((r.num_computed_tokens for r in scheduled), np.int64, num_reqs)
    query_start_loc = np.zeros(num_reqs + 1, np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = (computed + query_lens).astype(np.int32)
    num_tokens = int(query_start_loc[-1])

    input_ids = np.fromiter((t for r in scheduled for t in r.token_ids), np.int64, num_tokens)
    req_indices = np.repeat(np.arange(num_reqs), query_lens)
    positions = (
        np.arange(num_tokens) - np.repeat(query_start_loc[:-1], query_lens) + computed[req_indices]
    )
    tables = [states[r.request_id].block_ids for r in scheduled]
    max_blocks = max(len(t) for t in tables)
    block_tables = np.zeros((num_reqs, max_blocks), np.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = table
    slot_mapping = (
        block_tables[req_indices, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    sampled_rows = [i for i, r in enumerate(scheduled) if r.sample]
    sampled_request_ids = [scheduled[i].request_id for i in sampled_rows]
    logits_indices = query_start_loc[1:][sampled_rows].astype(np.int64) - 1

    placeholders = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN_ID)
    placeholder_request_ids = [scheduled[i].request_id for i in req_indices[placeholders]]

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    query_start_loc_cpu = torch.from_numpy(query_start_loc)
    seq_lens_cpu = torch.from_numpy(seq_lens)
    attn_metadata = AttentionMetadata(
        query_start_loc=query_start_loc_cpu.to(device, non_blocking=True),
        seq_lens=seq_lens_cpu.to(device, non_blocking=True),
        block_tables=to_device(block_tables),
        slot_mapping=to_device(slot_mapping),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens_cpu,
    )
    rope_positions = positions.astype(np.int64)
    if mrope:
        step_states = [states[r.request_id] for r in scheduled]
        rope_positions = mrope_positions(step_states, rope_positions, req_indices, query_start_loc)
    return ModelInput(
        input_ids=to_device(input_ids),
        positions=to_device(rope_positions),
        attn_metadata=attn_metadata,
        logits_indices=to_device(logits_indices),
        sampled_request_ids=sampled_request_ids,
        sampled_seq_lens=[int(seq_lens[i]) for i in sampled_rows],
        placeholder_positions=torch.from_numpy(placeholders.astype(np.int64)),
        placeholder_request_ids=placeholder_request_ids,
    )


def mrope_positions(
    states: Sequence[CachedRequestState],  # the scheduled requests', in step order
    positions: np.ndarray,  # [num_tokens] int64, each token's index in its request
    req_indices: np.ndarray,  # [num_tokens], each token's request (row of `states`)
    query_start_loc: np.ndarray,  # [num_reqs + 1] int32
) -> np.ndarray:  # [3, num_tokens] int64
    """The step's M-RoPE positions: a token after the prompt has its index +
    `mrope_position_delta` on all three axes (vLLM's
    MRotaryEmbedding.get_next_input_positions), a prompt token its request's
    `mrope_positions` column (wherever the step starts in the prompt: a chunk, or after a
    prefix-cache hit). A request without `mrope_positions` counts as text (delta 0)."""
    deltas = np.fromiter((s.mrope_position_delta for s in states), np.int64, len(states))
    out = np.repeat((positions + deltas[req_indices])[None], 3, axis=0)
    for i, state in enumerate(states):  # prompt tokens: prefills only
        prompt = state.mrope_positions
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        first = int(positions[start])
        if prompt is None or first >= prompt.shape[1]:
            continue
        in_prompt = min(prompt.shape[1] - first, end - start)
        out[:, start : start + in_prompt] = prompt[:, first : first + in_prompt]
    return out
