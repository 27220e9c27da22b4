"""FP8 KV cache on the torch reference backend: the quantize/dequantize round trip (error
bound, saturation), the write at slots, and attention over an fp8 cache against a float32 one."""

import math

import pytest
import torch

from pagedserve.attention.kv_quant import (
    dequantize_kv,
    fp8_max,
    kv_cache_torch_dtype,
    quantize_kv,
)
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_backend import TorchAttentionBackend, gather_kv, write_kv_cache

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# (mantissa bits, smallest normal exponent) of each format: a value rounds to within half a
# unit in the last place, 2^-(m+1) relative for normals, 2^(e_min-m-1) absolute below.
FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def test_kv_cache_dtype_names_map_to_torch_dtypes() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'fp8'.*got 'int8'"):
        kv_cache_torch_dtype("int8", torch.float32)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.037, 8.0])
def test_round_trip_error_within_half_an_ulp(dtype: torch.dtype, scale: float) -> None:
    mantissa_bits, min_exponent = FORMAT[dtype]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * scale * 20
    x = x[(x / scale).abs() <= fp8_max(dtype)]  # in range: no saturation
    scale_t = torch.tensor([scale])
    stored = quantize_kv(x, scale_t, dtype)
    assert stored.dtype == dtype
    back = dequantize_kv(stored, scale_t, torch.float32)
    bound = torch.maximum(
        x.abs() * 2.0 ** -(mantissa_bits + 1),
        torch.tensor(2.0 ** (min_exponent - mantissa_bits - 1) * scale),
    )
    error = (back - x).abs()
    assert (error <= bound * (1 + 1e-6)).all(), (error / bound).max()
    assert error.max() > 0  # it did quantize


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_instead_of_overflowing(dtype: torch.dtype) -> None:
    limit = fp8_max(dtype)
    x = torch.tensor([1e9, -1e9, limit * 3, 1.0]) * 2.0
    stored = quantize_kv(x, torch.tensor([2.0]), dtype)
    assert stored.float().tolist() == [limit, -limit, limit, 1.0]
    assert dequantize_kv(stored, torch.tensor([2.0]), torch.float32).tolist() == [
        2 * limit,
        -2 * limit,
        2 * limit,
        2.0,
    ]
    # Without the clamp the cast itself gives inf (e5m2) or NaN (e4m3fn on CUDA) out of range.
    if dtype == torch.float8_e5m2:
        assert torch.tensor([1e9]).to(dtype).float().isinf().all()


@pytest.mark.parametrize("dtype", FP8)
def test_write_kv_cache_stores_scaled_fp8_at_the_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(5, 2, 8, generator=gen) * 3
    value = torch.randn(5, 2, 8, generator=gen) * 1000  # some saturate
    cache = torch.zeros(2, 4, 4, 2, 8, dtype=dtype)
    slots = torch.tensor([3, -1, 0, 13, 6])
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([0.25])
    write_kv_cache(key, value, cache, slots, k_scale, v_scale)
    flat = cache.view(torch.uint8).view(2, 16, 2, 8)
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(flat[0, slot], quantize_kv(key[token], k_scale, dtype).view(torch.uint8))
        assert torch.equal(
            flat[1, slot], quantize_kv(value[token], v_scale, dtype).view(torch.uint8)
        )
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(16) if s not in written]
    assert not flat[:, untouched].any()


def _random_batch(
    query_lens: list[int], context_lens: list[int], block_size: int = 4
) -> AttentionMetadata:
    """Metadata of a ragged batch whose requests own consecutive blocks."""
    tables, slots, first = [], [], 1  # block 0 left unused
    for context, query_len in zip(context_lens, query_lens, strict=True):
        n = -(-(context + query_len) // block_size)
        tables.append(list(range(first, first + n)))
        slots += [first * block_size + pos for pos in range(context, context + query_len)]
        first += n
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(
        [c + q for c, q in zip(context_lens, query_lens, strict=True)], dtype=torch.int32
    )
    return AttentionMetadata(
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("dtype", FP8)
def test_torch_attention_over_fp8_cache(dtype: torch.dtype) -> None:
    """Prefill, decode and a chunk after a cached prefix in one batch. The fp8 result equals
    float32 attention over the dequantized cache (the scales are applied exactly once) and
    is close to attention over an unquantized float32 cache."""
    query_lens, context_lens = [7, 1, 3, 1], [0, 20, 9, 33]
    md = _random_batch(query_lens, context_lens)
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_blocks = sum(query_lens), 24
    query = torch.randn(num_tokens, 4, 16, generator=gen)
    key = torch.randn(num_tokens, 2, 16, generator=gen) * 0.2  # K/V of 0.2 and 5: the scales
    value = torch.randn(num_tokens, 2, 16, generator=gen) * 5  # bring both into fp8's range
    k_scale, v_scale = torch.tensor([0.2 * 4 / fp8_max(dtype)]), torch.tensor([5 * 4 / 448])
    cache32 = torch.zeros(2, num_blocks, 4, 2, 16)
    # The cached prefixes: random K/V already in the cache (written by earlier steps).
    prefix = torch.randn(2, num_blocks, 4, 2, 16, generator=gen)
    cache32[0], cache32[1] = prefix[0] * 0.2, prefix[1] * 5
    cache8 = torch.empty_like(cache32, dtype=dtype)
    cache8[0], cache8[1] = (
        quantize_kv(cache32[0], k_scale, dtype),
        quantize_kv(cache32[1], v_scale, dtype),
    )
    scale = 1 / math.sqrt(16)
    backend = TorchAttentionBackend()

    out8 = backend.forward(query, key, value, cache8, md, scale, k_scale, v_scale)
    out32 = backend.forward(query, key, value, cache32, md, scale)

    def round_trip(x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        return dequantize_kv(quantize_kv(x, x_scale, dtype), x_scale, torch.float32)

    dequantized = torch.stack([round_trip(cache32[0], k_scale), round_trip(cache32[1], v_scale)])
    exact = backend.forward(
        query, round_trip(key, k_scale), round_trip(value, v_scale), dequantized, md, scale
    )

    assert torch.allclose(out8, exact, rtol=1e-5, atol=1e-6)
    error = ((out8 - out32).norm() / out32.norm()).item()
    assert error < {torch.float8_e4m3fn: 0.04, torch.float8_e5m2: 0.08}[dtype], error
    assert error > 1e-4  # the cache really was quantized
    keys, _ = gather_kv(cache8, md.block_tables, md.max_seq_len)
    assert keys.dtype == dtype
