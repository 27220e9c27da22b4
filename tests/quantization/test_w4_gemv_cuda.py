"""The CUDA W4A16 GEMV (pagedserve/layers/kernels/w4_gemv_cuda.py) against the fp32 reference
`x.float() @ dequantize(w, float32)`, and its weight repacking against the layout its docstring
states.

The repack test is plain torch and runs everywhere (the layout is the kernel's contract, so a
wrong permutation is caught without a GPU). The `gpu` tests need a CUDA GPU of sm_80+ and nvcc
(skipped otherwise); they cover M 1..8, K not a multiple of the 64-row chunk, N not a multiple
of the 16-column tile, group sizes 32 / 64 / 128 / one group, symmetric (constant zero) and
asymmetric (int16 zeros) weights, fp16 and bf16 x and scales, and bias. Tolerance as in
test_quant_kernels.py: |y - ref| <= rtol |ref| + atol (|x| @ |W^T|), rtol one unit in the last
place of x's dtype, atol 2^-16 (the kernel's weights are exact, so only fp32 summation order
and the final rounding differ).
"""

import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import envs, gdc
from pagedserve.layers.kernels import w4_gemv_cuda
from pagedserve.layers.kernels.w4_gemv_cuda import GEMM_MAX_M
from pagedserve.layers.quantization.packed import PackedWeights, pack_int32, unpack_int32

from .test_gptq_models import PROMPTS, float_model  # noqa: F401 (float_model: a fixture)

RTOL = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def random_weights(
    k: int, n: int, group_size: int, asym: bool, scale_dtype: torch.dtype, device: str
) -> PackedWeights:
    """Random 4-bit weights in `PackedWeights`' layout (group_size -1: one group)."""
    group = k if group_size == -1 else group_size
    num_groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), dtype=torch.int32, device=device)
    scales = (torch.rand(num_groups, n, device=device) * 0.02 + 0.001).to(scale_dtype)
    zeros = None
    if asym:
        zeros = torch.randint(0, 16, (num_groups, n), dtype=torch.int16, device=device)
    return PackedWeights(pack_int32(q, 4, 0), zeros, 8, scales, None, None, 4, group)


def test_repack_layout_matches_docstring() -> None:
    """Each repacked word holds, at nibble position i / 2 + 4 (i % 2), the value of K row
    64 c + 32 s + 8 t + i of column 16 j + 8 h + g (lane 4 g + t, word 2 s + h); padding is 0."""
    k, n = 136, 40  # neither a multiple of the 64-row chunk nor of the 16-column tile
    w = random_weights(k, n, 8, False, torch.float16, "cpu")
    repacked = w4_gemv_cuda.repack(w)
    assert repacked.shape == (3, 3, 32, 4) and repacked.dtype == torch.int32
    q = unpack_int32(w.qweight, 4, 0)  # [K, N]
    nibbles = unpack_int32(repacked.reshape(-1, 1), 4, 1).reshape(3, 3, 32, 4, 8)
    for j, c, lane, word in itertools.product(range(3), range(3), range(32), range(4)):
        g, t, s, h = lane // 4, lane % 4, word // 2, word % 2
        col = 16 * j + 8 * h + g
        for i in range(8):
            row = 64 * c + 32 * s + 8 * t + i
            expected = int(q[row, col]) if row < k and col < n else 0
            assert int(nibbles[j, c, lane, word, i // 2 + 4 * (i % 2)]) == expected


def test_supports_rejects_what_the_kernel_does_not_take() -> None:
    """act-order (perm / g_idx), 8-bit weights and more than MAX_M rows go to the fallback; on a
    machine without a GPU nothing is supported (and importing the module built nothing)."""
    w = random_weights(64, 16, 32, False, torch.float16, "cpu")
    x = torch.zeros(1, 64, dtype=torch.float16)
    assert not w4_gemv_cuda.supports(w, x)  # CPU tensor
    assert "module" not in w4_gemv_cuda._LOADED
    if not torch.cuda.is_available():
        assert not w4_gemv_cuda.available()
        return
    if not w4_gemv_cuda.available():
        pytest.skip("needs nvcc and a GPU of sm_80+")
    x = x.cuda()
    assert w4_gemv_cuda.supports(random_weights(64, 16, 32, False, torch.float16, "cuda"), x)
    act_order = random_weights(64, 16, 32, False, torch.float16, "cuda")
    act_order.perm = torch.nn.Parameter(torch.arange(64, dtype=torch.int32, device="cuda"), False)
    assert not w4_gemv_cuda.supports(act_order, x)
    plain = random_weights(64, 16, 32, False, torch.float16, "cuda")
    assert not w4_gemv_cuda.supports(plain, torch.zeros(9, 64, dtype=torch.float16, device="cuda"))
    assert not w4_gemv_cuda.supports(plain, x.float())
    w8 = PackedWeights(plain.qweight, None, 128, plain.scales, None, None, 8, 32)
    assert not w4_gemv_cuda.supports(w8, torch.zeros(1, 32, dtype=torch.float16, device="cuda"))


def assert_matches(
    y: torch.Tensor,
    x: torch.Tensor,
    w: PackedWeights,
    bias: torch.Tensor | None,
    rounded: bool = False,
) -> None:
    """y within the tolerance of x @ W^T (+ bias), W in fp32, or (rounded: the tensor-core
    GEMM's weights) each (q - z) * s rounded to x's dtype as `dequantize(w, dtype)` does."""
    from pagedserve.layers.kernels.quant_gemm import dequantize

    weight = dequantize(w, x.dtype if rounded else torch.float32).float()
    ref = x.float() @ weight + (bias.float() if bias is not None else 0.0)
    bound = RTOL[x.dtype] * ref.abs() + 2.0**-16 * (x.float().abs() @ weight.abs())
    bound += RTOL[x.dtype] * (bias.float().abs() if bias is not None else 0.0)
    diff = (y.float() - ref).abs()
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert bool((diff <= bound).all()), f"max ratio {float((diff / bound).max()):.3f}"


CASES = [  # (K, N, group_size)
    (64, 16, 32),
    (128, 40, 64),
    (200, 24, -1),  # one group, K not a multiple of 64
    (1024, 136, 128),
    (4096, 300, 128),
    (448, 64, 32),
]


def kernel_grid(test: Any) -> Any:
    """A gpu test over CASES x {fp16, bf16} x {symmetric, asymmetric}."""
    for mark in (
        pytest.mark.parametrize("asym", [False, True]),
        pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16]),
        pytest.mark.parametrize("k,n,group_size", CASES),
        pytest.mark.gpu,
    ):
        test = mark(test)
    return test


@settings(max_examples=300, deadline=None)
@given(
    m=st.integers(1, GEMM_MAX_M - 1),
    n=st.integers(1, 1 << 17).map(lambda v: 8 * v),
    k=st.integers(1, 1 << 15).map(lambda v: 8 * v),
    sms=st.sampled_from([1, 8, 78, 108, 132]),
)
def test_picked_configs_are_built(m: int, n: int, k: int, sms: int) -> None:
    """Whatever the shape and the SM count, the picks name a configuration the extension
    builds (the GEMV's for M <= MAX_M, the GEMM's above) and a split that leaves no split
    empty of chunks; runs without a GPU (num_sms is the only device query)."""
    with (
        mock.patch.object(w4_gemv_cuda, "num_sms", lambda device: sms),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
    ):
        warps, unroll, nt = w4_gemv_cuda.pick_gemv_config(n, k)
        assert (unroll, nt) in w4_gemv_cuda.GEMV_CONFIGS and 1 <= warps <= 16
        assert warps <= -(-k // w4_gemv_cuda.CHUNK_K)  # no warp without a chunk
        if m <= w4_gemv_cuda.MAX_M:
            return
        warps, split, mt, nt, kw = w4_gemv_cuda.pick_gemm_config(m, n, k)
    assert (warps, mt, nt, kw) in w4_gemv_cuda.GEMM_CONFIGS
    assert 1 <= split <= max(1, -(-k // w4_gemv_cuda.CHUNK_K) // 4)


@kernel_grid
def test_w4_gemv_matches_reference(
    k: int, n: int, group_size: int, dtype: torch.dtype, asym: bool
) -> None:
    """Every M of a decode batch, with and without bias, fp16 scales (as GPTQ checkpoints keep
    them) for either x dtype and x-typed scales."""
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")
    torch.manual_seed(k + n)
    for scale_dtype in {torch.float16, dtype}:
        w = random_weights(k, n, group_size, asym, scale_dtype, "cuda")
        repacked = w4_gemv_cuda.repack(w)
        for m, with_bias in itertools.product((1, 2, 3, 5, 8), (False, True)):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            bias = torch.randn(n, device="cuda", dtype=dtype) if with_bias else None
            assert w4_gemv_cuda.supports(w, x)
            assert_matches(w4_gemv_cuda.w4_gemv(x, w, repacked, bias), x, w, bias)


@pytest.mark.gpu
def test_w4_gemv_every_launch_config() -> None:
    """Every (num_warps, unroll, nt) the benchmark sweeps gives the same result: more warps
    than chunks, chunks left over by the batches, an odd number of tiles for two per block.
    Others are a ValueError naming the built ones."""
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")
    torch.manual_seed(1)
    w = random_weights(1088, 40, 64, True, torch.float16, "cuda")  # 17 chunks, 3 tiles
    repacked = w4_gemv_cuda.repack(w)
    x = torch.randn(4, 1088, device="cuda", dtype=torch.bfloat16)
    for num_warps, (unroll, nt) in itertools.product((1, 4, 8, 16), w4_gemv_cuda.GEMV_CONFIGS):
        y = w4_gemv_cuda.w4_gemv(x, w, repacked, config=(num_warps, unroll, nt))
        assert_matches(y, x, w, None)
    with pytest.raises(ValueError, match="GEMV_CONFIGS"):
        w4_gemv_cuda.w4_gemv(x, w, repacked, config=(4, 8, 1))


# Run in a child process: a c10::Error thrown after the extension's dispatch crashed the whole
# process (segmentation fault, H200, sessions 6 and 7), so the exported functions now return
# false for an unbuilt config; a crash here fails one test, not the run.
_REFUSE_UNBUILT = """
import torch
from pagedserve.layers.kernels import w4_gemv_cuda as cu
ext = cu.load()
x = torch.zeros(4, 64, device="cuda", dtype=torch.bfloat16)
repacked = torch.zeros(1, 1, 32, 4, device="cuda", dtype=torch.int32)  # N 16, K 64
scales = torch.ones(1, 16, device="cuda", dtype=torch.bfloat16)
out = torch.empty(4, 16, device="cuda", dtype=torch.bfloat16)
args = (x, repacked, scales, None, None, out, 64, 8)  # group 64, zero point 8
no_epilogue = (0, 0, None, None, 0, 0)
gemv = lambda warps, unroll: ext.w4_gemv_out(*args, warps, unroll, 1, False, *no_epilogue)  # no PDL
gemm = lambda split, mt: ext.w4_gemm_out(*args, 2, split, mt, 1, 1)
for name, call in (
    ("gemv unbuilt", lambda: gemv(4, 8)),
    ("gemm unbuilt", lambda: gemm(1, 3)),
    ("gemv bad warps", lambda: gemv(0, 2)),
    ("gemm bad split", lambda: gemm(0, 1)),
):
    print(name, "...", flush=True)
    try:
        print(name, "returned", call(), flush=True)
    except RuntimeError as e:
        print(name, "raised", str(e).splitlines()[0], flush=True)
"""


@pytest.mark.gpu
def test_the_extension_refuses_unbuilt_configs() -> None:
    """The compiled functions themselves (behind the Python checks) launch nothing and return
    False for a launch config they do not build, raise RuntimeError for bad arguments, and the
    process lives on."""
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")
    w4_gemv_cuda.load()  # built once, in this process (the child loads the cached build)
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _REFUSE_UNBUILT],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": path},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "gemv unbuilt returned False" in lines and "gemm unbuilt returned False" in lines
    assert "gemv bad warps raised w4_gemv: bad M/warps" in lines, lines
    assert "gemm bad split raised w4_gemm: bad split" in lines, lines


def test_a_failed_build_means_the_triton_kernels(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`built()` logs a build that fails (e.g. an nvcc that cannot target the GPU) and says
    False, so `_cuda_repacked` leaves the layer on the Triton kernels instead of crashing."""

    def broken_build(verbose: bool = False) -> object:
        raise RuntimeError("nvcc: unsupported gpu architecture")

    monkeypatch.setattr(w4_gemv_cuda, "available", lambda: True)
    monkeypatch.setattr(w4_gemv_cuda, "load", broken_build)
    w4_gemv_cuda.built.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not w4_gemv_cuda.built()
        assert "unsupported gpu architecture" in caplog.text
    finally:
        w4_gemv_cuda.built.cache_clear()


def reference_weight(w: PackedWeights, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
    """W from `PackedWeights` in plain torch: (q - zero) * scale in fp32, rounded to dtype."""
    q = unpack_int32(w.qweight, 4, 0).float()  # [K, N]
    groups = torch.arange(q.size(0)) // w.group_size
    zeros = w.zeros.float()[groups] if w.zeros is not None else float(w.zero_value)
    return ((q - zeros) * w.scales.float()[groups]).to(dtype).T


def fake_dequant_out(
    repacked: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    out: torch.Tensor,
    group_size: int,
    zero_value: int,
) -> None:
    """w4_gemm.cu's dequantize kernel in torch: the inverse of `repack` (its docstring's
    layout), then (q - z) * s rounded to out's dtype; out [N, K]."""
    tiles, chunks = repacked.shape[:2]
    words = repacked.view(tiles, chunks, 8, 4, 2, 2).to(torch.int64) & 0xFFFFFFFF  # j c g t s h
    nibbles = torch.stack(
        [(words >> (4 * position)) & 0xF for position in (0, 4, 1, 5, 2, 6, 3, 7)], dim=-1
    )  # [j, c, g, t, s, h, i]
    q = nibbles.permute(1, 4, 3, 6, 0, 5, 2).reshape(chunks * 64, tiles * 16)  # [K_pad, N_pad]
    n, k = out.shape
    groups = torch.arange(k) // group_size
    z = zeros.float()[groups] if zeros is not None else float(zero_value)
    out.copy_(((q[:k, :n].float() - z) * scales.float()[groups]).to(out.dtype).T)


@pytest.mark.parametrize("n", [80, 200])  # 200: the last slice ends inside a 16-column tile
def test_dequant_linear_slices_w(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Above GEMM_MAX_M rows, W is dequantized a slice of whole tiles at a time (bounded
    temporary): with slices of 3 tiles, every column, its scales, zero points and bias land
    where one whole-W dequantization puts them (the kernel stood in by a torch emulation of
    its layout, so this runs on the CPU)."""
    torch.manual_seed(6)
    k = 256
    w = random_weights(k, n, 64, True, torch.bfloat16, "cpu")
    monkeypatch.setitem(w4_gemv_cuda._LOADED, "module", type("Ext", (), {})())
    monkeypatch.setattr(w4_gemv_cuda._LOADED["module"], "w4_dequant_out", fake_dequant_out,
                        raising=False)  # fmt: skip
    packed = w4_gemv_cuda.RepackedWeights(w)
    x = torch.randn(70, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, reference_weight(w, torch.bfloat16), bias)
    whole = w4_gemv_cuda.dequant_linear(x, packed, bias)  # one slice
    monkeypatch.setattr(w4_gemv_cuda, "DEQUANT_SLICE_BYTES", 3 * 16 * 2 * k)
    sliced = w4_gemv_cuda.dequant_linear(x, packed, bias)
    assert torch.equal(whole, expected)
    torch.testing.assert_close(sliced, expected, rtol=2**-7, atol=1e-2)


def gemm_weights(k: int, n: int, group_size: int, asym: bool, dtype: torch.dtype) -> tuple:
    """(w, repacked, scales in x's dtype): the GEMM takes scales in the activation dtype."""
    w = random_weights(k, n, group_size, asym, dtype, "cuda")
    return w, w4_gemv_cuda.repack(w), w.scales


@kernel_grid
def test_w4_gemm_matches_reference(
    k: int, n: int, group_size: int, dtype: torch.dtype, asym: bool
) -> None:
    """M past the GEMV (9..255 rows: partial m16 tiles, several row blocks), with and without
    bias, against x @ W^T with W rounded to x's dtype; and the dequantized weight for large M
    equals the reference's exactly. N not a multiple of 8 is refused by the GEMM."""
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")
    from pagedserve.layers.kernels.quant_gemm import dequantize

    torch.manual_seed(k + n + 1)
    w, repacked, scales = gemm_weights(k, n, group_size, asym, dtype)
    dense = w4_gemv_cuda.dequantize_repacked(w, repacked, scales)  # [N, K]
    assert torch.equal(dense, dequantize(w, dtype).T)
    if n % 8 != 0:  # the GEMM copies 8 columns' scales at a time; w4_linear dequantizes then
        with pytest.raises(RuntimeError, match="multiples of 8"):
            w4_gemv_cuda.w4_gemm(torch.zeros(9, k, device="cuda", dtype=dtype), w, repacked, scales)
        return
    for m, with_bias in itertools.product((9, 16, 31, 64, 65, 200), (False, True)):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if with_bias else None
        y = w4_gemv_cuda.w4_gemm(x, w, repacked, scales, bias)
        assert_matches(y, x, w, bias, rounded=True)


@pytest.mark.gpu
def test_w4_gemm_every_launch_config() -> None:
    """Every built (num_warps, mt, nt, kw) with every split gives the same result: warps with no
    tile, splits of uneven length, row blocks past M; others are a ValueError."""
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")
    torch.manual_seed(2)
    w, repacked, scales = gemm_weights(1088, 200, 64, True, torch.bfloat16)  # 17 chunks
    x = torch.randn(40, 1088, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(200, device="cuda", dtype=torch.bfloat16)
    for (warps, mt, nt, kw), split in itertools.product(w4_gemv_cuda.GEMM_CONFIGS, (1, 2, 3, 8)):
        config = (warps, split, mt, nt, kw)
        y = w4_gemv_cuda.w4_gemm(x, w, repacked, scales, bias, config=config)
        assert_matches(y, x, w, bias, rounded=True)
    with pytest.raises(ValueError, match="GEMM_CONFIGS"):
        w4_gemv_cuda.w4_gemm(x, w, repacked, scales, bias, config=(2, 1, 1, 1, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [96, 200])
def test_repacked_layer_every_m(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, n: int
) -> None:
    """A GPTQ layer processed on the GPU holds `RepackedWeights` (the 4-bit weight once, no
    qweight), and `w4_linear` serves every M: GEMV, GEMM and dequantize + cuBLAS, whole or
    a slice of tiles at a time."""
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")
    from pagedserve.layers.linear import RowParallelLinear
    from pagedserve.quant_config import GPTQConfig

    torch.manual_seed(5)
    k = 512
    w = random_weights(k, n, 128, True, dtype, "cpu")
    assert w.zeros is not None
    w.zeros.data.clamp_(min=1)  # GPTQ v1 stores zero - 1 in 4 bits
    qzeros = pack_int32(w.zeros.int() - 1, 4, 1)
    config = GPTQConfig(weight_bits=4, group_size=128, desc_act=False, sym=False)
    layer = RowParallelLinear(k, n, bias=False, quant_config=config)
    tensors = {"qweight": w.qweight.data, "qzeros": qzeros, "scales": w.scales.data}
    tensors["g_idx"] = torch.arange(k, dtype=torch.int32) // 128
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    layer = layer.to(device="cuda", dtype=dtype)
    layer.quant_method.process_weights_after_loading(layer)
    packed = layer.packed_weights
    assert isinstance(packed, w4_gemv_cuda.RepackedWeights) and not hasattr(packed, "qweight")
    w = w.to("cuda")
    for m in (1, 8, 9, 64, 100, 300):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        assert_matches(layer(x), x, w, None, rounded=m > w4_gemv_cuda.MAX_M)
    monkeypatch.setattr(w4_gemv_cuda, "DEQUANT_SLICE_BYTES", 3 * 16 * 2 * k)  # 3-tile slices
    for m in (100, 300):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        assert_matches(layer(x), x, w, None, rounded=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_programmatic_launch_waits_for_its_input(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With programmatic dependent launch the GEMV starts before the kernel that writes its x
    has finished (the RMSNorm and SiLU-and-mul kernels let it, fused_ops), and the RMSNorm
    (itself launched with PDL) before the GEMV that writes its input has; each must still read
    its input kernel's output: a decoder-layer-like chain (norm -> W4 GEMV -> SiLU-and-mul ->
    W4 GEMV -> norm -> W4 GEMV with the SiLU epilogue -> W4 GEMV) replayed from a CUDA graph
    with new inputs each time gives bit for bit what the launches without PDL
    (PAGEDSERVE_PDL=0) give, for M = 1 and 8."""
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")
    if not w4_gemv_cuda.use_pdl(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    from pagedserve.layers.kernels.fused_ops import rms_norm, silu_and_mul

    torch.manual_seed(7)
    hidden, inter = 2048, 5632
    up = random_weights(hidden, 2 * inter, 128, True, dtype, "cuda")
    down = random_weights(inter, hidden, 128, True, dtype, "cuda")
    up_r, down_r = w4_gemv_cuda.repack(up), w4_gemv_cuda.repack(down)
    norm_weight = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5

    def chain(src: torch.Tensor, residual: torch.Tensor, pdl: bool) -> torch.Tensor:
        x, _ = rms_norm(src, norm_weight, 1e-6, residual)
        h = w4_gemv_cuda.w4_gemv(x, up, up_r, pdl=pdl)
        y = w4_gemv_cuda.w4_gemv(silu_and_mul(h), down, down_r, pdl=pdl)
        x, _ = rms_norm(y, norm_weight, 1e-6, residual)
        h = w4_gemv_cuda.w4_gemv_silu_and_mul(x, up, up_r, pdl=pdl)
        return w4_gemv_cuda.w4_gemv(h, down, down_r, pdl=pdl)

    def without_pdl(src: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        with monkeypatch.context() as patch:
            patch.setenv(envs.PDL, "0")
            gdc.clear_cache()
            out = chain(src, residual, pdl=False)
        gdc.clear_cache()
        return out

    for m in (1, 8):
        src = torch.randn(m, hidden, device="cuda", dtype=dtype)
        residual = torch.randn(m, hidden, device="cuda", dtype=dtype)
        graph = torch.cuda.CUDAGraph()
        chain(src, residual, pdl=True)  # warm-up outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = chain(src, residual, pdl=True)
        for _ in range(20):
            src.copy_(torch.randn_like(src))
            residual.copy_(torch.randn_like(residual))
            graph.replay()
            assert torch.equal(out, without_pdl(src, residual))


def _late_copy_kernels() -> tuple[Any, Any]:
    """Two Triton kernels for the PDL test: `late_copy` lets its PDL dependents launch at its
    start, then writes its output only `delay_ns` later; `copy` (launched with PDL, without
    griddepcontrol.wait) is the control that shows the early-launch window is there."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, globaltimer

    @triton.jit
    def late_copy(src_ptr, dst_ptr, n, delay_ns, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        gdc_launch_dependents()
        start = globaltimer()
        while globaltimer() - start < delay_ns:
            pass
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    @triton.jit
    def copy(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    return late_copy, copy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_programmatic_launch_waits_for_a_late_input(dtype: torch.dtype) -> None:
    """x starts as NaN and its producer (which lets the GEMV launch at once) writes it only
    50 us later: a GEMV that read x before griddepcontrol.wait would return NaNs. Skipped when
    the control (a PDL consumer without the wait) does not see the NaNs, i.e. when the device
    shows no early-launch window to test."""
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")
    if not w4_gemv_cuda.use_pdl(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    late_copy, copy = _late_copy_kernels()
    k, n, block = 4096, 4096, 1024
    w = random_weights(k, n, 128, True, dtype, "cuda")
    r = w4_gemv_cuda.repack(w)

    def late_x(src: torch.Tensor) -> torch.Tensor:  # NaN until 50 us after its launch
        x = torch.full_like(src, float("nan"))
        late_copy[(-(-src.numel() // block),)](src, x, src.numel(), 50_000, BLOCK=block)
        return x

    def busy() -> None:  # the GPU sleeps while the host queues what follows: Python's own
        torch.cuda._sleep(2_000_000)  # launch gaps (tens of us) would hide the window

    for m in (1, 8):
        src = torch.randn(m, k, device="cuda", dtype=dtype)
        seen = torch.empty_like(src)
        busy()
        copy[(-(-src.numel() // block),)](
            late_x(src), seen, src.numel(), BLOCK=block, launch_pdl=True
        )
        torch.cuda.synchronize()
        if not bool(seen.isnan().any()):
            pytest.skip("no early launch observed: nothing to test the wait against")
        expected = w4_gemv_cuda.w4_gemv(src, w, r, pdl=False)
        for _ in range(10):
            busy()
            assert torch.equal(w4_gemv_cuda.w4_gemv(late_x(src), w, r, pdl=True), expected)


@pytest.mark.gpu
def test_bf16_gptq_model_graphs_equal_eager(
    float_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A tiny bf16 GPTQ Llama served on the CUDA kernels (every quantized linear holds
    `RepackedWeights`) gives the same greedy tokens with CUDA graphs as eager: 12 sequences, so
    decode runs the GEMM (split-K partial sums allocated inside the graph) and prefill the
    dequantized path."""
    if not w4_gemv_cuda.available():
        pytest.skip("needs a CUDA GPU of sm_80+ and nvcc")
    from pagedserve import LLM, SamplingParams
    from pagedserve.layers.linear import LinearBase

    from .gptq_pack import write_gptq_checkpoint

    path = tmp_path / "gptq"
    write_gptq_checkpoint(float_model, path, tmp_path / "dequantized", 4, 32, False, False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for eager in (False, True):
        with LLM(
            str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64,
            num_gpu_blocks_override=128, enforce_eager=eager,
        ) as llm:  # fmt: skip
            model = llm.llm_engine.engine_core.executor.worker.runner.model
            linears = [m for m in model.modules() if isinstance(m, LinearBase)]
            packed = [getattr(m, "packed_weights", None) for m in linears]
            assert packed and all(isinstance(p, w4_gemv_cuda.RepackedWeights) for p in packed)
            done = llm.generate(prompts, params, use_tqdm=False)
            outputs.append([list(o.outputs[0].token_ids) for o in done])
    assert outputs[0] == outputs[1]
