"""The block arithmetic of a sliding window (`KVCacheManager`'s, vLLM's SlidingWindowManager):
the first block a query reads, the prefix hits a window allows, and the blocks that fall out."""

from pagedserve.kv_cache.block_pool import KVCacheBlock


def first_needed_block(position: int, sliding_window: int, block_size: int) -> int:
    """The first block that a query at `position` reads (its window's first key)."""
    return max(position - sliding_window + 1, 0) // block_size


def window_hits(
    cached: list[KVCacheBlock | None], null: KVCacheBlock, sliding_window: int, block_size: int
) -> list[KVCacheBlock]:
    """Sliding-window hits among a prompt's blocks (`cached[i]`: block i in the prefix cache,
    or None): a prefix of k blocks is a hit when the blocks that the next query (position
    k * block_size) reads, those from `first_needed_block`, are all cached; the earlier ones
    may be gone and come back as `null`. The longest such k wins (vLLM's rule, found here by
    one left-to-right scan); the hits are its k blocks."""
    best = run = 0  # run: cached blocks in a row ending at block i
    for i, block in enumerate(cached):
        run = run + 1 if block is not None else 0
        if i + 1 - first_needed_block((i + 1) * block_size, sliding_window, block_size) <= run:
            best = i + 1
    first = first_needed_block(best * block_size, sliding_window, block_size)
    hits = [null] * first
    hits += [block for block in cached[first:best] if block is not None]
    assert len(hits) == best
    return hits


def release_out_of_window(
    blocks: list[KVCacheBlock], first: int, null: KVCacheBlock
) -> list[KVCacheBlock]:
    """Replace the entries of `blocks` before `first` (back to the null entries that an
    earlier release left) with `null`; the blocks replaced, tail first, for the pool to free."""
    released = []
    for i in range(first - 1, -1, -1):  # tail first, as `free`
        if blocks[i] is null:
            break
        released.append(blocks[i])
        blocks[i] = null
    return released
