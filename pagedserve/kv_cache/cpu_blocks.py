"""The CPU side of the KV cache's bookkeeping: the blocks of the host's KV pool, which swap
space (the blocks of requests preempted with `preemption_mode="swap"`, vLLM v0's swap space)
and the CPU tier of the prefix cache (`kv_offload_gb`: cached blocks evicted from the GPU)
share, and the block copies of the step being scheduled (`BlockCopies`).

CPU block ids 0 .. num_swap_blocks - 1 are swap space, the next num_offload_blocks the CPU tier:
one host tensor on each worker (`worker.cpu_kv_cache.CpuKVCache`, every layer of a block side
by side) holds both; the engine
and every worker size them alike (`EngineConfig.cpu_block_counts`). Torch-free.

Ordering (what makes the copies of one step safe): the worker does a step's swap-outs
(GPU -> CPU) before its swap-ins (CPU -> GPU), both before the step's forward. So a GPU block
freed this step (a preempted request's, an evicted cached one) is copied out before anything
reuses it, and a CPU block written this step may be read back this step. The reverse, a CPU
block read by a swap-in and then written by a swap-out of the same step, would read the new
content: a CPU block freed this step returns to its free list only at the end of the step
(`CpuBlockPool.end_step`), and the CPU tier never overwrites a block written this step, so that
each CPU block is written at most once per step.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

from pagedserve.kv_cache.block_hash import BlockHash


@dataclass(slots=True)
class BlockCopies:
    """The copies of one step, as (source block id, destination block id) pairs (vLLM v0's
    `blocks_to_swap_out` GPU -> CPU and `blocks_to_swap_in` CPU -> GPU)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CpuHit:
    """A prefix-cache hit in the CPU tier: the block's content is in CPU block `cpu_block_id`;
    admission copies it to a new GPU block (`KVCacheManager.allocate_slots`)."""

    cpu_block_id: int
    block_hash: BlockHash


class CpuBlockPool:
    """CPU block ids `first` .. `first + num_blocks - 1`, handed out from a free list. Frees
    take effect at `end_step` (see the module docstring)."""

    def __init__(self, first: int, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.first = first
        self.num_blocks = num_blocks
        self._free = list(range(first + num_blocks - 1, first - 1, -1))  # pop() gives `first`
        self._freed: list[int] = []  # this step's frees
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (this step's frees excluded)."""
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` free ids, or None (nothing taken) when there are fewer."""
        if num_blocks > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(num_blocks)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """Give blocks back (usable from the next step). Raises AssertionError on a double
        free or an id this pool did not hand out."""
        for block_id in ids:
            assert block_id in self._used, f"CPU block {block_id} is not allocated"
            self._used.remove(block_id)
        self._freed.extend(ids)

    def end_step(self) -> None:
        """The step's copies are described: its frees become allocatable."""
        self._free.extend(reversed(self._freed))
        self._freed.clear()

    def check_invariants(self, owned: list[int]) -> None:
        """`owned`: every id some owner holds, each once. Raises AssertionError unless they
        are exactly the allocated ids, and allocated, free and freed partition the pool."""
        assert len(owned) == len(set(owned)), "a CPU block has two owners"
        assert set(owned) == self._used, f"CPU blocks owned {sorted(owned)} != {self._used}"
        everything = [*self._free, *self._freed, *self._used]
        assert sorted(everything) == list(range(self.first, self.first + self.num_blocks))


class CpuPrefixTier:
    """The CPU tier of the prefix cache: block hash -> CPU block, least recently used first.

    A cached GPU block that the GPU pool hands out again is first copied here (`offload`);
    when the tier is full its least recently used entry makes room. A lookup that misses on
    the GPU may hit here (`get`); the hit's block is then copied back to a GPU block and
    leaves the tier (`claim`): the GPU holds it again, indexed under the same hash.
    """

    def __init__(self, pool: CpuBlockPool) -> None:
        self.pool = pool
        self.entries: OrderedDict[BlockHash, int] = OrderedDict()
        self._written: set[int] = set()  # destinations of this step's offloads

    def get(self, block_hash: BlockHash) -> int | None:
        return self.entries.get(block_hash)

    def offload(self, block_hash: BlockHash) -> int | None:
        """Make room for an evicted GPU block's content: the CPU block to copy it to, or None
        when no copy is needed (the tier has this hash already: it becomes the most recently
        used) or possible (every entry was written this step; the block is then dropped)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        ids = self.pool.allocate(1)
        if ids is not None:
            block_id = ids[0]
        else:
            victim = next((h for h, b in self.entries.items() if b not in self._written), None)
            if victim is None:
                return None
            block_id = self.entries.pop(victim)  # reused at once: it stays allocated
        self.entries[block_hash] = block_id
        self._written.add(block_id)
        return block_id

    def claim(self, block_hash: BlockHash) -> int:
        """Take an entry out of the tier for its copy back to the GPU: its CPU block id (free
        again from the next step). Raises KeyError when the tier does not hold it."""
        block_id = self.entries.pop(block_hash)
        self.pool.free([block_id])
        return block_id

    def reset(self) -> None:
        """Forget every entry (`KVCacheManager.reset_prefix_cache`)."""
        self.pool.free(list(self.entries.values()))
        self.entries.clear()

    def end_step(self) -> None:
        self._written.clear()
        self.pool.end_step()

    def check_invariants(self) -> None:
        """Raises AssertionError unless the entries own exactly the allocated CPU blocks."""
        self.pool.check_invariants(list(self.entries.values()))
