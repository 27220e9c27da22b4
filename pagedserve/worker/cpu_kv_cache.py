"""CpuKVCache: one rank's KV blocks in host memory (swap space and the prefix cache's CPU
tier; the bookkeeping is the scheduler's, `kv_cache/cpu_blocks.py`) and the block copies
between it and the device's KV cache that a SchedulerOutput asks for.

Every tensor-parallel rank holds and copies its own shard (its KV heads) under the same
block ids: the executor sends every rank the same SchedulerOutput. Blocks are copied as raw
bytes (a uint8 view), so an fp8 cache keeps its exact values; its per-layer `k_scale` and
`v_scale` are per tensor and fixed (`attention/kv_quant.py`), the same for a block wherever
it is.
"""

import torch


class CpuKVCache:
    """Per attention layer a [num_blocks, 2, block_size, num_kv_heads, head_dim] tensor in the
    device cache's dtype (layer i's for `device_caches[i]`; block-major, so that a run of
    consecutive blocks is one contiguous copy), in pinned memory when the device is a GPU.

    On a GPU every copy is a DMA on the current stream, and the host never reads or writes
    these tensors: a swap-out (device -> host) of one step and a swap-in (host -> device) of
    a later one are ordered by the stream, with no wait on the host, so async scheduling
    keeps running ahead. On the CPU the copies are plain tensor copies.

    Raises ValueError naming `swap_space` and `kv_offload_gb` when the host cannot allocate it.
    """

    def __init__(self, device_caches: list[torch.Tensor], num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.device = device_caches[0].device if device_caches else torch.device("cpu")
        pin = self.device.type == "cuda"
        try:
            self.caches = [
                torch.zeros(
                    (num_blocks, cache.shape[0], *cache.shape[2:]),
                    dtype=cache.dtype,
                    pin_memory=pin,
                )
                for cache in device_caches
            ]
        except RuntimeError as e:
            block_bytes = sum(c[:, 0].numel() * c.element_size() for c in device_caches)
            raise ValueError(
                f"a CPU KV cache of {num_blocks} blocks ({num_blocks * block_bytes / 2**30:.2f} "
                f"GiB) could not be allocated; lower swap_space or kv_offload_gb: {e}"
            ) from None

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
        if blocks_to_swap_out:
            src = _index([s for s, _ in blocks_to_swap_out], self.device)
            runs = _runs([d for _, d in blocks_to_swap_out])
            for cpu_cache, cache in zip(self.caches, device_caches, strict=True):
                # [n, 2, block_size, heads, head_bytes]: the blocks in list order, contiguous
                blocks = _bytes(cache).index_select(1, src).transpose(0, 1).contiguous()
                host = _bytes(cpu_cache)
                for i, first, length in runs:
                    host[first : first + length].copy_(blocks[i : i + length], non_blocking=True)
        if blocks_to_swap_in:
            dst = _index([d for _, d in blocks_to_swap_in], self.device)
            runs = _runs([s for s, _ in blocks_to_swap_in])
            for cpu_cache, cache in zip(self.caches, device_caches, strict=True):
                host = _bytes(cpu_cache)
                shape = (len(blocks_to_swap_in), *host.shape[1:])
                blocks = torch.empty(shape, dtype=torch.uint8, device=self.device)
                for i, first, length in runs:
                    blocks[i : i + length].copy_(host[first : first + length], non_blocking=True)
                _bytes(cache).index_copy_(1, dst, blocks.transpose(0, 1))


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
