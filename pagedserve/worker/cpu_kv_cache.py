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
    """Per attention layer a [2, num_blocks, block_size, num_kv_heads, head_dim] tensor in the
    device cache's dtype (layer i's for `device_caches[i]`), in pinned memory when the device
    is a GPU (for copies that the device's DMA engine does).

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
                    (cache.shape[0], num_blocks, *cache.shape[2:]),
                    dtype=cache.dtype,
                    pin_memory=pin,
                )
                for cache in device_caches
            ]
        except RuntimeError as e:
            num_bytes = sum(c.numel() * c.element_size() for c in device_caches)
            per_block = num_bytes // max(device_caches[0].shape[1], 1) if device_caches else 0
            raise ValueError(
                f"a CPU KV cache of {num_blocks} blocks ({num_blocks * per_block / 2**30:.2f} "
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
        (they go on the current stream, behind the step before). Swap-outs wait for the
        device (their data must be on the host before a later step reads it there); a
        destination appears at most once per list (the scheduler's bookkeeping ensures it).
        """
        if blocks_to_swap_out:
            src = _index([s for s, _ in blocks_to_swap_out], self.device)
            dst = _index([d for _, d in blocks_to_swap_out], torch.device("cpu"))
            gathered = [_bytes(cache).index_select(1, src) for cache in device_caches]
            if self.device.type == "cuda":
                staged = []
                for blocks in gathered:
                    host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
                    host.copy_(blocks, non_blocking=True)
                    staged.append(host)
                torch.cuda.current_stream(self.device).synchronize()
                gathered = staged
            for cpu_cache, blocks in zip(self.caches, gathered, strict=True):
                _bytes(cpu_cache).index_copy_(1, dst, blocks)
        if blocks_to_swap_in:
            src = _index([s for s, _ in blocks_to_swap_in], torch.device("cpu"))
            dst = _index([d for _, d in blocks_to_swap_in], self.device)
            pin = self.device.type == "cuda"
            for cpu_cache, cache in zip(self.caches, device_caches, strict=True):
                source = _bytes(cpu_cache)
                shape = (source.shape[0], len(blocks_to_swap_in), *source.shape[2:])
                host = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
                torch.index_select(source, 1, src, out=host)
                # From pinned memory the copy is asynchronous; the host allocator keeps `host`
                # alive until it is done.
                blocks = host.to(self.device, non_blocking=True)
                _bytes(cache).index_copy_(1, dst, blocks)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes: [2, num_blocks, block_size, num_kv_heads, head_dim * itemsize]
    uint8 (index_select and index_copy_ take no float8)."""
    return cache.view(torch.uint8)


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)
