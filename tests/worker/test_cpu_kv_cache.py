"""CpuKVCache: block copies between the device's KV cache and host memory, byte for byte."""

import pytest
import torch

from pagedserve.worker import cpu_kv_cache
from pagedserve.worker.cpu_kv_cache import CpuKVCache, _runs, chunk_blocks


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
    for i, cache in enumerate(caches):  # the typed views
        for device_id, cpu_id in ((1, 3), (2, 4), (5, 0)):
            assert cpu.block(i, cpu_id).dtype == dtype
            assert torch.equal(
                cpu.block(i, cpu_id).view(torch.uint8), cache[:, device_id].view(torch.uint8)
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
    assert torch.equal(cpu.block(0, 1), old)
    assert torch.equal(cache[:, 0], cache[:, 1])


def test_host_chunks_are_powers_of_two_bytes_where_the_blocks_allow() -> None:
    """torch's pinned allocator rounds each allocation up to a power of two bytes: the chunks
    waste less than a block each, and take every block."""
    mib = 2**20
    assert chunk_blocks(20480, 2 * mib) == [16384, 4096]  # 40 GiB: 32 + 8 GiB, nothing lost
    assert chunk_blocks(1, 3 * mib) == [1]
    assert chunk_blocks(7, 0) == [7]  # a rank without attention layers
    CpuKVCache([], num_blocks=7).swap([], [], [])
    for num_blocks, block_bytes in ((1000, 7 * mib // 4), (37, 3), (1, 1), (64, 64)):
        lengths = chunk_blocks(num_blocks, block_bytes)
        assert sum(lengths) == num_blocks and min(lengths) > 0
        for length in lengths:
            size = length * block_bytes
            pinned = 1 << (size - 1).bit_length()  # what the allocator takes
            assert pinned - size < block_bytes or length == 1
        assert len(lengths) <= 2 * num_blocks.bit_length()


@pytest.mark.parametrize("seed", range(20))
def test_random_copies_across_chunks_equal_a_block_by_block_copy(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random swap steps over a cache whose CPU blocks span several chunks (runs of
    consecutive ids cross chunk boundaries), through small staging groups: the device caches
    and the CPU blocks equal those of a plain block-by-block reference."""
    import random

    rng = random.Random(seed)
    num_device, num_cpu = 12, rng.choice([5, 13, 31])
    caches = [torch.randn(2, num_device, 2, heads, 4) for heads in (1, 3)]
    cpu = CpuKVCache(caches, num_blocks=num_cpu)
    assert len(cpu.chunks) > 1 or num_cpu == 1
    if seed % 2:
        monkeypatch.setattr(cpu_kv_cache, "_STAGING_BYTES", rng.randint(1, 4) * cpu.block_bytes)
    reference = [[torch.zeros_like(cache[:, 0]) for _ in range(num_cpu)] for cache in caches]
    for _ in range(6):
        outs = list(
            zip(rng.sample(range(num_device), 4), rng.sample(range(num_cpu), 4), strict=True)
        )
        ins = list(
            zip(rng.sample(range(num_cpu), 4), rng.sample(range(num_device), 4), strict=True)
        )
        expected = [cache.clone() for cache in caches]
        for layer, cache in enumerate(expected):
            for device_id, cpu_id in outs:
                reference[layer][cpu_id] = cache[:, device_id].clone()
            for cpu_id, device_id in ins:
                cache[:, device_id] = reference[layer][cpu_id]
        cpu.swap(caches, outs, ins)
        for layer, cache in enumerate(caches):
            assert torch.equal(cache, expected[layer])
            for cpu_id in range(num_cpu):
                assert torch.equal(cpu.block(layer, cpu_id), reference[layer][cpu_id])


def test_a_run_across_chunks_is_split_at_their_boundaries() -> None:
    """13 blocks of 256 bytes are chunks of 8, 4 and 1 blocks; ids 6-9 and 11-12 cross."""
    caches = [torch.randn(2, 4, 2, heads, 4) for heads in (1, 3)]
    cpu = CpuKVCache(caches, num_blocks=13)
    assert [len(chunk) for chunk in cpu.chunks] == [8, 4, 1]
    runs = cpu._host_runs([6, 7, 8, 9, 11, 12])
    assert [(row, len(host)) for row, host in runs] == [(0, 2), (2, 2), (4, 1), (5, 1)]
    assert runs[0][1].data_ptr() == cpu.chunks[0][6].data_ptr()
    assert runs[1][1].data_ptr() == cpu.chunks[1][0].data_ptr()
    assert runs[2][1].data_ptr() == cpu.chunks[1][3].data_ptr()
    assert runs[3][1].data_ptr() == cpu.chunks[2][0].data_ptr()
