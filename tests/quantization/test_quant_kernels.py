"""The Triton W4A16 / W8A16 GEMM (pagedserve/layers/kernels/quant_gemm.py) against the torch
reference dequantization (`dequantize_gptq`, `dequantize_awq`), on fresh random weights packed by
the test-side packers, across M, K, N, group size, bits, act-order, sym/asym, both layouts and
fp16/bf16 (and float32, used by the end-to-end greedy test).

Where they run:
- `gpu`-marked tests: the full grid on CUDA (skipped without a GPU).
- `*_interpreted` tests: small shapes on the CPU through Triton's interpreter; they run only
  when the process starts with TRITON_INTERPRET=1 (it must be set before Triton compiles the
  kernels) and Triton is importable:
      TRITON_INTERPRET=1 python -m pytest -q tests/quantization/test_quant_kernels.py
  The interpreter's bfloat16 is not the GPU's: its float32 -> bfloat16 casts truncate (within
  the rtol of one bfloat16 step), and its bfloat16 `tl.dot` returns garbage (Triton 3.9), so
  bfloat16 is checked there only on the GEMV (M = 1) and dequantize kernels.
- the other tests are plain torch (repacking, the CPU path left as it was), run everywhere.

Tolerances (`assert_matches`): the kernel's weights are the reference's float32 weights (M = 1)
or those rounded to x's dtype (tensor-core paths; exactly: the dequantize kernel's output is
compared bit for bit), so the only differences are float32 summation order and the final
rounding:  |y - ref| <= rtol * |ref| + atol * (|x| @ |W^T|),  with
rtol = one unit in the last place of the dtype (fp16 2^-10, bf16 2^-7, fp32 2^-20) and
atol = 2^-16 (float32 accumulation of K <= 4096 terms); ref = x @ W^T in float64 of the
weights the kernel uses.
"""

import dataclasses
import importlib.util
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from pagedserve.layers.quantization.awq import AWQ_PACK_ORDER, dequantize_awq
from pagedserve.layers.quantization.gptq import dequantize_gptq
from pagedserve.layers.quantization.packed import (
    PackedWeights,
    awq_packed_weights,
    gptq_packed_weights,
    pack_int32,
    unpack_int32,
)
from pagedserve.quant_config import AWQConfig, GPTQConfig, QuantizationConfig

from .awq_pack import quantize_awq, write_awq_checkpoint
from .gptq_pack import quantize, write_gptq_checkpoint
from .test_gptq_models import PROMPTS, float_model  # noqa: F401 (float_model: a fixture)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not (INTERPRET and importlib.util.find_spec("triton") is not None),
    reason="needs TRITON_INTERPRET=1 at start-up and triton",
)
gpu = pytest.mark.gpu
RTOL = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}
ATOL = 2.0**-16


def make_case(
    layout: str,
    k: int,
    n: int,
    bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
    seed: int = 0,
) -> tuple[PackedWeights, torch.Tensor]:  # (kernel weights on CPU, reference W^T [K, N] fp32)
    """Fresh random W [N, K], packed by the format's test-side packer; the kernels' layout
    of it and the torch reference dequantization."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator)
    if layout == "awq":
        a = quantize_awq(weight, group_size)
        ref = dequantize_awq(a.qweight, a.qzeros, a.scales, group_size)
        return awq_packed_weights(a.qweight, a.qzeros, a.scales, group_size, AWQ_PACK_ORDER), ref
    perm = torch.randperm(k, generator=generator)
    p = quantize(weight, bits, group_size, desc_act, sym, perm)
    size = group_size if group_size != -1 else k
    groups = p.g_idx.long() if desc_act else torch.arange(k) // size
    ref = dequantize_gptq(p.qweight, p.qzeros, p.scales, groups, bits, 1)
    packed = gptq_packed_weights(p.qweight, p.qzeros, p.scales, groups, bits, 1, size)
    return packed, ref


def assert_matches(
    y: torch.Tensor,
    x: torch.Tensor,
    ref_t: torch.Tensor,
    bias: torch.Tensor | None = None,
    rounded: bool = True,
) -> None:
    """y ~ x @ ref_t (+ bias), ref_t [K, N] float32 (rounded to x's dtype first unless
    `rounded` is False: the M = 1 kernel keeps fp32 weights), within the module docstring's
    bounds."""
    w = (ref_t.to(x.dtype) if rounded else ref_t).double()
    expected = x.double() @ w + (bias.double() if bias is not None else 0.0)
    scale = x.double().abs() @ w.abs()
    bound = RTOL[x.dtype] * expected.abs() + ATOL * scale + 1e-30
    error = (y.double() - expected).abs()
    assert y.dtype == x.dtype and y.shape == expected.shape
    assert bool((error <= bound).all()), f"max error / bound {float((error / bound).max()):.2f}"


def check_gemm(
    device: str,
    layout: str,
    k: int,
    n: int,
    bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
    dtypes: tuple[torch.dtype, ...],
    ms: tuple[int, ...],
) -> None:
    """Both GEMM paths (in-loop and dequantize + matmul) and the dequantize kernel, for
    each dtype and M, against the reference."""
    from pagedserve.layers.kernels.quant_gemm import (
        dequant_matmul,
        dequantize,
        pick_config,
        quant_gemm,
    )

    packed, ref = make_case(layout, k, n, bits, group_size, desc_act, sym)
    packed = packed.to(device)
    torch.manual_seed(1)
    for dtype in dtypes:
        d = dequantize(packed, dtype).cpu()
        if INTERPRET and dtype == torch.bfloat16:  # truncating casts: within one bf16 step
            torch.testing.assert_close(d.float(), ref, rtol=2.0**-7, atol=0)
        else:
            assert torch.equal(d, ref.to(dtype))
        for m in ms:
            x = torch.randn(m, k, dtype=dtype, device=device)
            bias = torch.randn(n, dtype=dtype, device=device) if m % 2 else None
            if not (INTERPRET and dtype == torch.bfloat16 and m > 1):
                y = quant_gemm(x, packed, bias).cpu()
                assert_matches(y, x.cpu(), ref, _cpu(bias), rounded=m > 1)
            if m > 1 and not (INTERPRET and dtype == torch.bfloat16):  # out^T = W x^T variant
                swapped = dataclasses.replace(pick_config(m), swap_ab=True)
                y = quant_gemm(x, packed, bias, config=swapped, split_k=1).cpu()
                assert_matches(y, x.cpu(), ref, _cpu(bias))
            if not (INTERPRET and dtype == torch.bfloat16):
                assert_matches(dequant_matmul(x, packed, bias).cpu(), x.cpu(), ref, _cpu(bias))


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.cpu() if t is not None else None


GPTQ_GRID = list(itertools.product((4, 8), (-1, 32, 64, 128), (False, True), (False, True)))
GPU_MS = (1, 7, 16, 64, 200)


@gpu
@pytest.mark.parametrize(("bits", "group_size", "desc_act", "sym"), GPTQ_GRID)
def test_gptq_gemm_gpu(bits: int, group_size: int, desc_act: bool, sym: bool) -> None:
    check_gemm(
        "cuda", "gptq", 512, 264, bits, group_size, desc_act, sym,
        (torch.float16, torch.bfloat16), GPU_MS,
    )  # fmt: skip


@gpu
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_gemm_gpu(group_size: int) -> None:
    check_gemm(
        "cuda", "awq", 512, 264, 4, group_size, False, False,
        (torch.float16, torch.bfloat16), GPU_MS,
    )  # fmt: skip


@gpu
@pytest.mark.parametrize(("k", "n"), [(96, 40), (4096, 512), (1024, 1536)])
@pytest.mark.parametrize("layout", ["gptq", "awq"])
def test_shapes_gpu(k: int, n: int, layout: str) -> None:
    """K not a multiple of the K tile; large K (split-K over many blocks); wide N."""
    group_size = 32 if k % 128 else 128
    check_gemm(
        "cuda", layout, k, n, 4, group_size, True, False,
        (torch.float16, torch.bfloat16, torch.float32), (1, 16, 200, 1024),
    )  # fmt: skip


INTERPRETED_GRID = [
    # (layout, k, n, bits, group_size, desc_act, sym)
    ("gptq", 128, 64, 4, 32, False, False),
    ("gptq", 128, 64, 4, 32, True, False),
    ("gptq", 128, 48, 4, -1, True, True),
    ("gptq", 256, 64, 4, 128, False, True),
    ("gptq", 128, 64, 8, 64, True, False),
    ("gptq", 96, 40, 8, -1, False, True),
    ("gptq", 256, 32, 8, 128, True, True),
    ("awq", 128, 64, 4, 32, False, False),
    ("awq", 256, 40, 4, 64, False, False),
]


@interpreted
@pytest.mark.parametrize(
    ("layout", "k", "n", "bits", "group_size", "desc_act", "sym"), INTERPRETED_GRID
)
def test_gemm_interpreted(
    layout: str, k: int, n: int, bits: int, group_size: int, desc_act: bool, sym: bool
) -> None:
    check_gemm(
        "cpu", layout, k, n, bits, group_size, desc_act, sym,
        (torch.float16, torch.bfloat16, torch.float32), (1, 7, 16, 33),
    )  # fmt: skip


def row_parallel_shard(bits: int, sym: bool, tp_size: int, rank: int) -> tuple[Any, Any, Any]:
    """Rank `rank`'s part of an act-order GPTQ weight split along K: its rows hold any of the
    global groups, so sorted they are not runs of group_size (the kernels' g_idx path)."""
    k, n, group_size = 256, 64, 32
    p = quantize(torch.randn(n, k), bits, group_size, True, sym, torch.randperm(k))
    rows = slice(rank * k // tp_size, (rank + 1) * k // tp_size)
    pack = 32 // bits
    qweight = p.qweight[rank * k // tp_size // pack : (rank + 1) * k // tp_size // pack]
    groups = p.g_idx[rows].long()
    ref = dequantize_gptq(qweight, p.qzeros, p.scales, groups, bits, 1)
    packed = gptq_packed_weights(qweight, p.qzeros, p.scales, groups, bits, 1, group_size)
    return packed, ref, groups


def check_row_parallel_act_order(device: str, dtype: torch.dtype) -> None:
    from pagedserve.layers.kernels.quant_gemm import dequant_matmul, quant_gemm

    torch.manual_seed(3)
    packed, ref, _ = row_parallel_shard(4, False, 2, 1)
    assert packed.g_idx is not None and packed.perm is not None
    packed = packed.to(device)
    for m in (1, 16):
        x = torch.randn(m, ref.size(0), dtype=dtype, device=device)
        assert_matches(quant_gemm(x, packed).cpu(), x.cpu(), ref, rounded=m > 1)
        assert_matches(dequant_matmul(x, packed).cpu(), x.cpu(), ref)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_row_parallel_act_order_shard_gpu(dtype: torch.dtype) -> None:
    check_row_parallel_act_order("cuda", dtype)


@interpreted
def test_row_parallel_act_order_shard_interpreted() -> None:
    check_row_parallel_act_order("cpu", torch.float16)


def kernel_layer_output(
    device: str, quant: QuantizationConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (output, x, bias) on the CPU
    """A row-parallel layer with bias (TP=1) loaded with `tensors`, processed on `device` as
    the loader does, applied to a random x."""
    layer = RowParallelLinear(256, 64, bias=True, quant_config=quant)
    bias = torch.randn(64)
    load(layer, {**tensors, "bias": bias})
    layer = layer.to(device=device, dtype=dtype)
    layer.quant_method.process_weights_after_loading(layer)
    assert hasattr(layer, "packed_weights") and not hasattr(layer, "qweight")
    x = torch.randn(5, 256, dtype=dtype)
    return layer(x.to(device)).cpu(), x, bias.to(dtype)


def load(layer: LinearBase, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)


def check_layers(device: str, dtype: torch.dtype) -> None:
    """GPTQ (act-order) and AWQ layers: apply on the repacked weights equals x @ W^T + b of
    the packers' grid W (float16 scales, so exact in float16 and float32)."""
    torch.manual_seed(4)
    weight = torch.randn(64, 256)
    p = quantize(weight, 4, 32, True, False, torch.randperm(256))
    gptq = GPTQConfig(weight_bits=4, group_size=32, desc_act=True, sym=False)
    tensors = {"qweight": p.qweight, "qzeros": p.qzeros, "scales": p.scales, "g_idx": p.g_idx}
    a = quantize_awq(weight, 64)
    awq = AWQConfig(weight_bits=4, group_size=64)
    awq_tensors = {"qweight": a.qweight, "qzeros": a.qzeros, "scales": a.scales}
    for quant, t, grid in ((gptq, tensors, p.dequantized), (awq, awq_tensors, a.dequantized)):
        out, x, bias = kernel_layer_output(device, quant, t, dtype)
        assert_matches(out, x, grid.T, bias)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_linear_methods_use_the_kernels_on_cuda(dtype: torch.dtype) -> None:
    check_layers("cuda", dtype)


@interpreted
def test_linear_methods_use_the_kernels_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Let process_weights_after_loading repack CPU tensors (the interpreter runs them).
    monkeypatch.setattr("pagedserve.layers.quantization.base.use_quant_kernels", lambda t: True)
    check_layers("cpu", torch.float32)


# Plain torch: run everywhere.


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_rows_inverts_unpack(bits: int) -> None:
    values = torch.randint(0, 2**bits, (64, 24))
    packed = pack_int32(values, bits, 0)  # along K, GPTQ's qweight layout
    assert packed.shape == (64 * bits // 32, 24) and packed.dtype == torch.int32
    assert torch.equal(unpack_int32(packed, bits, 0), values.to(torch.int32))


def test_gptq_without_act_order_keeps_its_qweight() -> None:
    packed, _ = make_case("gptq", 128, 64, 4, 32, False, True)
    assert packed.perm is None and packed.g_idx is None
    assert packed.zeros is None and packed.zero_value == 8  # symmetric 4-bit: one zero point
    p = quantize(torch.randn(64, 128), 4, 32, False, True)
    qweight = p.qweight.contiguous()  # as a loaded parameter is
    w = gptq_packed_weights(qweight, p.qzeros, p.scales, torch.arange(128) // 32, 4, 1, 32)
    assert w.qweight.data_ptr() == qweight.data_ptr()  # no copy


@pytest.mark.parametrize("layout", ["gptq", "awq"])
def test_repacked_weights_dequantize_to_the_reference(layout: str) -> None:
    """The kernels' layout (act-order rows sorted, AWQ repacked along K) holds the same
    weight: dequantized in torch from it, un-permuted, equals the reference."""
    packed, ref = make_case(layout, 256, 64, 4, 32, layout == "gptq", False)
    q = unpack_int32(packed.qweight, packed.bits, 0)
    groups = torch.arange(256) // packed.group_size if packed.g_idx is None else packed.g_idx
    assert packed.zeros is not None
    w = (q - packed.zeros[groups.long()]).float() * packed.scales.float()[groups.long()]
    rows = packed.perm.long() if packed.perm is not None else torch.arange(256)
    assert torch.equal(w, ref[rows])


def test_row_parallel_act_order_shard_sorts_with_g_idx() -> None:
    torch.manual_seed(3)
    packed, ref, groups = row_parallel_shard(4, False, 2, 1)
    assert packed.perm is not None and packed.g_idx is not None
    assert torch.equal(packed.g_idx.long(), groups[packed.perm.long()])
    assert bool((packed.g_idx[1:] >= packed.g_idx[:-1]).all())


def test_cpu_layers_are_left_as_loaded() -> None:
    """On the CPU, process_weights_after_loading changes nothing: the reference path."""
    p = quantize(torch.randn(64, 256), 4, 32, True, False, torch.randperm(256))
    quant = GPTQConfig(weight_bits=4, group_size=32, desc_act=True, sym=False)
    layer = ColumnParallelLinear(256, 64, quant_config=quant)
    load(layer, {"qweight": p.qweight, "qzeros": p.qzeros, "scales": p.scales, "g_idx": p.g_idx})
    before = {name: t.clone() for name, t in layer.named_parameters()}
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "packed_weights")
    assert all(torch.equal(t, before[name]) for name, t in layer.named_parameters())
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ p.dequantized.T)


def greedy(path: Path, device: str, enforce_eager: bool = False) -> list[list[int]]:
    """Greedy 10-token outputs (float32) of `LLM` on PROMPTS; on CUDA, also checks that every
    quantized linear runs the kernels (its weights were repacked)."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(
        str(path),
        dtype="float32",
        device=device,
        skip_tokenizer_init=True,
        num_gpu_blocks_override=64,
        max_model_len=64,
        enforce_eager=enforce_eager,
    ) as llm:
        model = llm.llm_engine.engine_core.executor.worker.runner.model
        repacked = [
            hasattr(m, "packed_weights") for m in model.modules() if isinstance(m, LinearBase)
        ]
        assert repacked and all(repacked) == (device == "cuda")
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@gpu
@pytest.mark.parametrize(
    ("layout", "bits", "group_size", "desc_act", "sym"),
    [("gptq", 4, 32, True, False), ("gptq", 8, 128, False, True), ("awq", 4, 32, False, False)],
)
def test_gpu_greedy_equals_cpu(
    float_model: Path,  # noqa: F811
    tmp_path: Path,
    layout: str,
    bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
) -> None:
    """A tiny quantized Llama gives the CPU reference path's greedy tokens on CUDA (Triton
    kernels; CUDA graphs and eager)."""
    path = tmp_path / layout
    if layout == "awq":
        write_awq_checkpoint(float_model, path, tmp_path / "dequantized", group_size)
    else:
        write_gptq_checkpoint(
            float_model, path, tmp_path / "dequantized", bits, group_size, desc_act, sym
        )
    expected = greedy(path, "cpu")
    assert greedy(path, "cuda") == expected
    assert greedy(path, "cuda", enforce_eager=True) == expected
