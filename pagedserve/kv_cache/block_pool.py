"""KVCacheBlock and BlockPool: reference counts, an LRU free queue and the prefix-cache index."""

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedserve.kv_cache.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of `block_size` token slots, in every layer's K and V cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix-cache index


class BlockPool:
    """All KV cache blocks. A block is free iff its `ref_cnt` is 0; free blocks wait in
    `free_queue` in LRU order (least recently freed first) and keep their cached content
    until they are handed out again, which is when their hash leaves the index.

    With `use_null_block` (sliding-window models), block 0 is the null block (vLLM's name):
    the placeholder of block-table entries that no longer hold K/V (out of the window). It is
    never free, never handed out, never cached and never reference-counted, and attention
    never reads it; `num_usable_blocks` excludes it.

    `on_evict(block, block_hash)`, when set, is called when a cached block that the index
    points at is handed out again, before it leaves the index (the CPU tier of the prefix
    cache copies its content then: `KVCacheManager`).
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, use_null_block: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if use_null_block and num_blocks < 2:
            raise ValueError(f"a pool with a null block needs 2 blocks or more, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[0] if use_null_block else None
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks if block is not self.null_block
        )
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.on_evict: Callable[[KVCacheBlock, BlockHash], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that requests can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take the least recently freed blocks. Callers check `num_free_blocks` first."""
        assert num_blocks <= self.num_free_blocks, (num_blocks, self.num_free_blocks)
        blocks = [self.free_queue.popitem(last=False)[1] for _ in range(num_blocks)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to prefix-cache hits, taking free ones out of the free queue
        (the null block, a placeholder among sliding-window hits, is skipped)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks_tail_first: Iterable[KVCacheBlock]) -> None:
        """Drop a reference. Tail-first order makes a request's tail evict before its prefix.
        The null block is skipped."""
        for block in blocks_tail_first:
            if block is self.null_block:
                continue
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block  # keeps its content until reused

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Index a block that just became full. If another block already holds the same
        content (two requests computed it at once), the index keeps the first one."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop a block from the index without evicting it anywhere (its K/V will never be
        written: see KVCacheManager.forget_unwritten); its holders keep it."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: free ones, and those requests still hold (they stay
        theirs, but no later request hits them, now or once they are freed)."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                if self.on_evict is not None:
                    self.on_evict(block, block.block_hash)
                del self.cached[block.block_hash]
            block.block_hash = None

    def check_invariants(self, block_tables: Iterable[list[KVCacheBlock]]) -> None:
        """Raise AssertionError unless the pool is consistent with the given block tables:
        free + used == total; each ref count equals the number of tables holding the block;
        no block is both free and referenced; the hash index points at blocks with that hash;
        the null block is in no count, queue or index."""
        holders = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                if block is not self.null_block:
                    holders[block.block_id] += 1
        if self.null_block is not None:
            null = self.null_block
            assert null.ref_cnt == 0 and null.block_hash is None, "null block state"
            assert null.block_id not in self.free_queue, "null block is in the free queue"
        for block in self.blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders[block.block_id]}"
            )
            in_free_queue = block.block_id in self.free_queue
            assert in_free_queue == (block.ref_cnt == 0), f"block {block.block_id} free state"
        num_used = sum(1 for block in self.blocks if block.ref_cnt > 0)
        assert num_used + self.num_free_blocks == self.num_usable_blocks
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"index points at block {block.block_id}"
