"""The fused MoE (pagedserve/layers/moe/fused_moe.py and its Triton kernels) against
`moe_reference`, over expert counts, top-k, token counts, uneven routing (experts with no
tokens, all tokens on one expert, repeated ids), expert-parallel offsets and dtypes.

Where they run:
- `*_interpreted` tests: small shapes on the CPU through Triton's interpreter, only when the
  process starts with TRITON_INTERPRET=1 and Triton is importable:
      TRITON_INTERPRET=1 python -m pytest -q tests/layers/test_fused_moe.py
  They call `fused_moe_triton` directly on CPU tensors (`fused_moe` itself sends CPU tensors
  to the reference). float16 and float32 only: the interpreter's bfloat16 `tl.dot` returns
  garbage (Triton 3.9), so bfloat16 is checked on the GPU.
- `gpu`-marked tests: real model sizes (Qwen3-30B-A3B, Mixtral-8x7B), up to 10,000 tokens,
  bfloat16 and float16, and a CUDA-graph replay with new routing.
- the rest are plain torch (the CPU dispatch), run everywhere.

Tolerance: the expected value is `moe_reference` in float64 on the same (rounded) inputs.
The kernel rounds act = silu(gate) * up and each pair's weighted output y to the dtype before
the sum (everything else accumulates in float32), so per element
    |out - ref| <= ulp * (|ref| + sum_k |w_k| (|act_k| @ |W2_k|^T + |y_k|))
with ulp = one unit in the last place (fp16 2^-10, bf16 2^-7; fp32 2^-20 for its float32
accumulation over H and I terms). Measured margins are 3x or more.
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedserve.layers.moe.fused_moe import fused_moe
from pagedserve.layers.moe.reference import dequantize_experts, moe_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not (INTERPRET and importlib.util.find_spec("triton") is not None),
    reason="needs TRITON_INTERPRET=1 at start-up and triton",
)
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}


def make_routing(
    kind: str, num_tokens: int, top_k: int, num_ids: int, generator: torch.Generator
) -> torch.Tensor:
    """[T, K] int64 expert ids in [0, num_ids): `uniform` (K distinct per token, as a router
    picks), `skewed` (a few hot experts, the upper half of the ids never used), `one` (every
    pair on expert 0: only allowed with K = 1 or repeats), `repeat` (with replacement)."""
    if kind == "uniform":
        logits = torch.rand(num_tokens, num_ids, generator=generator)
        return logits.topk(top_k, dim=-1).indices
    if kind == "skewed":
        hot = max(num_ids // 2, top_k)
        bias = torch.linspace(4, 0, hot)  # expert 0 hottest
        logits = torch.rand(num_tokens, hot, generator=generator) + bias
        return logits.topk(top_k, dim=-1).indices
    if kind == "one":
        return torch.zeros(num_tokens, top_k, dtype=torch.int64)
    return torch.randint(0, num_ids, (num_tokens, top_k), generator=generator)


def make_case(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    routing: str = "uniform",
    expert_start: int = 0,
    num_global: int | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Random inputs of one call (weights scaled so every value is O(1))."""
    g = torch.Generator().manual_seed(seed)
    ids = make_routing(routing, num_tokens, top_k, num_global or num_experts, g)
    weights = torch.rand(num_tokens, top_k, generator=g)
    weights = weights / weights.sum(-1, keepdim=True)
    args = {
        "hidden_states": torch.randn(num_tokens, hidden, generator=g),
        "w13": torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5,
        "w2": torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5,
        "topk_weights": weights,
        "topk_ids": ids,
    }
    for name in ("hidden_states", "w13", "w2"):
        args[name] = args[name].to(dtype)
    args = {name: t.to(device) for name, t in args.items()}
    args["expert_start"] = expert_start
    return args


def quantize_experts(args: dict[str, Any], per_channel: bool) -> None:
    """w13 and w2 -> float8_e4m3fn with float32 scales ([E] or [E, N]), in args."""
    for name in ("w13", "w2"):
        w = args[name].float()
        amax = w.abs().amax(dim=2) if per_channel else w.abs().amax(dim=(1, 2))
        scale = amax / 448.0
        q = (w / scale.reshape(w.shape[0], -1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        args[name], args[f"{name}_scale"] = q, scale


def high_precision(args: dict[str, Any], calc: torch.dtype) -> dict[str, Any]:
    """moe_reference's arguments in `calc`, FP8 weights dequantized."""
    high = {k: v for k, v in args.items() if not k.endswith("_scale")}
    high["hidden_states"] = args["hidden_states"].to(calc)
    for name in ("w13", "w2"):
        high[name] = dequantize_experts(args[name], args.get(f"{name}_scale"), calc)
    return high


def error_scale(high: dict[str, Any]) -> torch.Tensor:
    """sum_k |w_k| (|act_k| @ |W2_k|^T + |y_k|) per output element (module docstring), from
    `high_precision`'s arguments."""
    x, w13, w2 = high["hidden_states"], high["w13"], high["w2"]
    local = high["topk_ids"].long() - high["expert_start"]
    inter = w2.shape[2]
    scale = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        token, slot = torch.nonzero(local == expert, as_tuple=True)
        h = x[token] @ w13[expert].T
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = act @ w2[expert].T
        weight = high["topk_weights"][token, slot, None].to(x.dtype).abs()
        scale.index_add_(0, token, weight * (act.abs() @ w2[expert].abs().T + y.abs()))
    return scale


def assert_matches_reference(out: torch.Tensor, args: dict[str, Any]) -> float:
    """out ~ moe_reference on the same inputs in high precision (float64 on the CPU, float32
    on the GPU for the large sizes) within the module docstring's bound; returns the largest
    error / bound."""
    dtype = args["hidden_states"].dtype
    calc = torch.float64 if out.device.type == "cpu" or out.numel() < 2**20 else torch.float32
    high = high_precision(args, calc)
    expected = moe_reference(**high).to(calc)
    bound = ULP[dtype] * (expected.abs() + error_scale(high)) + 1e-30
    ratio = float(((out.to(calc) - expected).abs() / bound).max()) if out.numel() else 0.0
    assert out.dtype == dtype and out.shape == args["hidden_states"].shape
    assert ratio <= 1.0, f"max error / bound {ratio:.2f}"
    return ratio


# (T, E, K, H, I, dtype, routing, expert_start, global experts)
CPU_CASES = [
    (1, 1, 1, 32, 32, torch.float16, "uniform", 0, None),
    (37, 1, 1, 48, 40, torch.float16, "uniform", 0, None),
    (1, 4, 2, 32, 32, torch.float32, "uniform", 0, None),
    (64, 4, 2, 64, 48, torch.float16, "skewed", 0, None),
    (200, 8, 2, 32, 32, torch.float16, "uniform", 0, None),
    (17, 8, 8, 48, 32, torch.float16, "uniform", 0, None),
    (300, 16, 8, 32, 16, torch.float16, "skewed", 0, None),
    (130, 16, 1, 64, 32, torch.float32, "skewed", 0, None),
    (5, 16, 2, 32, 32, torch.float16, "uniform", 0, None),
    (50, 4, 2, 32, 32, torch.float16, "one", 0, None),
    (40, 4, 8, 32, 32, torch.float16, "repeat", 0, None),
    # expert parallelism: this rank holds 4 (or 8) of 16 experts
    (60, 4, 2, 32, 32, torch.float16, "uniform", 4, 16),
    (33, 8, 8, 32, 32, torch.float32, "uniform", 8, 16),
    (9, 4, 1, 32, 32, torch.float16, "skewed", 12, 16),  # no pair is local: zeros
]


@interpreted
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_fused_moe_triton_interpreted(case: tuple[Any, ...]) -> None:
    from pagedserve.layers.moe.triton_moe import fused_moe_triton

    t, e, k, h, i, dtype, routing, start, num_global = case
    args = make_case(t, e, k, h, i, dtype, routing, start, num_global, seed=t * e + k)
    out = fused_moe_triton(**args)
    assert_matches_reference(out, args)
    if routing == "skewed" and start == 12:
        assert not out.any()


@interpreted
@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_every_tile_config_interpreted(block_m: int) -> None:
    """Each of `moe_config`'s tile classes (forced) on one input: GROUP_M > 1, ragged K."""
    from pagedserve.layers.moe.triton_moe import MoeConfig, fused_moe_triton, moe_config

    args = make_case(90, 4, 2, 80, 48, torch.float16, "skewed", seed=block_m)
    tokens = {16: 1, 32: 90, 64: 300, 128: 2000}[block_m]  # a token count of that class
    config = moe_config(tokens, 2, 4, 48, 80, torch.float16)
    assert config.block_m == block_m
    # BLOCK_K 32: a ragged last K step for H = 80 and I = 48
    tiles = [dataclasses.replace(t, block_k=32) for t in (config.gate_up, config.down)]
    out = fused_moe_triton(**args, config=MoeConfig(block_m, *tiles))
    assert_matches_reference(out, args)


@interpreted
def test_chunks_and_strided_input_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Token counts past CHUNK_TOKENS run in chunks; hidden_states may be a strided view;
    int32 ids and bfloat16 routing weights are taken as they come."""
    from pagedserve.layers.moe import triton_moe

    monkeypatch.setattr(triton_moe, "CHUNK_TOKENS", 16)
    args = make_case(41, 8, 2, 32, 32, torch.float16, seed=3)
    wide = torch.randn(41, 96).to(torch.float16)
    wide[:, 10:42] = args["hidden_states"]
    args["hidden_states"] = wide[:, 10:42]
    args["topk_ids"] = args["topk_ids"].to(torch.int32)
    args["topk_weights"] = args["topk_weights"].to(torch.bfloat16)
    assert_matches_reference(triton_moe.fused_moe_triton(**args), args)


@interpreted
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize(("num_tokens", "start"), [(1, 0), (37, 0), (70, 2)])
def test_fp8_weights_interpreted(per_channel: bool, num_tokens: int, start: int) -> None:
    """float8_e4m3fn experts with per-expert or per-row scales (weight-only FP8): the same
    bound against the reference on the dequantized weights."""
    from pagedserve.layers.moe.triton_moe import fused_moe_triton

    args = make_case(num_tokens, 4, 2, 48, 32, torch.float16, "skewed", start, 8, num_tokens)
    quantize_experts(args, per_channel)
    assert_matches_reference(fused_moe_triton(**args), args)


@interpreted
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m"), [
    (1, 1, 1, 16), (1, 8, 16, 16), (100, 2, 8, 16), (300, 8, 16, 64), (20, 2, 4, 128),
])  # fmt: skip
def test_align_layout_interpreted(
    num_tokens: int, top_k: int, num_experts: int, block_m: int
) -> None:
    """The alignment's invariants: every local pair exactly once, in a block of its own
    expert; padding rows hold the sentinel; total = sum of per-expert padded counts; no
    pair of another rank's expert (ids shifted so half the global ids are elsewhere)."""
    from pagedserve.layers.moe.moe_align import max_padded_rows, moe_align_block_size

    g = torch.Generator().manual_seed(num_tokens)
    start = num_experts // 2
    ids = make_routing("skewed", num_tokens, top_k, 2 * num_experts, g)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, block_m, num_experts, start)
    num_pairs = ids.numel()
    assert sorted_ids.numel() == max_padded_rows(num_pairs, num_experts, block_m)
    local = ids.reshape(-1) - start
    is_local = (local >= 0) & (local < num_experts)
    counts = torch.bincount(local[is_local], minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(total) == int(padded.sum())
    rows = sorted_ids[: int(total)].long()
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == torch.nonzero(is_local).flatten().tolist()
    assert bool((rows[rows >= num_pairs] == num_pairs).all())
    assert int((rows == num_pairs).sum()) == int((padded - counts).sum())
    row_expert = expert_ids[: int(total) // block_m].repeat_interleave(block_m).long()
    assert torch.equal(local[real], row_expert[rows < num_pairs])


def test_cpu_dispatch_is_the_reference() -> None:
    """CPU tensors take `moe_reference` (bit for bit), with its shape errors."""
    args = make_case(23, 4, 2, 32, 16, torch.float32, "skewed", 2, 8)
    assert torch.equal(fused_moe(**args), moe_reference(**args))
    args["w2"] = args["w2"][:, :, :8]
    with pytest.raises(ValueError, match="want \\[E, H, I\\]"):
        fused_moe(**args)


def test_cpu_dispatch_dequantizes_fp8_weights() -> None:
    args = make_case(11, 4, 2, 32, 16, torch.bfloat16, seed=5)
    quantize_experts(args, per_channel=True)
    expected = moe_reference(**high_precision(args, torch.bfloat16))
    assert torch.equal(fused_moe(**args), expected)
    args["w2_scale"] = args["w2_scale"][:, :3]
    with pytest.raises(ValueError, match="per channel"):
        fused_moe(**args)


def test_cpu_path_never_imports_triton() -> None:
    """CI has no Triton: importing and calling `fused_moe` on CPU tensors must not import it."""
    code = (
        "import sys, torch\n"
        "from pagedserve.layers.moe.fused_moe import fused_moe\n"
        "x = torch.randn(3, 8); w13 = torch.randn(2, 8, 8); w2 = torch.randn(2, 8, 4)\n"
        "fused_moe(x, w13, w2, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long))\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


# --- GPU ---------------------------------------------------------------------------------

QWEN3_30B = (128, 8, 2048, 768)  # E, K, H, I
MIXTRAL = (8, 2, 4096, 14336)


@pytest.fixture(scope="module")
def expert_weights() -> Iterator[dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]]]:
    """One set of random bf16 expert weights per model shape, shared by the GPU tests."""
    cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    yield cache
    cache.clear()


def gpu_case(
    cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]],
    shape: tuple[int, int, int, int],
    num_tokens: int,
    dtype: torch.dtype,
    routing: str = "uniform",
    num_local: int | None = None,
    expert_start: int = 0,
) -> dict[str, Any]:
    e, k, h, i = shape
    if shape not in cache:
        g = torch.Generator(device="cuda").manual_seed(0)
        cache[shape] = (
            torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) / h**0.5,
            torch.randn(e, h, i, device="cuda", generator=g, dtype=torch.bfloat16) / i**0.5,
        )
    w13, w2 = cache[shape]
    local = slice(expert_start, expert_start + (num_local or e))
    args = make_case(num_tokens, 1, k, 16, 16, dtype, routing, expert_start, e, num_tokens)
    args = {name: v.cuda() if isinstance(v, torch.Tensor) else v for name, v in args.items()}
    args["hidden_states"] = torch.randn(num_tokens, h, device="cuda", dtype=dtype)
    args["w13"], args["w2"] = w13[local].to(dtype), w2[local].to(dtype)
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 64, 256, 1024, 4096])
@pytest.mark.parametrize("shape", [QWEN3_30B, MIXTRAL], ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_fused_moe_gpu_model_sizes(
    expert_weights: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]],
    shape: tuple[int, int, int, int],
    num_tokens: int,
) -> None:
    args = gpu_case(expert_weights, shape, num_tokens, torch.bfloat16)
    assert_matches_reference(fused_moe(**args), args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "dtype", "routing", "num_local", "start"),
    [
        (10000, torch.bfloat16, "uniform", None, 0),  # more than CHUNK_TOKENS: two chunks
        (777, torch.float16, "skewed", None, 0),  # half the experts get no token
        (2048, torch.bfloat16, "one", None, 0),  # every pair on expert 0 (K = 8 repeats)
        (513, torch.bfloat16, "uniform", 64, 64),  # EP: the upper 64 of 128 experts
        (1, torch.bfloat16, "skewed", 64, 64),  # EP: no pair is local
    ],
)
def test_fused_moe_gpu_uneven_and_expert_parallel(
    expert_weights: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]],
    num_tokens: int,
    dtype: torch.dtype,
    routing: str,
    num_local: int | None,
    start: int,
) -> None:
    args = gpu_case(expert_weights, QWEN3_30B, num_tokens, dtype, routing, num_local, start)
    out = fused_moe(**args)
    assert_matches_reference(out, args)
    if routing == "skewed" and start:
        assert not out.any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CPU_CASES[:9], ids=lambda c: "-".join(map(str, c)))
def test_fused_moe_gpu_small_shapes(case: tuple[Any, ...]) -> None:
    """The CPU cases on the GPU, float32 (IEEE dots) and bfloat16 besides float16."""
    t, e, k, h, i, dtype, routing, start, num_global = case
    for dt in (dtype, torch.bfloat16):
        args = make_case(t, e, k, h, i, dt, routing, start, num_global, t, "cuda")
        assert_matches_reference(fused_moe(**args), args)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [8, 256])
def test_fused_moe_cuda_graph_replay_with_new_routing(
    expert_weights: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]],
    num_tokens: int,
) -> None:
    """Captured once, replayed with other inputs and routing written into the same buffers
    (as a decode step's graph is): nothing in the kernels depends on the captured routing."""
    args = gpu_case(expert_weights, QWEN3_30B, num_tokens, torch.bfloat16)
    fused_moe(**args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(**args)
    for seed, routing in ((1, "skewed"), (2, "one"), (3, "uniform")):
        new = gpu_case(expert_weights, QWEN3_30B, num_tokens, torch.bfloat16, routing)
        torch.manual_seed(seed)
        for name in ("hidden_states", "topk_weights", "topk_ids"):
            args[name].copy_(new[name] if name != "hidden_states" else torch.randn_like(new[name]))
        graph.replay()
        assert_matches_reference(out, args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "num_tokens", "per_channel"),
    [(QWEN3_30B, 1, True), (QWEN3_30B, 256, True), (QWEN3_30B, 4096, False), (MIXTRAL, 64, False)],
)
def test_fused_moe_gpu_fp8_weights(
    expert_weights: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]],
    shape: tuple[int, int, int, int],
    num_tokens: int,
    per_channel: bool,
) -> None:
    args = gpu_case(expert_weights, shape, num_tokens, torch.bfloat16)
    quantize_experts(args, per_channel)
    assert_matches_reference(fused_moe(**args), args)
