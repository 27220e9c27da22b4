"""KVCacheManager: block tables of requests, prefix-cache lookups, allocation and freeing."""

from pagedserve.errors import InvalidRequestError
from pagedserve.kv_cache.block_hash import BlockHash, hash_request_blocks
from pagedserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_blocks_held(
    num_tokens: int,
    block_size: int,
    sliding_window: int | None = None,
    max_step_tokens: int | None = None,
) -> int:
    """Most blocks a request of `num_tokens` tokens holds at once.

    Without a window, all of them. With a sliding window W (every layer's), a step that feeds
    n tokens from position c holds only the blocks of positions c - W + 1 .. c + n - 1 (the
    first new token's window, then the new tokens): at most cdiv(W - 1 + n, block_size) + 1
    blocks, the + 1 for a window that straddles block edges; n is at most `max_step_tokens`
    (the step's token budget; None: the whole request in one step)."""
    num_blocks = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return num_blocks
    step = num_tokens if max_step_tokens is None else min(max_step_tokens, num_tokens)
    return min(num_blocks, cdiv(sliding_window - 1 + step, block_size) + 1)


def check_fits_cache(
    num_prompt_tokens: int,
    max_tokens: int,
    num_blocks: int,
    block_size: int,
    sliding_window: int | None = None,
    max_step_tokens: int | None = None,
) -> None:
    """Raise InvalidRequestError when a request could never fit a cache of `num_blocks` blocks
    (with a sliding window, one of them is the null block and the request needs only
    `max_blocks_held` of the rest). Here, beside the cache, so that the API server's process
    checks before it sends the request without importing the engine core (and its model
    code)."""
    num_tokens = num_prompt_tokens + max_tokens
    usable = num_blocks - (sliding_window is not None)
    needed = max_blocks_held(num_tokens, block_size, sliding_window, max_step_tokens)
    if needed > usable:
        at_once = "" if sliding_window is None else " at once"
        raise InvalidRequestError(
            f"the request needs up to {min(num_tokens, needed * block_size)} tokens of KV "
            f"cache{at_once} but the whole cache holds {usable * block_size}; lower max_tokens "
            f"or shorten the prompt",
            "max_tokens",
        )


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
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
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
        fill after the reset are indexed as usual."""
        self.block_pool.reset_prefix_cache()

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks that starts the request's tokens, and its length
        in tokens. The last token is never a hit: the model must run on it to sample. No hits
        ([], 0) for a request that must compute all its tokens (`skip_reading_prefix_cache`)."""
        if not self._is_cacheable(request) or request.skip_reading_prefix_cache:
            return [], 0
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._window_hits(hashes[:max_hit_blocks])
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hits(self, hashes: list[BlockHash]) -> tuple[list[KVCacheBlock], int]:
        """Sliding-window hits: a prefix of k blocks is a hit when the blocks that the next
        query (position k * block_size) reads, those from `_first_needed_block`, are all
        cached; the earlier ones may be gone and come back as null blocks. The longest such k
        wins (vLLM's rule, found here by one left-to-right scan)."""
        null = self.block_pool.null_block
        assert null is not None
        cached = [self.block_pool.get_cached_block(h) for h in hashes]
        best = run = 0  # run: cached blocks in a row ending at block i
        for i, block in enumerate(cached):
            run = run + 1 if block is not None else 0
            if i + 1 - self._first_needed_block((i + 1) * self.block_size) <= run:
                best = i + 1
        first = self._first_needed_block(best * self.block_size)
        hits = [null] * first + [block for block in cached[first:best] if block is not None]
        assert len(hits) == best
        return hits, best * self.block_size

    def _first_needed_block(self, position: int) -> int:
        """The first block that a query at `position` reads (its window's first key)."""
        assert self.sliding_window is not None
        return max(position - self.sliding_window + 1, 0) // self.block_size

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
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Give the request room for `num_new_tokens` more tokens.

        ```
        |<-- num_computed_tokens -->|<- hits ->|<--- num_new_tokens --->|
        | blocks the request holds  | new_computed_blocks | new blocks  |
        ```
        Returns the ids of the blocks appended to its block table (prefix hits first, the
        null block's id where a sliding-window hit skips a block), or None when the pool
        cannot supply them (nothing is changed then, but for the release of blocks that fell
        out of the sliding window, which no later step needs).
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
        num_new_blocks = max(num_needed - len(blocks) - len(hits), 0)
        # Hits that sit in the free queue stop being free once touched.
        null = self.block_pool.null_block
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0 and block is not null)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        blocks.extend(hits)
        blocks.extend(new_blocks)
        if self._is_cacheable(request):
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return [block.block_id for block in hits + new_blocks]

    def _free_out_of_window(self, request: Request) -> None:
        """Release the blocks that the step starting at `num_computed_tokens` and every later
        step never read again; their table entries become the null block. Blocks whose
        tokens are all known are indexed first, as `free` does."""
        blocks = self.req_to_blocks[request.request_id]
        null = self.block_pool.null_block
        assert null is not None
        first = min(self._first_needed_block(request.num_computed_tokens), len(blocks))
        if first == 0 or blocks[first - 1] is null:
            return  # released by an earlier step (the entries before are null too)
        if self._is_cacheable(request):
            self._cache_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        released = []
        for i in range(first - 1, -1, -1):  # tail first, as `free`
            if blocks[i] is null:
                break
            released.append(blocks[i])
            blocks[i] = null
        self.block_pool.free(released)

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
        self.req_to_block_hashes.pop(request.request_id, None)

    def check_invariants(self) -> None:
        """See `BlockPool.check_invariants`; raises AssertionError on inconsistency."""
        self.block_pool.check_invariants(self.req_to_blocks.values())

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
