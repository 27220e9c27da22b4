"""GPTQ linear layers on the CPU reference path: our unpacking equals the packer's quantized
grid for every supported bits / group_size / desc_act / sym, and tensor-parallel shards of
every linear kind put together equal the unsharded layer."""

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedserve.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.layers.quantization import GPTQLinearMethod
from pagedserve.quant_config import GPTQ_BITS, GPTQ_GROUP_SIZES, GPTQConfig, QuantizationConfig
from tests.models.test_models import _as_rank, no_collectives  # noqa: F401 (a fixture)

from .gptq_pack import Packed, quantize

K, N = 256, 64
COMBOS = list(itertools.product(GPTQ_BITS, GPTQ_GROUP_SIZES, (False, True), (False, True)))


def config(bits: int, group_size: int, desc_act: bool, sym: bool) -> GPTQConfig:
    return GPTQConfig(weight_bits=bits, group_size=group_size, desc_act=desc_act, sym=sym)


def load(layer: LinearBase, packed: Packed, *shard_id: object) -> None:
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        param = getattr(layer, name)
        param.weight_loader(param, getattr(packed, name), *shard_id)


@pytest.mark.parametrize(("bits", "group_size", "desc_act", "sym"), COMBOS)
def test_dequantized_weight_is_the_packers_grid(
    bits: int, group_size: int, desc_act: bool, sym: bool
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(N, K)
    packed = quantize(weight, bits, group_size, desc_act, sym, torch.randperm(K))
    layer = ColumnParallelLinear(K, N, quant_config=config(bits, group_size, desc_act, sym))
    load(layer, packed)
    assert isinstance(layer.quant_method, GPTQLinearMethod)
    assert torch.equal(layer.quant_method.dequantize(layer), packed.dequantized.T)
    # The grid is a real quantization of W: within half a step of it (sanity of the packer).
    error = (packed.dequantized - weight).abs().max()
    assert 0 < error < (weight.max() - weight.min()) / 2**bits
    x = torch.randn(3, K)
    torch.testing.assert_close(layer(x), x @ packed.dequantized.T)


def test_v1_zero_points_are_stored_minus_one() -> None:
    """The v1 format keeps zero - 1: 4-bit symmetric zeros (8) are stored as 7 in every
    nibble, i.e. the word 0x77777777."""
    packed = quantize(torch.randn(16, 64), 4, 32, desc_act=False, sym=True)
    assert packed.qzeros.shape == (2, 2)
    assert (packed.qzeros == 0x77777777).all()


@pytest.mark.usefixtures("no_collectives")
@pytest.mark.parametrize(("group_size", "desc_act"), [(32, False), (32, True), (-1, False)])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_row_parallel_shards_sum_to_the_full_layer(
    group_size: int, desc_act: bool, tp_size: int
) -> None:
    """Row-parallel splits K: qweight rows / pack, g_idx, and the groups (all groups on every
    rank with act-order or one group)."""
    torch.manual_seed(1)
    packed = quantize(torch.randn(N, K), 4, group_size, desc_act, False, torch.randperm(K))
    x = torch.randn(5, K)
    expected = x @ packed.dequantized.T
    quant = config(4, group_size, desc_act, False)
    total = torch.zeros_like(expected)
    for rank in range(tp_size):
        with _as_rank(rank, tp_size):
            layer = RowParallelLinear(K, N, quant_config=quant)
            load(layer, packed)
            groups = 1 if group_size == -1 else K // group_size
            assert layer.scales.shape[0] == (groups if desc_act else groups // tp_size or 1)
            total += layer(x.chunk(tp_size, dim=1)[rank])
    torch.testing.assert_close(total, expected)


def qkv_outputs(
    x: torch.Tensor,  # [num_tokens, K]
    packed: dict[str, Any],  # "q"/"k"/"v" -> packed projection (16-dim heads: 4 q, 2 kv)
    quant: QuantizationConfig,
    tp_size: int,
    load_fn: Callable[..., None],  # load_fn(layer, packed, shard_id)
) -> dict[str, torch.Tensor]:  # "q"/"k"/"v" -> [num_tokens, its N], ranks' shards concatenated
    """Each projection's output of a quantized QKVParallelLinear, run on every rank."""
    outs: dict[str, list[torch.Tensor]] = {s: [] for s in "qkv"}
    for rank in range(tp_size):
        with _as_rank(rank, tp_size):
            qkv = QKVParallelLinear(K, 16, 4, 2, quant_config=quant)
            for shard_id, p in packed.items():
                load_fn(qkv, p, shard_id)
            q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
            for s, out in zip("qkv", (q, k, v), strict=True):
                outs[s].append(out)
    return {s: torch.cat(o, dim=-1) for s, o in outs.items()}


@pytest.mark.usefixtures("no_collectives")
@pytest.mark.parametrize("tp_size", [1, 2])
def test_qkv_and_merged_shards_concatenate_to_the_full_projections(tp_size: int) -> None:
    """Column-parallel splits N (qweight and scales columns, qzeros columns / pack); fused
    layers place each projection's shard at its offset (packed offsets / pack)."""
    torch.manual_seed(2)
    head_dim, heads, kv_heads = 16, 4, 2
    perm = torch.randperm(K)  # q/k/v see the same input: one act-order
    sizes = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    packed = {s: quantize(torch.randn(n, K), 4, 64, True, False, perm) for s, n in sizes.items()}
    x = torch.randn(3, K)
    quant = config(4, 64, True, False)
    outs = qkv_outputs(x, packed, quant, tp_size, load)
    for s, p in packed.items():
        torch.testing.assert_close(outs[s], x @ p.dequantized.T)

    gate, up = (quantize(torch.randn(96, K), 8, 32, False, True) for _ in range(2))
    halves = []
    for rank in range(tp_size):
        with _as_rank(rank, tp_size):
            merged = MergedColumnParallelLinear(
                K, [96, 96], quant_config=config(8, 32, False, True)
            )
            load(merged, gate, 0)
            load(merged, up, 1)
            halves.append(merged(x).chunk(2, dim=-1))
    torch.testing.assert_close(torch.cat([h[0] for h in halves], -1), x @ gate.dequantized.T)
    torch.testing.assert_close(torch.cat([h[1] for h in halves], -1), x @ up.dequantized.T)


def test_fused_projections_with_different_act_orders_are_refused() -> None:
    q = quantize(torch.randn(64, K), 4, 64, True, False, torch.randperm(K))
    k = quantize(torch.randn(32, K), 4, 64, True, False, torch.randperm(K))
    qkv = QKVParallelLinear(K, 16, 4, 2, quant_config=config(4, 64, True, False))
    load(qkv, q, "q")
    with pytest.raises(ValueError, match="g_idx"):
        load(qkv, k, "k")


def test_a_shard_that_splits_a_group_is_refused() -> None:
    with (
        _as_rank(0, 4),
        pytest.raises(ValueError, match="group_size 128.*tensor parallel size"),
    ):
        RowParallelLinear(256, 64, quant_config=config(4, 128, False, True))
