"""KV cache manager with a sliding window: blocks that leave the window are freed, a request
holds a bounded number of blocks, and prefix hits need only the last window's blocks."""

import pytest

from pagedserve.errors import InvalidRequestError
from pagedserve.kv_cache.manager import KVCacheManager, check_fits_cache, max_blocks_held
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

W = 8  # sliding window
BS = 4  # block size


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=1000))


def schedule(manager: KVCacheManager, request: Request, num_new_tokens: int) -> list[int] | None:
    """What the scheduler does: allocate, then count the tokens as computed."""
    block_ids = manager.allocate_slots(request, num_new_tokens)
    if block_ids is not None:
        request.num_computed_tokens += num_new_tokens
    return block_ids


def held(manager: KVCacheManager, request: Request) -> list[int]:
    """Ids of the real blocks in the request's table (null entries left out)."""
    null = manager.block_pool.null_block
    return [b.block_id for b in manager.req_to_blocks[request.request_id] if b is not null]


def test_long_prompt_and_generation_hold_at_most_the_window() -> None:
    """A 300-token prompt in chunks of 5, then 16 tokens, then 200 decode steps, with W = 8
    and blocks of 4: while decoding, a request holds at most cdiv(W, 4) + 1 = 3 blocks (the
    window's 8 keys straddle at most 3 blocks); during prefill at most cdiv(W - 1 + 16, 4) +
    1 = 7 (reached: chunks start at 1 mod 4, so positions c - 7 .. c + 15 span 7 blocks). The
    table keeps one entry per block of the sequence, the freed ones pointing at the null
    block (id 0, never handed out)."""
    manager = KVCacheManager(num_blocks=10, block_size=BS, sliding_window=W)
    request = make_request("a", list(range(300)))
    peak_prefill = 0
    while request.num_computed_tokens < 300:
        num_new = min(16 if request.num_computed_tokens else 5, 300 - request.num_computed_tokens)
        first_query = request.num_computed_tokens
        new_ids = schedule(manager, request, num_new)
        assert new_ids is not None and 0 not in new_ids
        real = held(manager, request)
        peak_prefill = max(peak_prefill, len(real))
        # The chunk's first query reads back to first_query - W + 1: those blocks stay.
        table = manager.req_to_blocks["a"]
        for position in range(max(first_query - W + 1, 0), request.num_computed_tokens):
            assert table[position // BS] is not manager.block_pool.null_block
        manager.check_invariants()
    assert peak_prefill == 7 == max_blocks_held(300, BS, W, 16)
    peak_decode = 0
    for step in range(200):
        request.append_output_token_ids([step])
        assert schedule(manager, request, 1) is not None
        assert len(manager.req_to_blocks["a"]) == -(-request.num_computed_tokens // BS)
        peak_decode = max(peak_decode, len(held(manager, request)))
        assert manager.num_free_blocks == 9 - len(held(manager, request))
    assert peak_decode == 3 == max_blocks_held(500, BS, W, 1)
    manager.check_invariants()
    manager.free(request)
    assert manager.num_free_blocks == 9 and manager.usage == 0.0
    manager.check_invariants()


def test_freed_blocks_stay_cached_and_a_hit_needs_only_the_window() -> None:
    """vLLM's rule: a prefix of k blocks is a hit when the blocks the next query reads
    (from (k * 4 - W + 1) // 4 on) are cached; the ones before come back as null blocks."""
    manager = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=W)
    prompt = list(range(100, 125))  # 25 tokens: 6 full blocks
    a = make_request("a", prompt)
    schedule(manager, a, 25)
    a_blocks = [b.block_id for b in manager.req_to_blocks["a"]]
    a.append_output_token_ids([7])
    schedule(manager, a, 1)  # frees blocks 0..3 of a (positions < 26 - 7 = 19 -> 16)
    assert held(manager, a) == a_blocks[4:]
    # They are free but still cached: a new request with the same prompt hits all 6 blocks.
    b = make_request("b", prompt + [1])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 24
    # The query at 24 reads from 17, block 4: blocks 0..3 are not needed, so null.
    null = manager.block_pool.null_block
    assert hits[:4] == [null] * 4 and [h.block_id for h in hits[4:]] == a_blocks[4:6]
    assert manager.allocate_slots(b, 2, hits) is not None
    b.num_computed_tokens = 26
    manager.check_invariants()
    a_hashes = list(manager.req_to_block_hashes["a"])
    manager.free(a)
    manager.free(b)

    # Free queue (LRU first): 9, 10, 11, then a's released 4, 3, 2, 1, then 7, 8, 6, 5.
    # Another request takes six: a's blocks 1..3 are evicted, its window blocks 4, 5 are not.
    c = make_request("c", list(range(500, 524)))
    assert schedule(manager, c, 24) == [9, 10, 11, 4, 3, 2]
    assert manager.block_pool.get_cached_block(a_hashes[1]) is None
    hits, num_hit = manager.get_computed_blocks(make_request("d", prompt + [2]))
    assert num_hit == 24 and hits == [null] * 4 + [manager.block_pool.blocks[i] for i in (5, 6)]
    manager.check_invariants()


def test_hit_stops_where_a_window_block_is_missing() -> None:
    manager = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=W)
    prompt = list(range(100, 125))
    a = make_request("a", prompt)
    schedule(manager, a, 25)
    blocks = manager.req_to_blocks["a"]
    manager.free(a)
    # Drop block 4 from the index: k = 6 needs blocks 4, 5; k = 5 needs 3, 4; k = 4 needs
    # 2, 3 -> the longest hit is 4 blocks (blocks 0, 1 may be null; they are cached anyway
    # but a hit never asks for them).
    pool = manager.block_pool
    del pool.cached[blocks[4].block_hash]  # type: ignore[arg-type]
    blocks[4].block_hash = None
    hits, num_hit = manager.get_computed_blocks(make_request("b", prompt + [1]))
    assert num_hit == 16
    assert hits[:2] == [pool.null_block] * 2 and hits[2:] == blocks[2:4]


def test_window_of_one_needs_no_block_for_a_hit() -> None:
    """W = 1: a query reads only its own key, so any prefix is a hit with only null blocks."""
    manager = KVCacheManager(num_blocks=4, block_size=BS, sliding_window=1)
    hits, num_hit = manager.get_computed_blocks(make_request("a", list(range(13))))
    assert num_hit == 12 and hits == [manager.block_pool.null_block] * 3


def test_fit_check_uses_the_window() -> None:
    """10 blocks (one of them the null block) cannot hold a 100-token request without a window;
    with W = 8 and 16-token steps it needs only 7 blocks at once."""
    with pytest.raises(InvalidRequestError, match="holds 40"):
        check_fits_cache(50, 50, 10, BS)
    check_fits_cache(50, 50, 10, BS, sliding_window=W, max_step_tokens=16)
    with pytest.raises(InvalidRequestError, match="at once"):
        check_fits_cache(50, 50, 10, BS, sliding_window=W, max_step_tokens=64)
