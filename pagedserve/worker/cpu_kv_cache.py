"""CpuKVCache: one rank's KV blocks in host memory (swap space and the prefix cache's CPU
tier; the bookkeeping is the scheduler's, `kv_cache/cpu_blocks.py`) and the block copies
between it and the device's KV cache that a SchedulerOutput asks for.

Every tensor-parallel rank holds and copies its own shard (its KV heads) under the same
block ids: the executor sends every rank the same SchedulerOutput. Blocks are copied as raw
bytes (a uint8 view), so an fp8 cache keeps its exact values; its per-layer `k_scale` and
`v_scale` are per tensor and fixed (`attention/kv_quant.py`), the same for a block wherever
it is.
"""

import bisect
import itertools

import torch

# Most device memory a swap's staging buffer takes (bytes): copies go through it in groups of
# blocks, all layers of a block side by side.
_STAGING_BYTES = 64 * 2**20


class CpuKVCache:
    """The blocks of every attention layer in host memory, block-major: block b's bytes are
    one row of a chunk ([blocks, block_bytes] uint8; a few chunks, `chunk_blocks`), layer i's
    K/V at a fixed offset in it ([2, block_size, num_kv_heads, head_dim] in the device
    cache's dtype: `block(i, b)`). Pinned memory when the device is a GPU.

    A copy moves whole blocks, every layer at once: on a GPU, per group of blocks, one
    kernel per layer gathers (scatters) them between the layer caches and a device staging
    buffer laid out as the chunks' rows, and one DMA per run of consecutive CPU block ids
    (within a chunk) moves the group (one DMA per layer and run was ~2,000 DMAs of 64 KB for
    one 1,000-token prefix of Llama-3.1-8B: BENCHMARKS.md, issue 19). Every copy is on the
    current stream, and the host never reads or writes these tensors: a swap-out (device ->
    host) of one step and a swap-in (host -> device) of a later one are ordered by the
    stream, with no wait on the host, so async scheduling keeps running ahead. On the CPU the
    copies are plain tensor copies.

    Raises ValueError naming `swap_space` and `kv_offload_gb` when the host cannot allocate it.
    """

    def __init__(self, device_caches: list[torch.Tensor], num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.device = device_caches[0].device if device_caches else torch.device("cpu")
        pin = self.device.type == "cuda"
        # Layer i's bytes of a block are row[offsets[i] : offsets[i] + sizes[i]].
        self._sizes = [cache[:, 0].numel() * cache.element_size() for cache in device_caches]
        self._offsets = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        # a block of layer i as bytes: [2, block_size, num_kv_heads, head_dim * itemsize]
        self._shapes = [
            (cache.shape[0], *cache.shape[2:-1], cache.shape[-1] * cache.element_size())
            for cache in device_caches
        ]
        self.block_bytes = sum(self._sizes)
        # Chunks of blocks whose sizes are powers of two bytes where the blocks allow
        # (`chunk_blocks`): torch's pinned-memory allocator rounds each allocation up to one.
        lengths = chunk_blocks(num_blocks, self.block_bytes)
        self._chunk_first = [0, *itertools.accumulate(lengths)][:-1]  # each chunk's first id
        try:
            self.chunks = [
                torch.zeros((length, self.block_bytes), dtype=torch.uint8, pin_memory=pin)
                for length in lengths
            ]
        except RuntimeError as e:
            raise ValueError(
                f"a CPU KV cache of {num_blocks} blocks "
                f"({num_blocks * self.block_bytes / 2**30:.2f} GiB) could not be allocated; "
                f"lower swap_space or kv_offload_gb: {e}"
            ) from None
        self._dtypes = [cache.dtype for cache in device_caches]

    def block(self, i: int, block_id: int) -> torch.Tensor:
        """Layer i's K/V of CPU block `block_id` in the device cache's dtype (a view): [2,
        block_size, num_kv_heads, head_dim]."""
        chunk = bisect.bisect_right(self._chunk_first, block_id) - 1
        row = self.chunks[chunk][block_id - self._chunk_first[chunk]].unsqueeze(0)
        return self._layer(row, i)[0].view(self._dtypes[i])

    def _host_runs(self, ids: list[int]) -> list[tuple[int, torch.Tensor]]:
        """The runs of consecutive CPU block ids in `ids`, each within one chunk: (list index
        of its first id, its blocks: a [length, block_bytes] view of the chunk)."""
        runs = []
        for start, first, length in _runs(ids):
            while length > 0:
                chunk = bisect.bisect_right(self._chunk_first, first) - 1
                offset = first - self._chunk_first[chunk]
                take = min(length, len(self.chunks[chunk]) - offset)
                runs.append((start, self.chunks[chunk][offset : offset + take]))
                start, first, length = start + take, first + take, length - take
        return runs

    def _layer(self, blocks: torch.Tensor, i: int) -> torch.Tensor:
        """Layer i's K/V bytes of `blocks` ([n, block_bytes] uint8, rows as the chunks'), as
        [n, 2, block_size, num_kv_heads, head_dim * itemsize] uint8 (a view)."""
        layer = blocks[:, self._offsets[i] : self._offsets[i] + self._sizes[i]]
        return layer.view(blocks.shape[0], *self._shapes[i])

    @torch.inference_mode()
    def swap(
        self,
        device_caches: list[torch.Tensor],
        blocks_to_swap_out: list[tuple[int, int]],  # (device block, CPU block)
        blocks_to_swap_in: list[tuple[int, int]],  # (CPU block, device block)
    ) -> None:
        """Do a step's copies, every swap-out before any swap-in, before the step's forward
        (on the current stream, behind the step before, whose K/V they may take). Each
        destination appears at most once per list (the scheduler's bookkeeping ensures it)."""
        group = max(1, _STAGING_BYTES // max(self.block_bytes, 1))
        for start in range(0, len(blocks_to_swap_out), group):
            pairs = blocks_to_swap_out[start : start + group]
            src = _index([s for s, _ in pairs], self.device)
            stage = torch.empty((len(pairs), self.block_bytes), dtype=torch.uint8,
                                device=self.device)  # fmt: skip
            for i, cache in enumerate(device_caches):
                # [2, n, ...] gathered, then [n, 2, ...] into the layer's bytes of each block
                self._layer(stage, i).copy_(_bytes(cache).index_select(1, src).transpose(0, 1))
            for first_row, host in self._host_runs([d for _, d in pairs]):
                host.copy_(stage[first_row : first_row + len(host)], non_blocking=True)
        for start in range(0, len(blocks_to_swap_in), group):
            pairs = blocks_to_swap_in[start : start + group]
            stage = torch.empty((len(pairs), self.block_bytes), dtype=torch.uint8,
                                device=self.device)  # fmt: skip
            for first_row, host in self._host_runs([s for s, _ in pairs]):
                stage[first_row : first_row + len(host)].copy_(host, non_blocking=True)
            dst = _index([d for _, d in pairs], self.device)
            for i, cache in enumerate(device_caches):
                _bytes(cache).index_copy_(1, dst, self._layer(stage, i).transpose(0, 1))


def chunk_blocks(num_blocks: int, block_bytes: int) -> list[int]:
    """How many blocks each host allocation of a CPU KV cache takes: the most blocks that fit
    in the largest power of two of bytes not above what is left, until none are left.

    torch's pinned-memory allocator (CachingHostAllocator) rounds every allocation up to a
    power of two bytes, so one tensor of 40 GiB would pin 64 GiB; in these chunks each
    allocation wastes less than a block, and there are about log2(num_blocks) of them."""
    if block_bytes <= 0:  # no attention layer on this rank: nothing to round
        return [num_blocks]
    lengths = []
    left = num_blocks
    while left > 0:
        power = 1 << ((left * block_bytes).bit_length() - 1)  # <= left * block_bytes
        length = power // block_bytes or left  # (under one block: the last block alone)
        lengths.append(length)
        left -= length
    return lengths


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(list index, first id, length) of the runs of consecutive ids in `ids`: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for i, block_id in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((i, block_id, 1))
    return runs


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes, as uint8 (index_select and index_copy_ take no float8): the last
    dimension becomes head_dim * itemsize."""
    return cache.view(torch.uint8)


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)
