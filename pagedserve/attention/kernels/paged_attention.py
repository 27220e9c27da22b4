"""Triton kernels for unified paged attention (prefill chunks and decodes in one batch) and the
combination of split-KV partial results (flash-decoding).

Program layout. A program owns one kv head and a "q block": BLOCK_Q consecutive new tokens of
one request, times the NUM_QUERIES_PER_KV query heads that share that kv head (GQA/MQA), so
each K/V tile is loaded once for the whole group. Its BLOCK_M rows are

    row r  ->  new token  q_block * BLOCK_Q + r // NUM_QUERIES_PER_KV,
               query head kv_head * NUM_QUERIES_PER_KV + r % NUM_QUERIES_PER_KV

(rows >= BLOCK_Q * NUM_QUERIES_PER_KV are padding). The program streams the request's keys
through its block table in tiles of TILE_N keys with an online softmax (base 2):

    keys:  0 ........................ first_q_pos | ...... last_q_pos
           |<- full tiles: no masks ->|<- masked tiles: causal + length ->|

A new token at position p sees keys at positions <= p of its own request; the new tokens of a
request are the last query_len positions of its seq_len.

Sliding window W (SLIDING_WINDOW > 0, a compile-time constant: 0 compiles the code above
unchanged): a token at p sees keys p - W + 1 .. p only. Tiles wholly before the q block's
first window start are never visited (so a long context costs O(W), and blocks the KV
manager freed, whose table entries point anywhere, are never read), keys before it in the
first tile are masked off at the load, and a leading run of masked tiles precedes the full ones:

    keys:  (skipped) | window_lo ... masked ... | full tiles | masked ... last_q_pos

Logit soft cap c (SOFT_CAP > 0, also a constant; Gemma 2): each score s becomes
c * tanh(s / c) before the mask and softmax; the kernel works in base 2, where this is the
same map with cap c * log2(e), which is what SOFT_CAP holds.

FP8 KV cache. K and V tiles are loaded in the cache's dtype and upcast to the query's dtype
before each `tl.dot` (exact: every e4m3/e5m2 value is a bf16 and an fp16 value). With bf16
queries the dots run in fp16 instead (F16_DOTS): the GPU turns two e4m3 values into two fp16
values in one instruction, while e4m3 -> bf16 takes several, which made an fp8 cache slower
to read than a bf16 one; fp16 holds every bf16 query value to 7 bits of mantissa and more
(|q| is clamped to fp16's 65504; smaller than 6e-8 it rounds towards 0), and p in [0, 1]. The
per-tensor scales are not applied per element: k_scale multiplies the score scale (q . k is
linear in k) and v_scale the accumulated output (linear in v), both loaded from device tensors
inside the kernel so that a captured CUDA graph reads their current values.
"""

# @triton.jit functions take Triton's own (untyped) tensors and constexprs.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import triton
import triton.language as tl

from pagedserve.gdc import launch_dependents


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block_id, BLOCK_Q: tl.constexpr):
    """Request that owns global q block `q_block_id`. Request i owns the q blocks from
    query_start_loc[i] // BLOCK_Q + i on; that start grows by at least one per request and by
    at least cdiv(query_len, BLOCK_Q) over request i, so the starts are a sorted index and a
    grid of num_tokens // BLOCK_Q + num_reqs programs covers every q block."""
    lo: tl.int32 = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block_id:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _key_tiles(
    seq_len,
    context_len,
    q_block,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
):
    """The key tiles one q block reads: (num_keys, num_full_tiles, num_tiles, window_lo,
    first_tile, first_full). Keys at positions < num_keys (>= window_lo with a window) are
    visible to some row; tiles first_tile .. num_tiles - 1 are read, those in
    [first_full, num_full_tiles) without masks."""
    # Keys this q block sees: up to its last token's position. Keys below its first token's
    # position + 1 are visible to every row, so whole tiles of them need no mask.
    num_keys = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    num_full_tiles = (context_len + q_block * BLOCK_Q + 1) // TILE_N
    num_tiles = tl.cdiv(num_keys, TILE_N)
    window_lo = 0
    first_tile = 0
    first_full = 0
    if SLIDING_WINDOW > 0:
        # The first row's window starts at window_lo; tiles from `first_full` on are inside
        # the last row's window (it starts at num_keys - W), hence every row's.
        window_lo = tl.maximum(context_len + q_block * BLOCK_Q - SLIDING_WINDOW + 1, 0)
        first_tile = window_lo // TILE_N
        first_full = tl.cdiv(tl.maximum(num_keys - SLIDING_WINDOW, 0), TILE_N)
        first_full = tl.minimum(tl.maximum(first_full, first_tile), num_tiles)
        num_full_tiles = tl.maximum(num_full_tiles, first_full)
    return num_keys, num_full_tiles, num_tiles, window_lo, first_tile, first_full


@triton.jit
def _split_tiles(num_tiles, num_splits, SPLIT_MIN_TILES: tl.constexpr):
    """(used splits, tiles per split) for a request with `num_tiles` key tiles (>= 1) in a
    launch of `num_splits` splits: at most num_tiles // SPLIT_MIN_TILES splits (at least one),
    each of tiles_per_split >= SPLIT_MIN_TILES tiles but the last (which gets the >= 1 left);
    the launch's other splits exit without writing. A graph captured for max_model_len thus
    splits a short request only as far as it pays."""
    wanted = tl.maximum(tl.minimum(num_splits, num_tiles // SPLIT_MIN_TILES), 1)
    tiles_per_split = tl.cdiv(num_tiles, wanted)
    return tl.cdiv(num_tiles, tiles_per_split), tiles_per_split


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32, unnormalized output
    m_i,  # [BLOCK_M] fp32, running max of the scaled scores (base 2)
    l_i,  # [BLOCK_M] fp32, running sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos,  # [BLOCK_M] int32, position of each row's token
    kv_ptr,  # kv_cache + kv_head offset
    block_table_ptr,  # this request's row of block_tables
    tile_lo,
    tile_hi,
    num_keys,  # keys this program may see: those at positions < num_keys
    window_lo,  # and >= window_lo (sliding window; 0 without)
    qk_scale,  # softmax scale * log2(e)
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of every tile is visible to every row
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    SOFT_CAP: tl.constexpr,  # 0.0: none; else the cap times log2(e)
):
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + offs_n  # [TILE_N]
        key_valid = key_pos < num_keys
        if SLIDING_WINDOW > 0:
            key_valid = key_valid & (key_pos >= window_lo)  # never touch freed blocks
        if MASKED:
            block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        else:
            block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE)
        offsets = block_ids.to(tl.int64) * stride_cache_block
        offsets += (key_pos % BLOCK_SIZE) * stride_cache_slot
        k_ptrs = kv_ptr + offsets[None, :] + offs_d[:, None]  # [HEAD_DIM_PAD, TILE_N]
        v_ptrs = kv_ptr + stride_cache_kv + offsets[:, None] + offs_d[None, :]  # [TILE_N, D_PAD]
        # Masked-off K/V read as 0 (never NaN garbage from unused slots: 0 * NaN is NaN).
        if MASKED:
            k = tl.load(k_ptrs, mask=key_valid[None, :] & d_valid[:, None], other=0.0)
        elif HEAD_DIM != HEAD_DIM_PAD:
            k = tl.load(k_ptrs, mask=d_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)

        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        if SOFT_CAP > 0:
            # cap * tanh(qk / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1) (Triton has no tanh
            # on every version; this form saturates to +-1 without overflow trouble).
            e2x = tl.math.exp2(qk * (2.0 * 1.4426950408889634 / SOFT_CAP))
            qk = SOFT_CAP * (1.0 - 2.0 / (e2x + 1.0))
        if MASKED:
            visible = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
            if SLIDING_WINDOW > 0:
                visible = visible & (key_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no key yet keeps m = -inf; subtract 0 instead (no NaN).
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_ref = m_new
        p = tl.math.exp2(qk - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)

        if MASKED:
            v = tl.load(v_ptrs, mask=key_valid[:, None] & d_valid[None, :], other=0.0)
        elif HEAD_DIM != HEAD_DIM_PAD:
            v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Values that change from step to step are not specialised on (Triton would otherwise compile
# a variant per divisibility-by-16 class of each, in the middle of serving).
_STEP_VARYING = ["num_reqs", "query_len_lo", "query_len_hi", "stride_block_tables"]


@triton.jit(do_not_specialize=_STEP_VARYING)
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_acc_ptr,  # [num_reqs, num_kv_heads, num_splits, BLOCK_M, HEAD_DIM_PAD] fp32
    partial_max_ptr,  # [num_reqs, num_kv_heads, num_splits, BLOCK_M] fp32
    partial_sum_ptr,  # [num_reqs, num_kv_heads, num_splits, BLOCK_M] fp32
    query_ptr,  # [num_tokens, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    k_scale_ptr,  # [1] float32, read when KV_SCALED (fp8 cache)
    v_scale_ptr,  # [1] float32, read when KV_SCALED
    num_reqs,
    query_len_lo,  # this launch handles requests with query_len_lo <= query_len <= query_len_hi
    query_len_hi,
    qk_scale,  # softmax scale * log2(e)
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_tables,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // NUM_QUERIES_PER_KV new tokens per program
    TILE_N: tl.constexpr,
    ONE_Q_BLOCK: tl.constexpr,  # grid axis 0 is the request (every query_len <= BLOCK_Q)
    SPLIT_KV: tl.constexpr,  # write partial (acc, max, sum) per split instead of the output
    SPLIT_MIN_TILES: tl.constexpr,  # a request uses at most (its tiles) // this splits
    DOT_PRECISION: tl.constexpr,
    KV_SCALED: tl.constexpr,  # the cache holds K / k_scale and V / v_scale (fp8)
    F16_DOTS: tl.constexpr = False,  # fp8 cache, bf16 queries: the dots in fp16 (docstring)
    SLIDING_WINDOW: tl.constexpr = 0,  # 0: none; else a token at p sees keys > p - W only
    SOFT_CAP: tl.constexpr = 0.0,  # 0.0: none; else the logit soft cap times log2(e)
    PDL_TRIGGER: tl.constexpr = False,  # let the next kernel launch early (pagedserve/gdc.py)
):
    """Grid (q blocks, num_kv_heads, num_splits). With ONE_Q_BLOCK, axis 0 is the request;
    else it is a global q block index (num_tokens // BLOCK_Q + num_reqs of them, taken in
    reverse), mapped to its request by binary search. Axis 2 splits each request's key tiles
    into contiguous ranges (flash-decoding); it is 1 unless SPLIT_KV. Requests outside
    [query_len_lo, query_len_hi] (another launch's, or query_len 0 padding), q blocks past
    a request's end, and splits past the ones a request uses (`_split_tiles`) exit at once.
    """
    if PDL_TRIGGER:
        launch_dependents()
    if ONE_Q_BLOCK:
        req = tl.program_id(0)
        q_block = 0
    else:
        # Highest q blocks (the most keys) first, so that short ones fill the tail.
        q_block_id = tl.num_programs(0) - 1 - tl.program_id(0)
        req = _find_request(query_start_loc_ptr, num_reqs, q_block_id, BLOCK_Q)
        q_block = q_block_id - (tl.load(query_start_loc_ptr + req) // BLOCK_Q + req)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)  # before the exit test: its latency overlaps
    skip = (query_len < query_len_lo) | (query_len > query_len_hi)
    if skip | (q_block * BLOCK_Q >= query_len):
        return
    context_len = seq_len - query_len

    num_keys, num_full_tiles, num_tiles, window_lo, first_tile, first_full = _key_tiles(
        seq_len, context_len, q_block, BLOCK_Q, TILE_N, SLIDING_WINDOW
    )
    # Splits share the tiles from first_tile on: a window's O(W) tiles, not the sequence's.
    # (Without SPLIT_KV there is one split, which takes them all.)
    used_splits, tiles_per_split = _split_tiles(
        num_tiles - first_tile, tl.num_programs(2), SPLIT_MIN_TILES
    )
    if split >= used_splits:  # the combine reads only the used splits
        return
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_index = q_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # among the request's new tokens
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_index < query_len)
    q_pos = context_len + q_index
    token = (q_start + q_index).to(tl.int64)
    d_valid = offs_d < HEAD_DIM
    io_mask = row_valid[:, None] & d_valid[None, :]
    q_offsets = token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(query_ptr + q_offsets, mask=io_mask, other=0.0)
    if F16_DOTS:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    if KV_SCALED:
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # q . (k_scale * k) = k_scale * (q . k)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_ptr = kv_cache_ptr + kv_head * stride_cache_head
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_block_tables
    full_lo = tile_lo
    if SLIDING_WINDOW > 0:  # the leading tiles that cut through some row's window start
        full_lo = tl.maximum(tile_lo, first_full)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, kv_ptr, block_table_ptr,
            tile_lo, tl.minimum(tile_hi, first_full), num_keys, window_lo, qk_scale,
            stride_cache_kv, stride_cache_block, stride_cache_slot,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, DOT_PRECISION,
            SLIDING_WINDOW, SOFT_CAP,
        )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, kv_ptr, block_table_ptr,
        full_lo, tl.minimum(tile_hi, num_full_tiles), num_keys, window_lo, qk_scale,
        stride_cache_kv, stride_cache_block, stride_cache_slot,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, False, DOT_PRECISION,
        SLIDING_WINDOW, SOFT_CAP,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, kv_ptr, block_table_ptr,
        tl.maximum(tile_lo, num_full_tiles), tile_hi, num_keys, window_lo, qk_scale,
        stride_cache_kv, stride_cache_block, stride_cache_slot,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_N, True, DOT_PRECISION,
        SLIDING_WINDOW, SOFT_CAP,
    )  # fmt: skip

    if KV_SCALED:
        acc = acc * tl.load(v_scale_ptr)  # sum p * (v_scale * v) = v_scale * sum p * v
    if SPLIT_KV:
        # A row that sees no key of this split (causal, window) stores m = -inf, l = 0.
        part = (req * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split
        part = part * BLOCK_M + offs_m
        tl.store(partial_max_ptr + part, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
        tl.store(
            partial_acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )
    else:
        out = acc / l_i[:, None]  # every valid row saw its own key, so l_i >= 1
        o_offsets = token[:, None] * stride_o_token + head[:, None] * stride_o_head
        o_offsets += offs_d[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["num_splits", "query_len_lo", "query_len_hi"])
def combine_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_acc_ptr,  # [num_reqs, num_kv_heads, num_splits, BLOCK_M, HEAD_DIM_PAD] fp32
    partial_max_ptr,  # [num_reqs, num_kv_heads, num_splits, BLOCK_M] fp32
    partial_sum_ptr,  # [num_reqs, num_kv_heads, num_splits, BLOCK_M] fp32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    num_splits,
    query_len_lo,
    query_len_hi,
    stride_o_token,
    stride_o_head,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SPLIT_MIN_TILES: tl.constexpr,
    MAX_SPLITS: tl.constexpr,  # a power of two >= num_splits (one compiled variant for all)
    PDL_TRIGGER: tl.constexpr = False,  # let the next kernel launch early (pagedserve/gdc.py)
):
    """Grid (num_reqs, num_kv_heads, BLOCK_Q * NUM_QUERIES_PER_KV): merge the split-KV partial
    results of one row (token, query head) of a request's single q block (the split path
    serves only launches with ONE_Q_BLOCK). The row's used splits (the decode kernel's
    `_split_tiles`, recomputed here) each hold (m_s, l_s, acc_s) over their key range; with
    M = max_s m_s the exact result is sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s.
    All splits are loaded at once (one memory round trip, not one per split)."""
    if PDL_TRIGGER:
        launch_dependents()
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    q_index = row // NUM_QUERIES_PER_KV
    skip = (query_len < query_len_lo) | (query_len > query_len_hi)
    if skip | (q_index >= query_len):
        return
    _, _, num_tiles, _, first_tile, _ = _key_tiles(
        seq_len, seq_len - query_len, 0, BLOCK_Q, TILE_N, SLIDING_WINDOW
    )
    used_splits, _ = _split_tiles(num_tiles - first_tile, num_splits, SPLIT_MIN_TILES)

    offs_s = tl.arange(0, MAX_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_valid = offs_s < used_splits
    part = ((req * tl.num_programs(1) + kv_head) * num_splits + offs_s) * BLOCK_M + row
    m_s = tl.load(partial_max_ptr + part, mask=s_valid, other=float("-inf"))
    l_s = tl.load(partial_sum_ptr + part, mask=s_valid, other=0.0)
    acc_s = tl.load(
        partial_acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=s_valid[:, None],
        other=0.0,
    )  # [MAX_SPLITS, HEAD_DIM_PAD]
    m_tot = tl.max(m_s, 0)
    # A split where the row saw no key has m_s = -inf (weight 0); the row saw its own key in
    # some split, so m_tot is finite; the guard only keeps -inf - -inf out of exp2.
    m_ref = tl.where(m_tot == float("-inf"), 0.0, m_tot)
    weight = tl.math.exp2(m_s - m_ref)
    l_tot = tl.sum(weight * l_s, 0)
    acc = tl.sum(weight[:, None] * acc_s, 0)  # [HEAD_DIM_PAD]

    token = (q_start + q_index).to(tl.int64)
    head = kv_head * NUM_QUERIES_PER_KV + row % NUM_QUERIES_PER_KV
    tl.store(
        out_ptr + token * stride_o_token + head * stride_o_head + offs_d,
        (acc / l_tot).to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
