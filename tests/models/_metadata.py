"""Builds AttentionMetadata and positions for a test step from per-request counts."""

import torch

from pagedserve.attention.metadata import AttentionMetadata


def build_step(
    num_computed_tokens: list[int],
    num_new_tokens: list[int],
    block_ids: list[list[int]],
    block_size: int,
) -> tuple[torch.Tensor, AttentionMetadata]:  # positions [num_tokens] int64, metadata
    """Positions and metadata of one step in which request i feeds `num_new_tokens[i]` tokens
    after `num_computed_tokens[i]` already in its blocks `block_ids[i]` (logical order).

    Example: block_size 4, blocks [7, 2], 5 computed and 1 new: the new token is at position
    5, logical block 1 = physical block 2, offset 1, so its slot is 2 * 4 + 1 = 9.
    """
    positions, slots = [], []
    for computed, new, blocks in zip(num_computed_tokens, num_new_tokens, block_ids, strict=True):
        assert computed + new <= len(blocks) * block_size, "not enough blocks for the request"
        for position in range(computed, computed + new):
            positions.append(position)
            slots.append(blocks[position // block_size] * block_size + position % block_size)
    seq_lens = [c + n for c, n in zip(num_computed_tokens, num_new_tokens, strict=True)]
    query_start_loc = [0]
    for new in num_new_tokens:
        query_start_loc.append(query_start_loc[-1] + new)
    max_blocks = max(len(blocks) for blocks in block_ids)
    block_tables = [blocks + [0] * (max_blocks - len(blocks)) for blocks in block_ids]
    query_start_loc_t = torch.tensor(query_start_loc, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc_t,
        seq_lens=seq_lens_t,
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(num_new_tokens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc_t.clone(),
        seq_lens_cpu=seq_lens_t.clone(),
    )
    return torch.tensor(positions, dtype=torch.int64), metadata
