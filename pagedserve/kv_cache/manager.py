"""KVCacheManager: block tables of requests, prefix-cache lookups, allocation and freeing."""

from pagedserve.kv_cache.block_hash import BlockHash, hash_request_blocks
from pagedserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedserve.kv_cache.cpu_blocks import BlockCopies, CpuBlockPool, CpuHit, CpuPrefixTier
from pagedserve.kv_cache.sizing import cdiv as cdiv
from pagedserve.kv_cache.sizing import check_fits_cache as check_fits_cache
from pagedserve.kv_cache.sizing import max_blocks_held as max_blocks_held
from pagedserve.kv_cache.sliding_window import (
    first_needed_block,
    release_out_of_window,
    window_hits,
)
from pagedserve.request import Request

# A prefix-cache hit: a GPU block, or a block of the CPU tier that admission copies back.
Hit = KVCacheBlock | CpuHit


class KVCacheManager:
    """Owns every request's block table (logical block i -> KVCacheBlock) on top of a BlockPool.

    Prefix caching: once a block is full its chained hash goes into the pool's index (at
    allocation time: the tokens are known even though their K/V are still being written by
    the step in flight, and a hit scheduled in the same step reads them after the write).

    Sliding window (`sliding_window` W, set only when EVERY attention layer of the model has
    that window; vLLM's SlidingWindowManager): a query at position p reads keys p - W + 1 .. p
    only. When a step starts at position c (`num_computed_tokens`), the blocks wholly before
    c - W + 1 are released to the pool (still indexed, so a later prefix hit can find them
    while they are not reused) and their block-table entries become the pool's null block:
    a table keeps its length, and a request holds at most `max_blocks_held` blocks. A freed
    block may be reused while the step in flight still reads it: that step's reads come
    before the next step's writes on the device's stream.

    CPU blocks (`cpu_blocks`): with `num_swap_blocks`, `swap_out` / `swap_in` move a preempted
    request's blocks to swap space and back (vLLM v0's swap space); with `num_offload_blocks`
    (prefix caching on, no sliding window), cached blocks that the GPU pool hands out again are
    copied to the CPU tier first, and `get_computed_blocks` continues a prefix there
    (`CpuHit`s, copied back by `allocate_slots`). The copies of a step are taken with
    `take_block_copies`, which ends the step's CPU bookkeeping.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        num_swap_blocks: int = 0,
        num_offload_blocks: int = 0,
    ) -> None:
        """Raises ValueError for a non-positive block_size or sliding_window, or a CPU tier
        without prefix caching; NotImplementedError for a CPU tier with a sliding window."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # The pool always keeps an index: with prefix caching off it still serves the sibling
        # sequences of one request (n > 1), whose hashes carry their group as an extra key.
        self.block_pool = BlockPool(
            num_blocks, enable_caching=True, use_null_block=sliding_window is not None
        )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already in the index
        # Counters for metrics: prefix-cache queries and hits, in tokens (record_prefix_query).
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_cpu_hit_tokens = 0  # of num_hit_tokens, found in the CPU tier
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.copies = BlockCopies()
        self.swap_space = CpuBlockPool(0, num_swap_blocks)
        self.swapped: dict[str, list[int | None]] = {}  # request id -> CPU ids (None: null)
        # Request id -> its leading blocks whose K/V it kept through a reset_prefix_cache
        # (running or swapped out): never indexed again, also not by `swap_in`.
        self._unindexed: dict[str, int] = {}
        self.cpu_tier: CpuPrefixTier | None = None
        if num_offload_blocks > 0:
            if not enable_caching:
                raise ValueError("kv_offload_gb (the prefix cache's CPU tier) needs "
                                 "enable_prefix_caching")  # fmt: skip
            if sliding_window is not None:
                raise NotImplementedError(
                    "kv_offload_gb (the prefix cache's CPU tier) with a sliding-window model"
                )
            self.cpu_tier = CpuPrefixTier(CpuBlockPool(num_swap_blocks, num_offload_blocks))
            self.block_pool.on_evict = self._offload

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM's `reset_prefix_cache`, which refuses while any
        block is in use): blocks that running requests hold stay theirs, but no later request
        hits them, neither while they run nor after they are freed. Blocks those requests
        fill after the reset are indexed as usual; the same holds for requests swapped out then
        or later (`swap_in` indexes the blocks it brings back but those). The CPU tier is
        emptied too."""
        self.block_pool.reset_prefix_cache()
        self._unindexed.update(self.num_cached_blocks)  # a swapped request's are kept too
        if self.cpu_tier is not None:
            self.cpu_tier.reset()

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_computed_blocks(self, request: Request) -> tuple[list[Hit], int]:
        """Longest run of cached full blocks that starts the request's tokens, and its length
        in tokens. The last token is never a hit: the model must run on it to sample. No hits
        ([], 0) for a request that must compute all its tokens (`skip_reading_prefix_cache`).
        With the CPU tier a block missing on the GPU may be a `CpuHit`."""
        if not self._is_cacheable(request) or request.skip_reading_prefix_cache:
            return [], 0
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._window_hits(hashes[:max_hit_blocks])
        hits: list[Hit] = []
        tier = self.cpu_tier
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is not None:
                hits.append(block)
            elif tier is not None and (cpu_id := tier.get(block_hash)) is not None:
                hits.append(CpuHit(cpu_id, block_hash))
            else:
                break
        return hits, len(hits) * self.block_size

    def _window_hits(self, hashes: list[BlockHash]) -> tuple[list[Hit], int]:
        """`sliding_window.window_hits` among the request's cached blocks."""
        null = self.block_pool.null_block
        assert null is not None and self.sliding_window is not None
        cached = [self.block_pool.get_cached_block(h) for h in hashes]
        hits = window_hits(cached, null, self.sliding_window, self.block_size)
        return list(hits), len(hits) * self.block_size

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one lookup in the metrics, once the request is admitted (a request waiting
        for blocks looks its prefix up again every step)."""
        if self._is_cacheable(request) and not request.skip_reading_prefix_cache:
            self.num_query_tokens += request.num_tokens
            self.num_hit_tokens += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[Hit] | None = None,
    ) -> list[int] | None:
        """Give the request room for `num_new_tokens` more tokens.

        ```
        |<-- num_computed_tokens -->|<- hits ->|<--- num_new_tokens --->|
        | blocks the request holds  | new_computed_blocks | new blocks  |
        ```
        Returns the ids of the blocks appended to its block table (prefix hits first, the
        null block's id where a sliding-window hit skips a block), or None when the pool
        cannot supply them (nothing is changed then, but for the release of blocks that fell
        out of the sliding window, which no later step needs). A `CpuHit` takes a new block,
        which its CPU block is copied to (`copies.swap_in`).
        """
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if self.sliding_window is not None and blocks:
            self._free_out_of_window(request)
        if not hits:  # fast path of a decode: usually no new block and nothing to cache
            num_tokens_after = request.num_computed_tokens + num_new_tokens
            if num_tokens_after <= len(blocks) * self.block_size:
                if self._is_cacheable(request) and (
                    num_tokens_after // self.block_size
                    > self.num_cached_blocks.get(request.request_id, 0)
                ):
                    self._cache_full_blocks(request, min(num_tokens_after, request.num_tokens))
                return []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        gpu_hits = [hit for hit in hits if isinstance(hit, KVCacheBlock)]
        num_cpu_hits = len(hits) - len(gpu_hits)
        num_new_blocks = max(num_needed - len(blocks) - len(hits), 0)
        # Hits that sit in the free queue stop being free once touched.
        null = self.block_pool.null_block
        num_free_hits = sum(1 for block in gpu_hits if block.ref_cnt == 0 and block is not null)
        if num_new_blocks + num_cpu_hits > self.block_pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(gpu_hits)
        # CPU hits leave the tier before `allocate` evicts GPU blocks into it.
        cpu_ids = [self._claim(hit) for hit in hits if isinstance(hit, CpuHit)]
        restored = iter(self.block_pool.allocate(num_cpu_hits))
        hit_blocks = [hit if isinstance(hit, KVCacheBlock) else next(restored) for hit in hits]
        new_blocks = self.block_pool.allocate(num_new_blocks)
        copied = [block for hit, block in zip(hits, hit_blocks, strict=True) if hit is not block]
        self.copies.swap_in.extend(
            (c, block.block_id) for c, block in zip(cpu_ids, copied, strict=True)
        )
        self.num_cpu_hit_tokens += num_cpu_hits * self.block_size
        blocks.extend(hit_blocks)
        blocks.extend(new_blocks)
        if self._is_cacheable(request):
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return [block.block_id for block in hit_blocks + new_blocks]

    def _claim(self, hit: CpuHit) -> int:
        assert self.cpu_tier is not None
        return self.cpu_tier.claim(hit.block_hash)

    def _offload(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """`BlockPool.on_evict`: copy a cached block that is handed out again to the CPU tier."""
        assert self.cpu_tier is not None
        cpu_id = self.cpu_tier.offload(block_hash)
        if cpu_id is not None:
            self.copies.swap_out.append((block.block_id, cpu_id))

    def is_swapped(self, request: Request) -> bool:
        """Whether the request's blocks are in swap space (`swap_out`)."""
        return request.request_id in self.swapped

    def swap_out(self, request: Request) -> bool:
        """Copy the request's blocks to swap space and release its GPU blocks; False (nothing
        changed) when swap space has too few free blocks or the request holds none: the caller
        preempts by recomputation then. Its `num_computed_tokens` stays: the K/V of those tokens
        (written by this step's predecessors, in flight or not) are what the copies take.

        Shared blocks (a prefix hit, an n > 1 sibling's): the request copies every block it
        holds and drops its references as `free` does, so a block another request holds stays
        theirs; `swap_in` brings the copy back into a block of its own. Null entries (out of
        a sliding window) stay null, with nothing to copy."""
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        null = self.block_pool.null_block
        real = [block for block in blocks or [] if block is not null]
        if not real:
            return False
        cpu_ids = self.swap_space.allocate(len(real))
        if cpu_ids is None:
            return False
        assert blocks is not None
        if self._is_cacheable(request):  # the full blocks stay hits for others, as in `free`
            self._cache_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        self.copies.swap_out.extend((b.block_id, c) for b, c in zip(real, cpu_ids, strict=True))
        it = iter(cpu_ids)
        self.swapped[request_id] = [None if block is null else next(it) for block in blocks]
        self.block_pool.free(reversed(blocks))
        del self.req_to_blocks[request_id]  # (num_cached_blocks stays, for a reset meanwhile)
        self.num_swapped_out_blocks += len(real)
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Bring a swapped-out request's blocks back to new GPU blocks and give it room for
        `num_new_tokens` more tokens after its `num_computed_tokens`: its whole block table
        (what the worker starts its new table from), or None (nothing changed) when the GPU pool
        has too few free blocks."""
        request_id = request.request_id
        saved = self.swapped[request_id]
        cpu_ids = [c for c in saved if c is not None]
        block_size = self.block_size
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, block_size)
        num_extra = max(num_needed - len(saved), 0)
        if len(cpu_ids) + num_extra > self.block_pool.num_free_blocks:
            return None
        gpu_blocks = self.block_pool.allocate(len(cpu_ids))
        pairs = zip(cpu_ids, gpu_blocks, strict=True)
        self.copies.swap_in.extend((c, block.block_id) for c, block in pairs)
        self.swap_space.free(cpu_ids)
        del self.swapped[request_id]
        null = self.block_pool.null_block
        it = iter(gpu_blocks)
        table = []
        for cpu_id in saved:
            if cpu_id is None:  # out of the window when it was swapped out
                assert null is not None
                table.append(null)
            else:
                table.append(next(it))
        self.req_to_blocks[request_id] = table
        # Its blocks are new: `allocate_slots` indexes them, but those from before a reset.
        self.num_cached_blocks[request_id] = self._unindexed.get(request_id, 0)
        self.num_swapped_in_blocks += len(cpu_ids)
        table_ids = [block.block_id for block in table]
        new_ids = self.allocate_slots(request, num_new_tokens)
        assert new_ids is not None  # the check above counted its blocks
        return table_ids + new_ids

    def take_block_copies(self) -> BlockCopies:
        """The copies the step just scheduled needs (the worker does them before its
        forward), and the end of the step's CPU bookkeeping: CPU blocks freed during it can
        be reused from the next one."""
        copies, self.copies = self.copies, BlockCopies()
        self.swap_space.end_step()
        if self.cpu_tier is not None:
            self.cpu_tier.end_step()
        return copies

    def _free_out_of_window(self, request: Request) -> None:
        """Release the blocks that the step starting at `num_computed_tokens` and every later
        step never read again; their table entries become the null block. Blocks whose
        tokens are all known are indexed first, as `free` does."""
        blocks = self.req_to_blocks[request.request_id]
        null, window = self.block_pool.null_block, self.sliding_window
        assert null is not None and window is not None
        first = first_needed_block(request.num_computed_tokens, window, self.block_size)
        first = min(first, len(blocks))
        if first == 0 or blocks[first - 1] is null:
            return  # released by an earlier step (the entries before are null too)
        if self._is_cacheable(request):
            self._cache_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        self.block_pool.free(release_out_of_window(blocks, first, null))

    def forget_unwritten(self, request: Request) -> None:
        """Un-index the blocks that this step's `allocate_slots` indexed for `request` ahead of
        their writes (those past its `num_computed_tokens`), for a request unplanned before the
        step runs (the "priority" policy's victim, preempted by a request after it): no later
        request may hit a block whose K/V no forward wrote."""
        num_written = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        num_indexed = self.num_cached_blocks.get(request.request_id, 0)
        if num_indexed <= num_written:
            return
        for block in self.req_to_blocks[request.request_id][num_written:num_indexed]:
            self.block_pool.uncache(block)
        self.num_cached_blocks[request.request_id] = num_written

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so the tail is evicted first), indexing
        first the computed blocks whose tokens are all known by now: with async scheduling
        `allocate_slots` cannot index the block that a placeholder token completes, and a
        request that ends has no later allocation to catch up."""
        num_known = min(request.num_computed_tokens, request.num_tokens)
        if self._is_cacheable(request) and request.request_id in self.req_to_blocks:
            self._cache_full_blocks(request, num_known)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)
        self._unindexed.pop(request.request_id, None)  # recomputed from now on, if preempted
        self.req_to_block_hashes.pop(request.request_id, None)
        saved = self.swapped.pop(request.request_id, None)
        if saved is not None:  # finished while swapped out
            self.swap_space.free([c for c in saved if c is not None])

    def check_invariants(self) -> None:
        """See `BlockPool.check_invariants` and `CpuBlockPool.check_invariants`; raises
        AssertionError on inconsistency (a block leaked, or owned twice)."""
        self.block_pool.check_invariants(self.req_to_blocks.values())
        assert not set(self.swapped) & set(self.req_to_blocks), "swapped and on the GPU"
        holders = set(self.req_to_blocks) | set(self.swapped)
        assert set(self.num_cached_blocks) <= holders, "indexed blocks of no request"
        assert set(self._unindexed) <= set(self.num_cached_blocks), "a reset's mark outlived it"
        self.swap_space.check_invariants(
            [c for saved in self.swapped.values() for c in saved if c is not None]
        )
        if self.cpu_tier is not None:
            self.cpu_tier.check_invariants()

    def _is_cacheable(self, request: Request) -> bool:
        return self.enable_caching or request.sharing_group is not None

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        known = self.req_to_block_hashes.setdefault(request.request_id, [])
        # With prefix caching off only siblings may share: their group keys their hashes.
        extra_keys = b"" if self.enable_caching else (request.sharing_group or "").encode()
        return hash_request_blocks(
            request.all_token_ids,
            self.block_size,
            known,
            extra_keys,
            request.cache_salt,
            request.mm_features,
        )

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's blocks that are full once its first `num_tokens` are written."""
        request_id = request.request_id
        blocks = self.req_to_blocks[request_id]
        num_full = min(num_tokens // self.block_size, len(blocks))
        first = self.num_cached_blocks.get(request_id, 0)  # hits are indexed already
        if num_full <= first:
            return
        hashes = self._block_hashes(request)
        for i in range(first, num_full):
            self.block_pool.cache_full_block(blocks[i], hashes[i])
        self.num_cached_blocks[request_id] = num_full
