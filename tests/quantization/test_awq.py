"""AWQ (AutoAWQ GEMM) on the CPU reference path: our unpacking equals the packer's quantized
grid for each group size and AutoAWQ's interleaved nibble order, tensor-parallel shards of
every linear kind put together equal the unsharded layer, the config's checks, and greedy
output of `LLM` on a packed checkpoint equal to transformers on the same grid as floats."""

from pathlib import Path

import pytest
import torch

from pagedserve.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedserve.layers.quantization import AWQLinearMethod
from pagedserve.quant_config import AWQ_GROUP_SIZES, AWQConfig
from tests.entrypoints.test_llm_greedy import hf_greedy
from tests.models.test_models import _as_rank, no_collectives  # noqa: F401 (a fixture)

from .awq_pack import (
    AWQPacked,
    awq_quantization_config,
    pack_awq,
    quantize_awq,
    write_awq_checkpoint,
)
from .gptq_pack import quantization_config
from .test_gptq_layers import qkv_outputs
from .test_gptq_models import (  # noqa: F401 (float_model: a fixture)
    PROMPTS,
    assert_refused,
    config_folder,
    engine_config,
    float_model,
    llm_greedy,
)

K, N = 256, 64
# Matmul comparisons: equal weights, only float32 summation order may differ.
TOL = {"rtol": 1e-5, "atol": 1e-4}


def load(layer: LinearBase, packed: AWQPacked, *shard_id: object) -> None:
    for name in ("qweight", "qzeros", "scales"):
        param = getattr(layer, name)
        param.weight_loader(param, getattr(packed, name), *shard_id)


def test_nibbles_hold_columns_in_awq_order() -> None:
    """Columns 0..7 with values 0..7 pack as nibbles (low to high) 0 2 4 6 1 3 5 7, i.e. the
    word 0x75316420; we read them back in column order (zero 0, scale 1: W^T = q)."""
    values = torch.arange(8).repeat(32, 1)  # [K=32, N=8]
    qweight = pack_awq(values)
    assert (qweight == 0x75316420).all()
    layer = ColumnParallelLinear(32, 8, quant_config=AWQConfig(4, 32))
    load(layer, AWQPacked(qweight, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 8), values))
    assert torch.equal(layer.quant_method.dequantize(layer), values.float())


@pytest.mark.parametrize("group_size", AWQ_GROUP_SIZES)
def test_dequantized_weight_is_the_packers_grid(group_size: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(N, K)
    packed = quantize_awq(weight, group_size)
    assert packed.qweight.shape == (K, N // 8) and packed.scales.shape == (K // group_size, N)
    layer = ColumnParallelLinear(K, N, quant_config=AWQConfig(4, group_size))
    load(layer, packed)
    assert isinstance(layer.quant_method, AWQLinearMethod)
    assert torch.equal(layer.quant_method.dequantize(layer), packed.dequantized.T)
    # The grid is a real quantization of W: within a step of it (sanity of the packer).
    error = (packed.dequantized - weight).abs().max()
    assert 0 < error < (weight.max() - weight.min()) / 16
    x = torch.randn(3, K)
    torch.testing.assert_close(layer(x), x @ packed.dequantized.T, **TOL)


@pytest.mark.usefixtures("no_collectives")
@pytest.mark.parametrize("group_size", [32, 128])
def test_row_parallel_shards_sum_to_the_full_layer(group_size: int) -> None:
    """Row-parallel splits K: qweight rows and the groups of qzeros/scales."""
    torch.manual_seed(1)
    packed = quantize_awq(torch.randn(N, K), group_size)
    x = torch.randn(5, K)
    total = torch.zeros(5, N)
    for rank in range(2):
        with _as_rank(rank, 2):
            layer = RowParallelLinear(K, N, quant_config=AWQConfig(4, group_size))
            load(layer, packed)
            assert layer.qweight.shape == (K // 2, N // 8)
            assert layer.scales.shape == (K // group_size // 2, N)
            total += layer(x.chunk(2, dim=1)[rank])
    torch.testing.assert_close(total, x @ packed.dequantized.T, **TOL)


@pytest.mark.usefixtures("no_collectives")
@pytest.mark.parametrize("tp_size", [1, 2])
def test_qkv_and_merged_shards_concatenate_to_the_full_projections(tp_size: int) -> None:
    """Column-parallel splits N (qweight and qzeros columns / 8, scales columns); fused
    layers place each projection's shard at its offset (packed offsets / 8)."""
    torch.manual_seed(2)
    sizes = {"q": 64, "k": 32, "v": 32}  # qkv_outputs' 16-dim heads: 4 q, 2 kv
    packed = {s: quantize_awq(torch.randn(n, K), 64) for s, n in sizes.items()}
    x = torch.randn(3, K)
    outs = qkv_outputs(x, packed, AWQConfig(4, 64), tp_size, load)
    for s, p in packed.items():
        torch.testing.assert_close(outs[s], x @ p.dequantized.T, **TOL)

    gate, up = (quantize_awq(torch.randn(96, K), 32) for _ in range(2))
    halves = []
    for rank in range(tp_size):
        with _as_rank(rank, tp_size):
            merged = MergedColumnParallelLinear(K, [96, 96], quant_config=AWQConfig(4, 32))
            load(merged, gate, 0)
            load(merged, up, 1)
            halves.append(merged(x).chunk(2, dim=-1))
    torch.testing.assert_close(torch.cat([h[0] for h in halves], -1), x @ gate.dequantized.T, **TOL)
    torch.testing.assert_close(torch.cat([h[1] for h in halves], -1), x @ up.dequantized.T, **TOL)


def test_a_shard_that_splits_a_group_is_refused() -> None:
    with (
        _as_rank(0, 4),
        pytest.raises(ValueError, match="group_size 128.*tensor parallel size"),
    ):
        RowParallelLinear(256, 64, quant_config=AWQConfig(4, 128))


def test_quant_method_is_read_from_the_checkpoint(tmp_path: Path) -> None:
    folder = config_folder(tmp_path / "m", awq_quantization_config(128))
    assert engine_config(folder).model_config.quantization == "awq"
    assert engine_config(folder, quantization="awq").model_config.quantization == "awq"
    # AutoAWQ's own key names and capitalised version, as vLLM also accepts
    autoawq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"}
    assert AWQConfig.from_config(autoawq) == AWQConfig(4, 64)


@pytest.mark.parametrize(
    ("quant", "option", "error", "words"),
    [
        ({**awq_quantization_config(128), "version": "gemv"}, None, ValueError, ["'gemv'", "gemm"]),
        ({**awq_quantization_config(128), "bits": 8}, None, ValueError, ["bits=8", "(4,)"]),
        (
            {**awq_quantization_config(128), "group_size": -1},
            None,
            ValueError,
            ["group_size=-1", "(32, 64, 128)"],
        ),
        (
            {**awq_quantization_config(128), "zero_point": False},
            None,
            NotImplementedError,
            ["zero_point"],
        ),
        (awq_quantization_config(128), "gptq", ValueError, ["'gptq'", "'awq'"]),
        (quantization_config(4, 128, False, True), "awq", ValueError, ["'awq'", "'gptq'"]),
        (None, "awq", ValueError, ["no quantization_config"]),
    ],
)
def test_unsupported_or_contradicting_awq_is_refused(
    tmp_path: Path, quant: dict | None, option: str | None, error: type, words: list[str]
) -> None:
    assert_refused(tmp_path, quant, option, error, words)


@pytest.mark.parametrize(("group_size", "option"), [(32, None), (128, "awq")])
def test_llm_greedy_on_awq_equals_transformers_on_the_dequantized_model(
    float_model: Path,  # noqa: F811
    tmp_path: Path,
    group_size: int,
    option: str | None,
) -> None:
    awq, dequantized = tmp_path / "awq", tmp_path / "dequantized"
    write_awq_checkpoint(float_model, awq, dequantized, group_size)
    expected = hf_greedy(dequantized, PROMPTS, 10)
    assert expected != hf_greedy(float_model, PROMPTS, 10)  # 4-bit changes tokens
    assert llm_greedy(awq, option, "awq") == expected


def test_tensor_parallel_awq_matches_single_rank(tmp_path: Path) -> None:
    """TP=2 (worker processes) on an AWQ checkpoint gives TP=1's greedy tokens and logprobs."""
    from tests.distributed._helpers import assert_same_outputs, greedy_outputs, save_tiny_model

    float_path = save_tiny_model("llama_gqa", tmp_path / "float")
    awq = tmp_path / "awq"
    write_awq_checkpoint(float_path, awq, tmp_path / "dequantized", 32)
    expected = greedy_outputs(awq)
    assert_same_outputs(greedy_outputs(awq, tensor_parallel_size=2), expected)
