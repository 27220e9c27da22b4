"""Triton store_kv and paged attention kernels against the torch reference backend.

GPU tests draw fresh random inputs per case, poison the output (NaN) and the unused cache
slots, and compare with `TorchAttentionBackend` run in float64. The planner tests need Triton
but no GPU. The fp8 KV cache tests and the small sliding-window / soft-cap tests also run on
the CPU under Triton's interpreter (`TRITON_INTERPRET=1 pytest
tests/attention/test_triton_attention.py -k "fp8 or sliding or alternates or uses_the_splits"`,
which tests/attention/test_triton_interpreter.py runs in every CPU test run; small shapes, no
bf16 dots there), and on the GPU as `gpu` tests. Sliding-window tests fill the blocks wholly
before each request's window with NaN: the KV manager frees those, and they must not be read.
"""

import itertools
import math
import os
import zlib
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.attention.kv_quant import quantize_kv  # noqa: E402
from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.attention.torch_backend import TorchAttentionBackend, write_kv_cache  # noqa: E402
from pagedserve.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    choose_num_splits,
    paged_attention,
    plan_attention,
    store_kv,
)

DEVICE = "cuda"  # tools/scripts may point this at "cpu" under TRITON_INTERPRET=1
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# fp8 KV cache tests: on the GPU, or on the CPU through the interpreter when it is on.
FP8_DEVICE = "cpu" if INTERPRET else DEVICE
gpu_or_interpreter = pytest.mark.skipif(False, reason="") if INTERPRET else pytest.mark.gpu
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}

# A ragged batch: decodes over short and long contexts, full prefills, and prefill chunks
# after a cached prefix (some short enough for the decode launch when the group is small).
QUERY_LENS = [1, 1, 37, 1, 130, 5, 1, 64, 2]
CONTEXT_LENS = [0, 200, 0, 999, 70, 33, 16, 129, 301]


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim], a strided view of a fused qkv
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], random
    metadata: AttentionMetadata
    used_slots: torch.Tensor  # [num_blocks * block_size] bool, slots inside some request


def make_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: str,
) -> AttentionMetadata:
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    slots = []
    for table, context, query_len in zip(block_tables, context_lens, query_lens, strict=True):
        for pos in range(context, context + query_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    width = max(len(t) for t in block_tables) + 1  # a spare padded column, as in real batches
    tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    device: str,
) -> Batch:
    """Random inputs; each request gets randomly chosen physical blocks (spare ones unused)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    num_blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(num_blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for n, context, query_len in zip(num_blocks_per_req, context_lens, query_lens, strict=True):
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        for pos in range(context + query_len):
            used[table[pos // block_size] * block_size + pos % block_size] = True
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(device=device, dtype=dtype)
    query, key, value = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return Batch(
        query=query.view(num_tokens, num_heads, head_dim),
        key=key.view(num_tokens, num_kv_heads, head_dim),
        value=value.view(num_tokens, num_kv_heads, head_dim),
        kv_cache=kv_cache.to(device=device, dtype=dtype),
        metadata=make_metadata(query_lens, context_lens, tables, block_size, device),
        used_slots=used.to(device),
    )


def reference(
    batch: Batch,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention output and the cache after the write, in the cache's own dtype."""
    cache64 = batch.kv_cache.double()
    out = TorchAttentionBackend().forward(
        batch.query.double(), batch.key.double(), batch.value.double(), cache64,
        batch.metadata, scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
    )  # fmt: skip
    written = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, written, batch.metadata.slot_mapping)
    return out, written


def poisoned_cache(batch: Batch) -> torch.Tensor:
    """The cache with NaN in every slot no request owns: the kernel must never let them in."""
    cache = batch.kv_cache.clone()
    num_kv_heads, head_dim = cache.shape[-2:]
    cache.view(2, -1, num_kv_heads, head_dim)[:, ~batch.used_slots] = float("nan")
    return cache


def run_triton(
    batch: Batch,
    scale: float,
    num_splits: int | None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """store_kv then paged_attention into a NaN-filled output; returns (out, cache)."""
    cache = poisoned_cache(batch)
    out = torch.full_like(batch.query, float("nan")).contiguous()
    num_heads, head_dim = batch.query.shape[1:]
    plan = plan_attention(
        batch.metadata, num_heads, batch.key.shape[1], head_dim, batch.query.dtype,
        cache.device, num_splits, sliding_window,
    )  # fmt: skip
    store_kv(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    paged_attention(
        out, batch.query, cache, batch.metadata, scale, plan,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
    )  # fmt: skip
    return out, cache


def check_against_reference(
    batch: Batch,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    scale = 1.0 / math.sqrt(batch.query.shape[-1])
    expected, written = reference(batch, scale, sliding_window, logits_soft_cap)
    out, cache = run_triton(batch, scale, num_splits, sliding_window, logits_soft_cap)
    assert not out.isnan().any(), "some outputs were never written"
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < TOLERANCE[batch.query.dtype], error
    num_kv_heads, head_dim = cache.shape[-2:]
    used = batch.used_slots
    assert torch.equal(
        cache.view(2, -1, num_kv_heads, head_dim)[:, used],
        written.view(2, -1, num_kv_heads, head_dim)[:, used],
    )


def _grid_cases() -> list[tuple[int, int, int, int, torch.dtype]]:
    """Every head dim with every group size (1, 4, 8, MQA); dtypes and block sizes rotate so
    that each appears with each head dim, without compiling the full product."""
    heads = [(8, 8), (8, 2), (16, 2), (8, 1)]  # (num_heads, num_kv_heads)
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    cases = []
    for i, (head_dim, (num_heads, num_kv_heads)) in enumerate(
        itertools.product([64, 80, 96, 128, 256], heads)
    ):
        block_size = [16, 32, 64][(i + i // 3) % 3]
        cases.append((block_size, head_dim, num_heads, num_kv_heads, dtypes[i % 3]))
        if i % 4 == 0:  # a second dtype for a fifth of the cases
            cases.append((block_size, head_dim, num_heads, num_kv_heads, dtypes[(i + 1) % 3]))
    # Tiny test models' heads (stories260k: 8, tinystories-656k: 16), padded to a dot's 16.
    cases += [(16, 8, 8, 4, torch.float32), (32, 16, 8, 4, torch.float16)]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,dtype", _grid_cases())
def test_paged_attention_matches_reference(
    block_size: int, head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    seed = zlib.crc32(repr((block_size, head_dim, num_heads, num_kv_heads, dtype)).encode())
    batch = make_batch(
        QUERY_LENS, CONTEXT_LENS, block_size, num_heads, num_kv_heads, head_dim, dtype, seed,
        DEVICE,
    )  # fmt: skip
    check_against_reference(batch)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_splits,num_heads,num_kv_heads,head_dim,dtype,query_lens,context_lens",
    [
        # Llama-3-8B heads, bf16; more splits than some requests have tiles (empty splits).
        (8, 32, 8, 128, torch.bfloat16, [1, 1, 1], [4000, 17, 700]),
        (3, 32, 8, 128, torch.float16, [1, 1, 1, 1], [1500, 64, 63, 2500]),
        # MQA with a padded head dim, fp32; a query of 2 tokens still fits one q block.
        (5, 8, 1, 80, torch.float32, [1, 2, 1], [900, 333, 0]),
        # Split decode launch next to a prefill launch in one mixed batch.
        (4, 16, 8, 128, torch.bfloat16, QUERY_LENS, CONTEXT_LENS),
        # gpt2-large heads.
        (64, 20, 20, 64, torch.float16, [1, 1], [3000, 129]),
    ],
)
def test_split_kv_matches_reference(
    num_splits: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    query_lens: list[int],
    context_lens: list[int],
) -> None:
    seed = zlib.crc32(repr((num_splits, num_heads, head_dim, dtype)).encode())
    batch = make_batch(
        query_lens, context_lens, 16, num_heads, num_kv_heads, head_dim, dtype, seed, DEVICE
    )
    check_against_reference(batch, num_splits=num_splits)


@gpu_or_interpreter
@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_split_kv_uses_the_splits_each_request_needs(num_splits: int) -> None:
    """A launch of up to 64 splits (as a graph captured at a long max_model_len plans) over
    short requests: each request uses at most cdiv(its tiles, split_min_tiles) splits, the
    rest exit, and the combine merges only the used ones. Decode q blocks of 1-4 tokens,
    whose later rows see keys the earlier rows do not (-inf partials). Runs under
    TRITON_INTERPRET=1 too (fp32: 32-key tiles)."""
    batch = make_batch(
        [1, 4, 2, 1, 3, 1], [0, 300, 61, 130, 5, 2000], 4, 8, 2, 16, torch.float32,
        zlib.crc32(repr(("used splits", num_splits)).encode()), FP8_DEVICE,
    )  # fmt: skip
    check_against_reference(batch, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 8, 128), (64, 20, 80)])
def test_store_kv_matches_write_kv_cache(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    batch = make_batch(
        QUERY_LENS, CONTEXT_LENS, block_size, num_kv_heads, num_kv_heads, head_dim, dtype, 7,
        DEVICE,
    )  # fmt: skip
    slot_mapping = batch.metadata.slot_mapping.clone()
    slot_mapping[::5] = -1  # padding tokens write nothing
    expected = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, expected, slot_mapping)
    actual = batch.kv_cache.clone()
    store_kv(batch.key, batch.value, actual, slot_mapping)
    assert torch.equal(actual, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_padded_decode_batch_writes_only_real_tokens(num_splits: int) -> None:
    """A CUDA-graph-style batch: padding requests with seq_len 0 / query_len 0, and padding
    tokens (slot -1) past query_start_loc[-1]; real outputs match, padding stays untouched."""
    batch = make_batch([1, 1, 1], [40, 300, 7], 16, 32, 8, 128, torch.bfloat16, 3, DEVICE)
    scale = 1.0 / math.sqrt(128)
    expected, _ = reference(batch, scale)
    md, num_pad = batch.metadata, 2
    width = md.block_tables.shape[1]
    padded = AttentionMetadata(
        query_start_loc=torch.cat([md.query_start_loc, md.query_start_loc[-1:].repeat(num_pad)]),
        seq_lens=torch.cat([md.seq_lens, md.seq_lens.new_zeros(num_pad)]),
        block_tables=torch.cat([md.block_tables, md.block_tables.new_zeros(num_pad, width)]),
        slot_mapping=torch.cat([md.slot_mapping, md.slot_mapping.new_full((num_pad,), -1)]),
        max_query_len=1,
        max_seq_len=md.max_seq_len,
        query_start_loc_cpu=torch.cat(
            [md.query_start_loc_cpu, md.query_start_loc_cpu[-1:].repeat(num_pad)]
        ),
        seq_lens_cpu=torch.cat([md.seq_lens_cpu, md.seq_lens_cpu.new_zeros(num_pad)]),
    )
    query, key, value = (torch.cat([x, x[:num_pad]]) for x in (batch.query, batch.key, batch.value))
    cache = poisoned_cache(batch)
    cache_before = cache.clone()
    out = torch.full_like(query, float("nan"))
    plan = plan_attention(padded, 32, 8, 128, query.dtype, cache.device, num_splits)
    assert plan.prefill is None and plan.decode is not None
    store_kv(key, value, cache, padded.slot_mapping)
    paged_attention(out, query, cache, padded, scale, plan)
    error = ((out[:3].double() - expected).norm() / expected.norm()).item()
    assert error < 2e-2, error
    assert out[3:].isnan().all(), "padding tokens must not be written"
    unused = ~batch.used_slots
    num_kv_heads, head_dim = cache.shape[-2:]
    assert cache.view(2, -1, num_kv_heads, head_dim)[:, unused].isnan().all()
    assert not torch.equal(cache.nan_to_num(), cache_before.nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 6])
def test_backend_forward_matches_reference(num_splits: int | None) -> None:
    batch = make_batch(
        QUERY_LENS, CONTEXT_LENS, 16, 32, 8, 128, torch.bfloat16, 11 + (num_splits or 0), DEVICE
    )
    scale = 0.3
    expected, _ = reference(batch, scale)
    backend = TritonAttentionBackend(num_splits=num_splits)
    out = backend.forward(
        batch.query, batch.key, batch.value, poisoned_cache(batch), batch.metadata, scale
    )
    assert out.shape == batch.query.shape and not out.isnan().any()
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < 2e-2, error


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window,logits_soft_cap", [(None, None), (700, 30.0)])
def test_decode_step_replays_in_a_cuda_graph(
    sliding_window: int | None, logits_soft_cap: float | None
) -> None:
    """Capture one decode step, then change the lengths, block tables and inputs in place and
    replay: the graph must compute the new step (no host values baked in but the grid). With a
    window, the replayed step's out-of-window blocks hold NaN."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    first = make_batch([1] * 4, [100, 5, 2000, 37], block_size, num_heads, num_kv_heads,
                       head_dim, torch.bfloat16, 21, DEVICE)  # fmt: skip
    second = make_batch([1] * 4, [1500, 900, 3, 64], block_size, num_heads, num_kv_heads,
                        head_dim, torch.bfloat16, 22, DEVICE)  # fmt: skip
    window = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if sliding_window is not None:
        free_out_of_window(second, sliding_window)
    num_blocks = max(first.kv_cache.shape[1], second.kv_cache.shape[1])
    width = max(first.metadata.block_tables.shape[1], second.metadata.block_tables.shape[1])

    def static(batch: Batch) -> tuple[torch.Tensor, ...]:
        cache = batch.kv_cache.new_zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
        cache[:, : batch.kv_cache.shape[1]] = poisoned_cache(batch)
        tables = batch.metadata.block_tables.new_zeros(4, width)
        tables[:, : batch.metadata.block_tables.shape[1]] = batch.metadata.block_tables
        return cache, tables

    cache, tables = static(first)
    md = first.metadata
    graph_md = AttentionMetadata(
        md.query_start_loc.clone(), md.seq_lens.clone(), tables, md.slot_mapping.clone(),
        1, 4096, md.query_start_loc_cpu, md.seq_lens_cpu,
    )  # fmt: skip
    query, key, value = first.query.clone(), first.key.clone(), first.value.clone()
    backend = TritonAttentionBackend()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(query, key, value, cache.clone(), graph_md, 0.1, **window)  # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(query, key, value, cache, graph_md, 0.1, **window)

    new_cache, new_tables = static(second)
    cache.copy_(new_cache)
    tables.copy_(new_tables)
    graph_md.seq_lens.copy_(second.metadata.seq_lens)
    graph_md.slot_mapping.copy_(second.metadata.slot_mapping)
    query.copy_(second.query), key.copy_(second.key), value.copy_(second.value)
    graph.replay()
    expected, _ = reference(second, 0.1, sliding_window, logits_soft_cap)
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < 2e-2, error


def _metadata_with(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    tables = [list(range(-(-s // 16))) for s in seq_lens]
    contexts = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
    return make_metadata(query_lens, contexts, tables, 16, "cpu")


def test_split_heuristic_fills_the_gpu_only_when_needed() -> None:
    def splits(programs: int, max_keys: int) -> int:
        return choose_num_splits(programs, max_keys, num_sms=132, min_keys=128)

    assert splits(8, 8192) == 64  # 4 * 132 // 8 = 66 wanted, 64 at most
    assert splits(8, 1024) == 8  # 128 keys each
    assert splits(128, 8192) == 4
    assert splits(512, 8192) == 1
    assert splits(1, 100_000) == 64
    assert splits(8, 100) == 1


def test_a_forced_split_count_beyond_the_combine_is_refused() -> None:
    """The combine loads at most 64 splits' partials: a forced count outside 1..64 is a
    ValueError, from the backend's constructor and from paged_attention itself."""
    with pytest.raises(ValueError, match="num_splits must be 1..64"):
        TritonAttentionBackend(num_splits=65)
    with pytest.raises(ValueError, match="num_splits must be 1..64"):
        TritonAttentionBackend(num_splits=0)
    md = _metadata_with([1], [100])
    plan = plan_attention(md, 8, 8, 64, torch.float32, torch.device("cpu"), 65)
    query = torch.zeros(1, 8, 64)
    cache = torch.zeros(2, 8, 16, 8, 64)
    with pytest.raises(ValueError, match="num_splits must be 1..64, got 65"):
        paged_attention(torch.empty_like(query), query, cache, md, 0.125, plan)


def test_plan_routes_requests_by_query_len() -> None:
    cpu = torch.device("cpu")
    decode_only = plan_attention(_metadata_with([1, 1], [4000, 30]), 32, 8, 128,
                                 torch.bfloat16, cpu)  # fmt: skip
    assert decode_only.prefill is None and decode_only.decode is not None
    assert decode_only.decode_max_query_len == 4 and decode_only.num_splits > 1
    mixed = plan_attention(_metadata_with([1, 300], [4000, 300]), 32, 8, 128, torch.bfloat16, cpu)
    assert mixed.decode is not None and mixed.prefill is not None
    prefill_only = plan_attention(_metadata_with([50, 300], [50, 300]), 32, 8, 128,
                                  torch.bfloat16, cpu)  # fmt: skip
    assert prefill_only.decode is None and prefill_only.prefill is not None
    forced = plan_attention(_metadata_with([1], [9000]), 8, 8, 64, torch.float16, cpu, 1)
    assert forced.num_splits == 1


# --- FP8 KV cache ---------------------------------------------------------------------------

FP8_FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
_FP8_NAN = 0x7F  # a NaN byte in both formats


def make_fp8_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    seed: int,
) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """`make_batch` with K ~ 3 N(0, 1) and V ~ 0.5 N(0, 1) (new and cached), the cache
    quantized to `cache_dtype` with scales that put them in the format's range; returns the
    batch, k_scale and v_scale."""
    batch = make_batch(query_lens, context_lens, 16, num_heads, num_kv_heads, head_dim, dtype,
                       seed, FP8_DEVICE)  # fmt: skip
    k_scale = torch.tensor([3 * 6 / 448], device=FP8_DEVICE)
    v_scale = torch.tensor([0.5 * 6 / 448], device=FP8_DEVICE)
    cache = torch.empty_like(batch.kv_cache, dtype=cache_dtype)
    cache[0] = quantize_kv(batch.kv_cache[0] * 3, k_scale, cache_dtype)
    cache[1] = quantize_kv(batch.kv_cache[1] * 0.5, v_scale, cache_dtype)
    batch.key, batch.value, batch.kv_cache = batch.key * 3, batch.value * 0.5, cache
    return batch, k_scale, v_scale


def poisoned_fp8_cache(batch: Batch) -> torch.Tensor:
    """The fp8 cache with NaN in every slot no request owns."""
    cache = batch.kv_cache.clone()
    num_kv_heads, head_dim = cache.shape[-2:]
    cache.view(torch.uint8).view(2, -1, num_kv_heads, head_dim)[:, ~batch.used_slots] = _FP8_NAN
    return cache


def check_fp8_against_reference(
    batch: Batch, k_scale: torch.Tensor, v_scale: torch.Tensor, num_splits: int | None = None
) -> None:
    """Triton over the fp8 cache vs the torch backend over the same cache in float64: the
    same fp8 bytes written, and the outputs within the query dtype's tolerance."""
    scale = 1.0 / math.sqrt(batch.query.shape[-1])
    written = batch.kv_cache.clone()
    expected = TorchAttentionBackend().forward(
        batch.query.double(), batch.key.double(), batch.value.double(), written,
        batch.metadata, scale, k_scale, v_scale,
    )  # fmt: skip
    cache = poisoned_fp8_cache(batch)
    out = torch.full_like(batch.query, float("nan")).contiguous()
    num_heads, head_dim = batch.query.shape[1:]
    plan = plan_attention(batch.metadata, num_heads, batch.key.shape[1], head_dim,
                          batch.query.dtype, cache.device, num_splits)  # fmt: skip
    # The interpreter's float32 -> fp8 cast mis-rounds (no carry into the exponent): there
    # the torch write stands in, and store_kv's bytes are checked on the GPU only.
    write = write_kv_cache if INTERPRET else store_kv
    write(batch.key, batch.value, cache, batch.metadata.slot_mapping, k_scale, v_scale)
    paged_attention(out, batch.query, cache, batch.metadata, scale, plan, k_scale, v_scale)
    assert not out.isnan().any(), "some outputs were never written"
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < TOLERANCE[batch.query.dtype], error
    num_kv_heads = cache.shape[-2]
    used = batch.used_slots
    assert torch.equal(
        cache.view(torch.uint8).view(2, -1, num_kv_heads, head_dim)[:, used],
        written.view(torch.uint8).view(2, -1, num_kv_heads, head_dim)[:, used],
    )


def _fp8_cases() -> list[object]:
    """(num_splits, num_heads, num_kv_heads, head_dim, query dtype, cache dtype); bf16 only
    on the GPU (the interpreter's bf16 dot is wrong)."""
    cases: list[object] = [
        (None, 8, 2, 64, torch.float16, torch.float8_e4m3fn),
        (None, 8, 8, 16, torch.float32, torch.float8_e5m2),
        (3, 8, 1, 80, torch.float16, torch.float8_e4m3fn),  # MQA, padded head dim, split-KV
        pytest.param(None, 32, 8, 128, torch.bfloat16, torch.float8_e4m3fn, marks=pytest.mark.gpu),
        pytest.param(4, 16, 8, 128, torch.bfloat16, torch.float8_e5m2, marks=pytest.mark.gpu),
    ]
    return cases


@gpu_or_interpreter
@pytest.mark.parametrize("num_splits,num_heads,num_kv_heads,head_dim,dtype,cache_dtype",
                         _fp8_cases())  # fmt: skip
def test_fp8_cache_paged_attention_matches_reference(
    num_splits: int | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
) -> None:
    """A ragged batch (decodes over long contexts, a full prefill, chunks after a cached
    prefix: prefix-cache hits and chunked prefill read the fp8 cache the same way)."""
    seed = zlib.crc32(repr((num_splits, num_heads, head_dim, dtype, cache_dtype)).encode())
    query_lens, context_lens = [1, 1, 37, 5, 1, 20], [0, 300, 0, 33, 129, 70]
    batch, k_scale, v_scale = make_fp8_batch(query_lens, context_lens, num_heads, num_kv_heads,
                                             head_dim, dtype, cache_dtype, seed)  # fmt: skip
    check_fp8_against_reference(batch, k_scale, v_scale, num_splits)


@gpu_or_interpreter
@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
)
def test_fp8_store_kv_matches_write_kv_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Same bytes as the torch write, out-of-range values saturated, -1 slots skipped. The
    interpreter's float32 -> fp8 cast mis-rounds (no carry into the exponent), so there K/V
    are taken on the fp8 grid times power-of-two scales, where no rounding happens."""
    batch, k_scale, v_scale = make_fp8_batch([3, 1, 9], [0, 40, 7], 8, 4, 80, dtype,
                                             cache_dtype, 5)  # fmt: skip
    if INTERPRET:
        k_scale.fill_(0.25), v_scale.fill_(2.0**-6)
        for x, x_scale in ((batch.key, k_scale), (batch.value, v_scale)):
            x.copy_(quantize_kv(x, x_scale, cache_dtype).to(dtype) * x_scale.to(dtype))
    key = batch.key.clone()
    key[::4] *= 2.0**40  # far out of range: must clamp to +-max, not overflow
    slot_mapping = batch.metadata.slot_mapping.clone()
    slot_mapping[1::5] = -1
    expected = batch.kv_cache.clone()
    write_kv_cache(key, batch.value, expected, slot_mapping, k_scale, v_scale)
    actual = batch.kv_cache.clone()
    store_kv(key, batch.value, actual, slot_mapping, k_scale, v_scale)
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
    assert not actual.float().isnan().any() and not actual.float().isinf().any()
    assert actual[0].float().abs().max().item() == torch.finfo(cache_dtype).max


@pytest.mark.gpu
def test_fp8_scales_are_read_at_graph_replay() -> None:
    """A decode step over an fp8 cache captured in a CUDA graph; changing k_scale and v_scale
    in place then replaying gives the result for the new scales (they are device tensors read
    by the kernels, not host floats baked into the graph)."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    batch, k_scale, v_scale = make_fp8_batch([1] * 4, [100, 5, 700, 37], 32, 8, 128,
                                             torch.bfloat16, torch.float8_e4m3fn, 9)  # fmt: skip
    backend = TritonAttentionBackend()
    query, key, value, cache = batch.query.clone(), batch.key, batch.value, batch.kv_cache
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(query, key, value, cache.clone(), batch.metadata, 0.1, k_scale, v_scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    graph_cache = cache.clone()
    with torch.cuda.graph(graph):
        out = backend.forward(query, key, value, graph_cache, batch.metadata, 0.1, k_scale,
                              v_scale)  # fmt: skip
    k_scale.mul_(1.5)
    v_scale.mul_(2.0)
    graph_cache.copy_(cache)
    graph.replay()
    expected = TorchAttentionBackend().forward(
        batch.query.double(), key.double(), value.double(), cache.clone(), batch.metadata, 0.1,
        k_scale, v_scale,
    )  # fmt: skip
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < 2e-2, error


# --- Sliding window and logit soft cap ------------------------------------------------------


def free_out_of_window(batch: Batch, sliding_window: int) -> None:
    """Mark as unused (so `poisoned_cache` fills them with NaN) the blocks of each request that
    lie wholly before its first new token's window: those the KV manager frees and reuses."""
    md = batch.metadata
    starts, seq_lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
    used = batch.used_slots.view(-1, batch.kv_cache.shape[2])  # [num_blocks, block_size]
    for i, table in enumerate(md.block_tables.cpu().tolist()):
        first_query = seq_lens[i] - (starts[i + 1] - starts[i])
        for logical in range(max(first_query - sliding_window + 1, 0) // used.shape[1]):
            used[table[logical]] = False


# (window, soft cap, num_splits, num_heads, num_kv_heads, head_dim, dtype, block_size):
# windows of one key, shorter than a tile, cutting tiles, and longer than every sequence.
_WINDOW_CASES = [
    (1, None, None, 4, 2, 16, torch.float32, 4),
    (5, None, None, 8, 2, 32, torch.float32, 4),
    (16, 30.0, 3, 4, 1, 16, torch.float32, 8),  # split-KV: empty splits, lead-masked tiles
    (33, 5.0, None, 4, 4, 16, torch.float16, 16),
    (1000, None, 2, 4, 2, 16, torch.float32, 4),  # wider than every sequence
    (None, 2.0, None, 8, 2, 16, torch.float32, 8),  # soft cap alone
]
# Decodes over long contexts, prefills and chunks after a prefix (several q blocks each).
_WINDOW_QUERY_LENS = [1, 1, 40, 1, 23, 3]
_WINDOW_CONTEXT_LENS = [0, 70, 0, 90, 50, 25]


@gpu_or_interpreter
@pytest.mark.parametrize(
    "sliding_window,logits_soft_cap,num_splits,num_heads,num_kv_heads,head_dim,dtype,block_size",
    _WINDOW_CASES,
)
def test_sliding_window_and_soft_cap_match_reference(
    sliding_window: int | None,
    logits_soft_cap: float | None,
    num_splits: int | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
) -> None:
    """Small shapes (they also run under TRITON_INTERPRET=1 on the CPU): both launches, the
    split decode path, and NaN in every block wholly before a request's window."""
    seed = zlib.crc32(repr((sliding_window, logits_soft_cap, head_dim, dtype)).encode())
    batch = make_batch(
        _WINDOW_QUERY_LENS, _WINDOW_CONTEXT_LENS, block_size, num_heads, num_kv_heads, head_dim,
        dtype, seed, FP8_DEVICE,
    )  # fmt: skip
    if sliding_window is not None:
        free_out_of_window(batch, sliding_window)
    check_against_reference(batch, num_splits, sliding_window, logits_soft_cap)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,dtype", _grid_cases()[::3])
@pytest.mark.parametrize("sliding_window,logits_soft_cap", [(1, None), (100, 50.0), (257, None)])
def test_sliding_window_grid_matches_reference(
    block_size: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    sliding_window: int,
    logits_soft_cap: float | None,
) -> None:
    """The GPU grid of head dims, groups, dtypes and block sizes, with windows and soft caps
    on the ragged batch; out-of-window blocks hold NaN."""
    seed = zlib.crc32(repr((block_size, head_dim, num_heads, sliding_window, dtype)).encode())
    batch = make_batch(
        QUERY_LENS, CONTEXT_LENS, block_size, num_heads, num_kv_heads, head_dim, dtype, seed,
        DEVICE,
    )  # fmt: skip
    free_out_of_window(batch, sliding_window)
    check_against_reference(batch, None, sliding_window, logits_soft_cap)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_sliding_window_long_context_split_kv(num_splits: int | None) -> None:
    """Decodes over 40k-token contexts with a 4096 window (Mistral 7B v0.1): splits share the
    window's tiles; everything before the window is NaN."""
    batch = make_batch(
        [1, 1, 1, 7], [40_000, 17, 7000, 5000], 16, 32, 8, 128, torch.bfloat16, 5, DEVICE
    )
    free_out_of_window(batch, 4096)
    check_against_reference(batch, num_splits, 4096, None)


def test_split_heuristic_counts_the_window_not_the_sequence() -> None:
    cpu = torch.device("cpu")
    md = _metadata_with([1, 1], [100_000, 30])
    assert plan_attention(md, 32, 8, 128, torch.bfloat16, cpu).num_splits > 1
    windowed = plan_attention(md, 32, 8, 128, torch.bfloat16, cpu, sliding_window=100)
    assert windowed.num_splits == 1  # 103 keys per program: one 64-key tile's worth


@gpu_or_interpreter
def test_backend_alternates_local_and_global_layers() -> None:
    """Gemma-style layers on one step's metadata: the backend keeps a plan per window (a
    decode over 600 keys splits without a window, not with a 20-key one), and each layer's
    output matches the reference with its own window and soft cap."""
    batch = make_batch([1, 1, 9], [600, 3, 40], 8, 4, 2, 16, torch.float32, 31, FP8_DEVICE)
    backend = TritonAttentionBackend()
    scale = 0.25
    for sliding_window, logits_soft_cap in [(20, 50.0), (None, 50.0), (20, None)]:
        expected, _ = reference(batch, scale, sliding_window, logits_soft_cap)
        out = backend.forward(
            batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata, scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip
        error = ((out.double() - expected).norm() / expected.norm()).item()
        assert error < TOLERANCE[torch.float32], (sliding_window, error)
    splits = {key[-1]: plan.num_splits for key, plan in backend._plans.items()}
    assert splits[None] > 1 and splits[20] == 1
