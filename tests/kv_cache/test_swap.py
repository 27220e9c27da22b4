"""Swap space and the prefix cache's CPU tier: CPU block bookkeeping, the copies a step
describes, and (through the scheduler and tests/test_scheduler.py's FakeModel, which plays
the KV cache through those copies) that every key a token reads holds its own K/V."""

import random

import pytest

from pagedserve.kv_cache.cpu_blocks import CpuBlockPool, CpuHit, CpuPrefixTier
from pagedserve.kv_cache.manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from tests.test_scheduler import FakeModel, make_scheduler


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8))


def schedule(manager: KVCacheManager, request: Request, num_new_tokens: int) -> list[int] | None:
    """Allocate and advance `num_computed_tokens` as the scheduler does."""
    ids = manager.allocate_slots(request, num_new_tokens)
    if ids is not None:
        request.num_computed_tokens += num_new_tokens
    return ids


def test_swap_out_then_in_copies_every_block_and_frees_the_gpu_ones() -> None:
    manager = KVCacheManager(8, 4, num_swap_blocks=4)
    request = make_request("a", list(range(10)))
    gpu_ids = schedule(manager, request, 10)
    assert gpu_ids is not None and len(gpu_ids) == 3
    manager.take_block_copies()
    assert manager.swap_out(request)
    assert manager.num_free_blocks == 8 and manager.is_swapped(request)
    assert request.num_computed_tokens == 10  # kept: nothing is recomputed
    copies = manager.take_block_copies()
    assert copies.swap_out == list(zip(gpu_ids, [0, 1, 2], strict=True)) and not copies.swap_in
    manager.check_invariants()
    request.append_output_token_ids([5])
    table = manager.swap_in(request, 1)
    assert table is not None and len(table) == 3  # 11 tokens fit the 3 blocks
    assert not manager.is_swapped(request) and manager.num_free_blocks == 5
    # The CPU blocks read by this step's swap-ins are free only from the next step.
    assert manager.swap_space.num_free_blocks == 1
    copies = manager.take_block_copies()
    assert copies.swap_in == list(zip([0, 1, 2], table, strict=True)) and not copies.swap_out
    assert manager.swap_space.num_free_blocks == 4
    manager.check_invariants()
    manager.free(request)
    manager.check_invariants()
    assert manager.num_free_blocks == 8


def test_swap_out_fails_without_changes_when_swap_space_is_full() -> None:
    manager = KVCacheManager(8, 4, num_swap_blocks=2)
    request = make_request("a", list(range(10)))
    schedule(manager, request, 10)
    assert not manager.swap_out(request)
    assert manager.num_free_blocks == 5 and not manager.is_swapped(request)
    assert not manager.take_block_copies().swap_out
    manager.check_invariants()


def test_swap_in_waits_for_enough_gpu_blocks() -> None:
    manager = KVCacheManager(4, 4, num_swap_blocks=4)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(50, 62)))
    schedule(manager, a, 8)
    assert manager.swap_out(a)
    schedule(manager, b, 12)  # 3 of the 4 blocks
    a.append_output_token_ids([1])
    assert manager.swap_in(a, 1) is None  # needs 2 blocks + 1 for the new token
    assert manager.is_swapped(a)
    manager.check_invariants()
    manager.free(b)
    assert manager.swap_in(a, 1) is not None
    manager.check_invariants()


def test_a_shared_block_stays_with_its_other_holder() -> None:
    manager = KVCacheManager(8, 4, num_swap_blocks=8)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    a_ids = schedule(manager, a, 9)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    b_ids = manager.allocate_slots(b, 1, hits)
    b.num_computed_tokens = 9
    assert a_ids is not None and b_ids is not None and b_ids[:2] == a_ids[:2]
    assert manager.swap_out(b)
    assert [manager.block_pool.blocks[i].ref_cnt for i in a_ids] == [1, 1, 1]
    manager.check_invariants()
    table = manager.swap_in(b, 0)
    assert table is not None and not set(table) & set(a_ids)  # its own copies
    manager.check_invariants()


def test_cpu_blocks_freed_in_a_step_are_reused_only_after_it() -> None:
    pool = CpuBlockPool(3, 2)
    ids = pool.allocate(2)
    assert ids == [3, 4] and pool.allocate(1) is None
    pool.free([3])
    assert pool.allocate(1) is None  # 3 may still be read by this step's swap-ins
    pool.end_step()
    assert pool.allocate(1) == [3]
    with pytest.raises(AssertionError, match="not allocated"):
        pool.free([0])


def test_cpu_tier_is_lru_and_never_overwrites_a_block_written_this_step() -> None:
    tier = CpuPrefixTier(CpuBlockPool(0, 2))
    assert tier.offload(b"h1") == 0 and tier.offload(b"h2") == 1
    assert tier.offload(b"h3") is None  # both written this step: h3 is dropped
    tier.end_step()
    assert tier.offload(b"h1") is None  # already there: now the most recently used
    assert tier.offload(b"h3") == 1  # h2 was the least recently used
    assert tier.get(b"h2") is None and tier.get(b"h1") == 0
    assert tier.claim(b"h1") == 0 and tier.get(b"h1") is None
    tier.end_step()
    tier.check_invariants()


def test_evicted_prefix_comes_back_from_the_cpu_tier() -> None:
    manager = KVCacheManager(3, 4, num_offload_blocks=4)
    a = make_request("a", list(range(9)))
    schedule(manager, a, 9)
    manager.free(a)
    other = make_request("o", list(range(100, 112)))
    schedule(manager, other, 12)  # takes all 3 blocks: a's 2 full ones go to the tier
    copies = manager.take_block_copies()
    assert len(copies.swap_out) == 2
    manager.free(other)
    again = make_request("a2", list(range(9)))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 8 and all(isinstance(hit, CpuHit) for hit in hits)
    ids = manager.allocate_slots(again, 1, hits)
    assert ids is not None and len(ids) == 3
    swap_in = manager.take_block_copies().swap_in
    assert [dst for _, dst in swap_in] == ids[:2]
    assert sorted(src for src, _ in swap_in) == sorted(dst for _, dst in copies.swap_out)
    assert manager.num_cpu_hit_tokens == 8
    manager.check_invariants()


def test_cpu_tier_needs_prefix_caching_and_no_sliding_window() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCacheManager(8, 4, enable_caching=False, num_offload_blocks=2)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        KVCacheManager(8, 4, sliding_window=4, num_offload_blocks=2)


@pytest.mark.parametrize("num_swap_blocks", [0, 16])
def test_prefixes_cycling_through_both_tiers_keep_their_kv(num_swap_blocks: int) -> None:
    """Three 3-block prefixes take turns on a GPU pool that holds one request's blocks plus
    a few (evicted prefixes go to a 4-block CPU tier and come back); FakeModel checks every
    key each token reads, with the copies done in the worker's order."""
    rng = random.Random(0)
    scheduler = make_scheduler(
        num_blocks=9,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        num_swap_blocks=num_swap_blocks,
        num_offload_blocks=4,
    )
    model = FakeModel(rng, scheduler)
    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    for i in range(30):
        prompt = prefixes[rng.randrange(3)] + [rng.randrange(100) for _ in range(3)]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=5)))
        if i % 2:
            while scheduler.has_unfinished_requests():
                out = scheduler.schedule()
                scheduler.update_from_output(out, model.run(out, low=1))
                scheduler.kv_cache.check_invariants()
    kv_cache = scheduler.kv_cache
    assert kv_cache.num_cpu_hit_tokens > 0
    assert kv_cache.num_cpu_hit_tokens < kv_cache.num_hit_tokens  # GPU hits too
    if num_swap_blocks:
        assert scheduler.num_swap_outs_total > 0
        assert scheduler.num_swap_ins_total == scheduler.num_swap_outs_total


def test_reset_prefix_cache_empties_the_cpu_tier() -> None:
    manager = KVCacheManager(3, 4, num_offload_blocks=4)
    a = make_request("a", list(range(9)))
    schedule(manager, a, 9)
    manager.free(a)
    schedule(manager, make_request("o", list(range(100, 112))), 12)  # a's blocks: CPU tier
    assert manager.cpu_tier is not None and len(manager.cpu_tier.entries) == 2
    manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("a2", list(range(9)))) == ([], 0)
    manager.take_block_copies()
    manager.check_invariants()
    assert manager.cpu_tier.pool.num_free_blocks == 4


def test_reset_prefix_cache_while_swapped_out_keeps_its_blocks_unindexed() -> None:
    """reset_prefix_cache: no later request hits blocks computed before it, also once a
    request swapped out at the reset, or running then and swapped out later, has its blocks
    back, however many times (swap_in indexes the blocks it brings back, as the GPU pool may
    have reused their first copies, but not those computed before a reset). Blocks filled
    after the reset are hits as usual."""
    for when in ("no reset", "swapped", "running"):
        manager = KVCacheManager(8, 4, num_swap_blocks=4)
        request = make_request("a", list(range(10)))
        schedule(manager, request, 10)
        if when == "running":
            manager.reset_prefix_cache()
        for cycle in range(2):
            assert manager.swap_out(request)
            manager.take_block_copies()
            if when == "swapped" and cycle == 0:
                manager.reset_prefix_cache()
            for block in manager.block_pool.blocks:  # the GPU copies are reused meanwhile
                manager.block_pool.uncache(block)
            request.append_output_token_ids([5 + cycle])
            assert manager.swap_in(request, 1) is not None
            manager.take_block_copies()
            later = make_request("b", [*range(10), 99])
            _, num_hit_tokens = manager.get_computed_blocks(later)
            assert num_hit_tokens == (8 if when == "no reset" else 0), (when, cycle)
            schedule(manager, request, 1)
            manager.check_invariants()
        # Its third block (positions 8-11) was filled after any reset: indexed as usual.
        indexed = [b.block_hash is not None for b in manager.req_to_blocks["a"]]
        assert indexed == ([True] * 3 if when == "no reset" else [False, False, True]), when
        manager.free(request)
        manager.check_invariants()
        _, num_hit_tokens = manager.get_computed_blocks(make_request("c", [*range(10), 5, 6, 7]))
        assert num_hit_tokens == (12 if when == "no reset" else 0), when
