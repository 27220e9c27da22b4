"""Block pool and KV cache manager: exact block ids, ref counts, prefix hits, LRU eviction."""

import numpy as np
import pytest

from pagedserve.kv_cache.block_hash import ROOT_HASH, hash_block_tokens, hash_request_blocks
from pagedserve.kv_cache.block_pool import BlockPool
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.multimodal import MultiModalFeature, hash_pixels
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int], max_tokens: int = 16) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=max_tokens))


def schedule(manager: KVCacheManager, request: Request, num_new_tokens: int) -> list[int] | None:
    """What the scheduler does: allocate, then count the tokens as computed."""
    block_ids = manager.allocate_slots(request, num_new_tokens)
    if block_ids is not None:
        request.num_computed_tokens += num_new_tokens
    return block_ids


def test_block_hash_is_chained_and_content_sensitive() -> None:
    first = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert first == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert first != hash_block_tokens(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block_tokens(first, [5]) != hash_block_tokens(ROOT_HASH, [5])
    assert first != hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], extra_keys=b"lora-1")
    assert len(hash_request_blocks(list(range(10)), 4, [])) == 2


def test_pool_allocates_lru_and_frees_tail_first() -> None:
    pool = BlockPool(num_blocks=4)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    pool.free(reversed(blocks))
    # Free queue order: 3 (never used), then 2, 1, 0 (tail of the request first).
    assert [b.block_id for b in pool.allocate(4)] == [3, 2, 1, 0]
    with pytest.raises(AssertionError):
        pool.allocate(1)


def test_allocate_slots_grows_block_table() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(10)))
    assert schedule(manager, request, 10) == [0, 1, 2]
    request.append_output_token_ids([99])
    assert schedule(manager, request, 1) == []  # token 10 fits in block 2
    request.append_output_token_ids([98, 97])
    request.num_computed_tokens = 11
    assert schedule(manager, request, 1) == []  # position 11, still block 2
    assert schedule(manager, request, 1) == [3]  # position 12 opens a new block
    manager.check_invariants()


def test_allocation_fails_without_changing_anything() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.num_free_blocks == 2
    assert "a" not in manager.req_to_blocks
    manager.check_invariants()


def test_prefix_cache_hit_shares_full_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    shared = list(range(8))  # exactly two full blocks
    first = make_request("first", shared + [100, 101])
    assert schedule(manager, first, 10) == [0, 1, 2]

    second = make_request("second", shared + [200])
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert [block.block_id for block in hits] == [0, 1] and num_hit_tokens == 8
    assert manager.allocate_slots(second, 1, hits) == [0, 1, 3]
    second.num_computed_tokens = 9
    assert [b.ref_cnt for b in manager.block_pool.blocks[:4]] == [2, 2, 1, 1]
    manager.check_invariants()


def test_whole_prompt_cached_still_recomputes_last_token() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    first = make_request("first", prompt)
    schedule(manager, first, 8)
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("again", prompt))
    assert num_hit_tokens == 4 and len(hits) == 1  # the last block holds the last token


def test_freed_cached_blocks_stay_cached_until_reused_in_lru_order() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    schedule(manager, a, 5)  # blocks 0, 1 full (cached), block 2 partial
    manager.free(a)
    assert manager.num_free_blocks == 4
    # Free queue now: 3, then a's blocks tail first: 2, 1, 0.
    b = make_request("b", [9, 9, 9])
    schedule(manager, b, 3)  # takes blocks 3 and 2: a's cached blocks 0 and 1 survive
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("c", [1, 2, 3, 4, 7]))
    assert [h.block_id for h in hits] == [0, 1] and num_hit_tokens == 4
    d = make_request("d", [5, 5, 5])
    schedule(manager, d, 3)  # needs 2 blocks: evicts 1 (a's tail) then 0
    hits, _ = manager.get_computed_blocks(make_request("e", [1, 2, 3, 4, 7]))
    assert hits == []
    manager.check_invariants()


def test_touching_free_hits_counts_against_free_blocks() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    schedule(manager, a, 4)
    manager.free(a)  # blocks 0 and 1 free but cached
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 4
    # 2 hits (taken out of the free queue) + 2 new blocks > 3 blocks: must fail cleanly.
    assert manager.allocate_slots(b, 4, hits) is None
    manager.check_invariants()
    assert manager.num_free_blocks == 3


def test_all_blocks_free_when_every_request_finished() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    requests = [make_request(str(i), [7] * (3 + 5 * i)) for i in range(4)]
    for request in requests:
        hits, num_hit = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    manager.check_invariants()
    for request in requests:
        manager.free(request)
    manager.check_invariants()
    assert manager.num_free_blocks == 16 and manager.usage == 0.0


def test_caching_disabled_never_hits() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = make_request("a", list(range(9)))
    schedule(manager, a, 9)
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert manager.block_pool.cached == {}


def test_cache_salt_enters_the_first_block_and_the_chain_carries_it() -> None:
    tokens = list(range(12))  # three full blocks of 4
    plain = hash_request_blocks(tokens, 4, [])
    assert hash_request_blocks(tokens, 4, [], cache_salt=None) == plain
    salted = hash_request_blocks(tokens, 4, [], cache_salt="a")
    assert salted == hash_request_blocks(tokens, 4, [], cache_salt="a")
    assert all(s != p for s, p in zip(salted, plain, strict=True))
    other = hash_request_blocks(tokens, 4, [], cache_salt="b")
    assert all(s != o for s, o in zip(salted, other, strict=True))
    # Only the first block's parent changes: the later ones are chained as usual.
    assert salted[1] == hash_block_tokens(salted[0], tokens[4:8])


def test_requests_with_different_salts_share_no_block() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(9))  # two full blocks
    first = make_request("first", prompt)
    first.cache_salt = "tenant-a"
    assert schedule(manager, first, 9) == [0, 1, 2]
    for salt, num_hit_tokens in [("tenant-b", 0), (None, 0), ("tenant-a", 8)]:
        request = make_request(f"then-{salt}", prompt)
        request.cache_salt = salt
        hits, num_hits = manager.get_computed_blocks(request)
        assert num_hits == num_hit_tokens, salt
        assert [b.block_id for b in hits] == ([0, 1] if num_hit_tokens else [])
    manager.check_invariants()


def image_feature(offset: int, length: int, value: float) -> MultiModalFeature:
    pixels = np.full((3, 2, 2), value, np.float32)
    return MultiModalFeature(pixels, offset, length, hash_pixels(pixels))


def test_images_enter_the_hashes_of_the_blocks_holding_their_tokens() -> None:
    """An image's placeholder tokens are the same for every image: its content hash keys the
    blocks holding them (5..8: blocks 1 and 2), and the chain carries it on; the block
    before the image is shared with any other image."""
    tokens = [1, 2, 3, 4, 5] + [9] * 4 + [6, 7, 8]  # three full blocks of 4
    cat, dog = image_feature(5, 4, 0.0), image_feature(5, 4, 1.0)
    with_cat = hash_request_blocks(tokens, 4, [], mm_features=[cat])
    assert with_cat == hash_request_blocks(tokens, 4, [], mm_features=[image_feature(5, 4, 0.0)])
    with_dog = hash_request_blocks(tokens, 4, [], mm_features=[dog])
    plain = hash_request_blocks(tokens, 4, [])
    assert with_cat[0] == with_dog[0] == plain[0]
    assert all(c != d for c, d in zip(with_cat[1:], with_dog[1:], strict=True))
    assert with_cat[1] == hash_block_tokens(with_cat[0], tokens[4:8], cat.identifier.encode())
    assert with_cat[2] == hash_block_tokens(with_cat[1], tokens[8:12], cat.identifier.encode())
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = Request("cat", tokens + [10], SamplingParams(max_tokens=4), mm_features=[cat])
    assert schedule(manager, first, 13) is not None
    for name, image, num_hit_tokens in [("dog", dog, 4), ("cat-again", cat, 12)]:
        request = Request(name, tokens + [10], SamplingParams(max_tokens=4), mm_features=[image])
        assert manager.get_computed_blocks(request)[1] == num_hit_tokens, name


def test_reset_prefix_cache_forgets_blocks_that_running_requests_hold() -> None:
    """Blocks a running request held kept their hash through a reset, so later requests
    hit them (while it ran, and after it freed them): the reset promised no earlier prefix."""
    manager = KVCacheManager(num_blocks=8, block_size=4)
    shared = list(range(8))
    running = make_request("running", shared + [100])
    assert schedule(manager, running, 9) == [0, 1, 2]
    manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("during", shared + [200])) == ([], 0)
    manager.free(running)
    assert manager.get_computed_blocks(make_request("after", shared + [300])) == ([], 0)
    manager.check_invariants()
    # The cache works as before for what is computed after the reset.
    again = make_request("again", shared + [400])
    schedule(manager, again, 9)
    manager.free(again)
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("hit", shared + [500]))
    assert num_hit_tokens == 8


def test_blocks_indexed_ahead_of_their_write_are_forgotten_when_unplanned() -> None:
    """allocate_slots indexes the blocks its tokens will fill; when the scheduler unplans
    the request before the step runs (a priority victim), forget_unwritten drops them, and
    the freed blocks give no later request a hit on K/V never written."""
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("victim", list(range(10, 19)))  # 9 tokens
    assert manager.allocate_slots(request, 8) is not None  # blocks 0-1 indexed, unwritten
    manager.forget_unwritten(request)
    manager.free(request)
    again = make_request("again", list(range(10, 19)))
    assert manager.get_computed_blocks(again)[1] == 0
    manager.check_invariants()
