"""CpuKVCache: block copies between the device's KV cache and host memory, byte for byte."""

import pytest
import torch

from pagedserve.worker import cpu_kv_cache
from pagedserve.worker.cpu_kv_cache import CpuKVCache, _runs


def test_runs_of_consecutive_ids_are_one_copy_each() -> None:
    assert _runs([4, 5, 6, 0, 9, 10]) == [(0, 4, 3), (3, 0, 1), (4, 9, 2)]
    assert _runs([]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("staging_blocks", [None, 1, 2])
def test_blocks_go_out_and_come_back_in_other_blocks(
    dtype: torch.dtype, staging_blocks: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers of [2, 6 blocks, 4 slots, 2 heads (1 in the second), 8] K/V: blocks 1, 2, 5 go
    to CPU blocks 3, 4, 0; then back into device blocks 0, 3, 4, which then hold exactly
    their bytes (an fp8 cache's too: its scales are per layer, not per block). Through a
    staging buffer of all the blocks at once, or of 1 or 2 blocks (chunks)."""
    torch.manual_seed(0)
    caches = [torch.randn(2, 6, 4, heads, 8).to(dtype) for heads in (2, 1, 2)]
    originals = [c.clone() for c in caches]
    cpu = CpuKVCache(caches, num_blocks=5)
    if staging_blocks is not None:
        monkeypatch.setattr(cpu_kv_cache, "_STAGING_BYTES", staging_blocks * cpu.block_bytes)
    cpu.swap(caches, [(1, 3), (2, 4), (5, 0)], [])
    for cache, cpu_layer in zip(caches, cpu.caches, strict=True):  # the typed views
        for device_id, cpu_id in ((1, 3), (2, 4), (5, 0)):
            assert torch.equal(
                cpu_layer[cpu_id].view(torch.uint8), cache[:, device_id].view(torch.uint8)
            )
    for cache in caches:
        cache.view(torch.uint8).zero_()
    cpu.swap(caches, [], [(3, 0), (4, 3), (0, 4)])
    for cache, original in zip(caches, originals, strict=True):
        for dst, src in ((0, 1), (3, 2), (4, 5)):
            assert torch.equal(cache[:, dst].view(torch.uint8), original[:, src].view(torch.uint8))
        assert not cache[:, 1].view(torch.uint8).any()  # untouched blocks stay as they were


def test_swap_outs_come_before_swap_ins() -> None:
    """One step copies block 0 out to CPU block 1 and CPU block 0 in to block 0: the copy out
    takes block 0's old content."""
    cache = torch.arange(2 * 2 * 1 * 1 * 2, dtype=torch.float32).reshape(2, 2, 1, 1, 2)
    old = cache[:, 0].clone()
    cpu = CpuKVCache([cache], num_blocks=2)
    cpu.swap([cache], [(1, 0)], [])  # CPU block 0 := device block 1
    cpu.swap([cache], [(0, 1)], [(0, 0)])
    assert torch.equal(cpu.caches[0][1], old)
    assert torch.equal(cache[:, 0], cache[:, 1])
