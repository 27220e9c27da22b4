"""KVCacheManager: block tables of requests, prefix-cache lookups, allocation and freeing."""

from pagedserve.errors import InvalidRequestError
from pagedserve.kv_cache.block_hash import BlockHash, hash_request_blocks
from pagedserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_fits_cache(
    num_prompt_tokens: int, max_tokens: int, num_blocks: int, block_size: int
) -> None:
    """Raise InvalidRequestError when a request could never fit a cache of `num_blocks` blocks.
    Here, beside the cache, so that the API server's process checks before it sends the
    request without importing the engine core (and its model code)."""
    num_tokens = num_prompt_tokens + max_tokens
    if cdiv(num_tokens, block_size) > num_blocks:
        raise InvalidRequestError(
            f"the request needs up to {num_tokens} tokens of KV cache but the whole cache "
            f"holds {num_blocks * block_size}; lower max_tokens or shorten the prompt",
            "max_tokens",
        )


class KVCacheManager:
    """Owns every request's block table (logical block i -> KVCacheBlock) on top of a BlockPool.

    Prefix caching: once a block is full its chained hash goes into the pool's index (at
    allocation time: the tokens are known even though their K/V are still being written by
    the step in flight, and a hit scheduled in the same step reads them after the write).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The pool always keeps an index: with prefix caching off it still serves the sibling
        # sequences of one request (n > 1), whose hashes carry their group as an extra key.
        self.block_pool = BlockPool(num_blocks, enable_caching=True)
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
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

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
        Returns the ids of the blocks appended to its block table (prefix hits first), or
        None when the pool cannot supply them (nothing is changed then).
        """
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
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
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
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
        return hash_request_blocks(request.all_token_ids, self.block_size, known, extra_keys)

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
