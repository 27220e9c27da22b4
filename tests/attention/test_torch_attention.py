"""The torch reference backend's sliding window and logit soft cap, against a per-token loop.

The loop is the definition: query at position p of request r attends to keys at positions
max(0, p - W + 1) .. p of r, with scores c * tanh(s / c) when a soft cap c is set
(transformers' sliding-window mask; Gemma 2's `attn_logit_softcapping`).
"""

import itertools
import math

import pytest
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 4


def _loop_reference(
    q: torch.Tensor,  # [T, H, D] float64
    keys: list[torch.Tensor],  # per request [S_r, Hkv, D]
    values: list[torch.Tensor],
    query_lens: list[int],
    window: int | None,
    cap: float | None,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    group = q.shape[1] // keys[0].shape[1]
    t = 0
    for r, qlen in enumerate(query_lens):
        seq_len = keys[r].shape[0]
        for i in range(qlen):
            p = seq_len - qlen + i
            lo = 0 if window is None else max(0, p - window + 1)
            k = keys[r][lo : p + 1].repeat_interleave(group, dim=1)  # [n, H, D]
            v = values[r][lo : p + 1].repeat_interleave(group, dim=1)
            s = torch.einsum("hd,nhd->hn", q[t], k) * scale
            if cap is not None:
                s = cap * torch.tanh(s / cap)
            out[t] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
            t += 1
    return out


@pytest.mark.parametrize(
    ("window", "cap"), [(None, None), (3, None), (5, None), (None, 2.0), (6, 1.5), (1, None)]
)
def test_sliding_window_and_soft_cap_match_loop(window: int | None, cap: float | None) -> None:
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    query_lens = [1, 7, 3, 1]
    context_lens = [9, 0, 5, 2]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    num_blocks = sum(math.ceil(s / BLOCK_SIZE) for s in seq_lens) + 1
    # Blocks handed out in reverse so a request's blocks are not contiguous.
    free = list(range(num_blocks - 1, 0, -1))
    tables = [[free.pop() for _ in range(math.ceil(s / BLOCK_SIZE))] for s in seq_lens]
    kv_cache = torch.zeros(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=torch.float64)
    keys = [torch.randn(s, num_kv_heads, head_dim, dtype=torch.float64) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, dtype=torch.float64) for s in seq_lens]
    # Cached prefixes go straight into the cache; new tokens go through forward.
    new_k, new_v, slots = [], [], []
    for r, (ctx, qlen) in enumerate(zip(context_lens, query_lens, strict=True)):
        for pos in range(ctx + qlen):
            block, off = tables[r][pos // BLOCK_SIZE], pos % BLOCK_SIZE
            if pos < ctx:
                kv_cache[0, block, off] = keys[r][pos]
                kv_cache[1, block, off] = values[r][pos]
            else:
                new_k.append(keys[r][pos])
                new_v.append(values[r][pos])
                slots.append(block * BLOCK_SIZE + off)
    if window is not None:  # blocks the KV manager may have freed and reused: never read
        for r, ctx in enumerate(context_lens):
            for logical in range(max(ctx - window + 1, 0) // BLOCK_SIZE):
                kv_cache[:, tables[r][logical]] = float("nan")
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table)
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    md = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=sl,
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=sl,
    )
    q = torch.randn(sum(query_lens), num_heads, head_dim, dtype=torch.float64)
    scale = head_dim**-0.5
    out = TorchAttentionBackend().forward(
        q,
        torch.stack(new_k),
        torch.stack(new_v),
        kv_cache,
        md,
        scale,
        sliding_window=window,
        logits_soft_cap=cap,
    )
    expected = _loop_reference(q, keys, values, query_lens, window, cap, scale)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
