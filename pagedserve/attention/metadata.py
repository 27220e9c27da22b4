"""What an attention layer needs to know about one step's batch."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer of the model.

    Tokens of a step are laid out request after request (flat, no padding between requests).
    For request i, its new tokens are `query_start_loc[i]:query_start_loc[i+1]` and they sit
    at the end of its sequence:

        |<------------------ seq_lens[i] ------------------>|
        |<-- num_computed_tokens -->|<---- query_len ------>|
          (already in the cache)      (written this step, then attended)

    A new token at position p attends to every key at position <= p of its own request
    (causal inside the new tokens, full over the cached prefix). This one rule covers
    prefill, chunked prefill, prefix-cache hits and decode in a single mixed batch.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, num_computed_tokens + query_len
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token; -1 = skip
    max_query_len: int
    max_seq_len: int
    # Host copies, so that backends need no device->host sync to plan their work.
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32 on CPU
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32 on CPU

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
