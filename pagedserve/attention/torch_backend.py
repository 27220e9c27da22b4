"""Reference attention over the paged KV cache in plain PyTorch (CPU and GPU)."""

import torch
import torch.nn.functional as F

from pagedserve.attention.kv_quant import dequantize_kv, is_fp8, quantize_kv
from pagedserve.attention.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
    v_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
) -> None:
    """Store each new token's K and V at its slot (`block_id * block_size + offset`).

    An fp8 cache gets `quantize_kv(key, k_scale)` and `quantize_kv(value, v_scale)` (scaled,
    clamped to the format's range); any other cache the values cast to its dtype.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key, value = key[valid], value[valid]
    if is_fp8(kv_cache.dtype):
        # index_copy_ has no fp8 kernel on the CPU: copy the bytes.
        key = quantize_kv(key, k_scale, kv_cache.dtype).view(torch.uint8)
        value = quantize_kv(value, v_scale, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    key_cache.index_copy_(0, slots, key.to(kv_cache.dtype))
    value_cache.index_copy_(0, slots, value.to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    max_seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_reqs, max_seq_len, num_kv_heads, head_dim]
    """Read each request's K/V through its block table, padded to `max_seq_len` positions
    (in the cache's dtype: fp8 values are still scaled, see `dequantize_kv`)."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    positions = torch.arange(max_seq_len, device=kv_cache.device)
    num_blocks_needed = (max_seq_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks_needed].long()
    slots = blocks[:, positions // block_size] * block_size + positions % block_size
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    return key_cache[slots], value_cache[slots]


class TorchAttentionBackend:
    """Gather through block tables, then `scaled_dot_product_attention` with a mask.

    All requests of the step go through one padded SDPA call: queries are padded to
    `max_query_len` and keys to `max_seq_len`, and a mask keeps each query token to the keys
    at positions <= its own, inside its own request. It is the ground truth for the Triton
    kernels; it favours clarity over speed. An fp8 cache is dequantized (`k_fp8 * k_scale`,
    `v_fp8 * v_scale`) to the query's dtype before the attention. A sliding window narrows the
    mask to the last `sliding_window` positions; a soft cap computes the scores explicitly
    (at least float32) since SDPA has no hook for it.
    """

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
        v_scale: torch.Tensor | None = None,  # [1] float32, fp8 caches only; None = 1.0
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        md = attn_metadata
        write_kv_cache(key, value, kv_cache, md.slot_mapping, k_scale, v_scale)
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        device = query.device

        # Row (request) and column (index among its new tokens) of every flat token.
        query_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]  # [num_reqs]
        req_indices = torch.repeat_interleave(
            torch.arange(md.num_reqs, device=device), query_lens, output_size=num_tokens
        )
        token_cols = torch.arange(num_tokens, device=device) - md.query_start_loc[req_indices]

        padded_query = query.new_zeros(md.num_reqs, md.max_query_len, num_heads, head_dim)
        padded_query[req_indices, token_cols] = query
        keys, values = gather_kv(kv_cache, md.block_tables, md.max_seq_len)
        if is_fp8(kv_cache.dtype):
            keys = dequantize_kv(keys, k_scale, query.dtype)
            values = dequantize_kv(values, v_scale, query.dtype)

        # Query i of request r sits at position seq_len - query_len + i; it sees keys <= that.
        cols = torch.arange(md.max_query_len, device=device)
        query_positions = (md.seq_lens - query_lens)[:, None] + cols[None, :]  # [R, Q]
        key_positions = torch.arange(md.max_seq_len, device=device)
        mask = key_positions[None, None, :] <= query_positions[:, :, None]  # [R, Q, S]
        if sliding_window is not None:
            mask &= key_positions[None, None, :] > query_positions[:, :, None] - sliding_window
            # Keys before every query's window may sit in blocks the KV manager freed (any
            # content, NaN included): zero them, as a masked score times NaN would be NaN.
            first_key = md.seq_lens - query_lens - sliding_window + 1  # [R]
            stale = (key_positions[None, :] < first_key[:, None])[:, :, None, None]
            keys, values = keys.masked_fill(stale, 0), values.masked_fill(stale, 0)
        # Padded query rows would otherwise be all-masked (NaN); their output is dropped.
        padded_rows = cols[None, :] >= query_lens[:, None]  # [R, Q]
        mask[:, :, 0] |= padded_rows

        q = padded_query.transpose(1, 2)  # [R, H, Q, D]
        k = keys.transpose(1, 2).to(query.dtype)  # [R, Hkv, S, D]
        v = values.transpose(1, 2).to(query.dtype)
        if logits_soft_cap is None:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask[:, None, :, :],
                scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )
        else:
            group = num_heads // num_kv_heads
            acc = torch.promote_types(query.dtype, torch.float32)
            k = k.repeat_interleave(group, dim=1).to(acc)
            v = v.repeat_interleave(group, dim=1).to(acc)
            scores = (q.to(acc) @ k.transpose(-1, -2)) * scale
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            scores = scores.masked_fill(~mask[:, None, :, :], float("-inf"))
            out = (scores.softmax(dim=-1) @ v).to(query.dtype)
        return out.transpose(1, 2)[req_indices, token_cols]  # [num_tokens, H, D]
