"""Programmatic dependent launch switches (envs.pdl, pagedserve/gdc.py, w4_gemv_cuda.use_pdl):
off on the CPU, when PAGEDSERVE_PDL=0, below compute capability 9.0 and under Triton's
interpreter; on an sm_90+ GPU the Triton kernels compiled with the early signal give the same
values as without it."""

from collections.abc import Iterator

import pytest
import torch

from pagedserve import envs

triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _fresh_decisions() -> Iterator[None]:
    """gdc decides once per process and device: each test here changes what it reads."""
    from pagedserve import gdc

    gdc.clear_cache()
    yield
    gdc.clear_cache()


def test_pdl_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(envs.PDL, raising=False)
    assert envs.pdl()
    monkeypatch.setenv(envs.PDL, "0")
    assert not envs.pdl()
    monkeypatch.setenv(envs.PDL, "yes")
    with pytest.raises(ValueError, match="PAGEDSERVE_PDL must be 0 or 1"):
        envs.pdl()


def test_no_trigger_off_the_gpu_or_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU (and Triton's interpreter, which runs kernels on CPU tensors) never gets the
    griddepcontrol instruction; PAGEDSERVE_PDL=0 turns it off before any device query."""
    from pagedserve.gdc import pdl_trigger
    from pagedserve.layers.kernels import w4_gemv_cuda

    assert not pdl_trigger(torch.device("cpu"))
    monkeypatch.setenv(envs.PDL, "0")
    assert not pdl_trigger(torch.device("cuda", 0))
    assert not w4_gemv_cuda.use_pdl(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_trigger_variant_compiles_and_changes_no_value(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """RMSNorm (with residual) and SiLU-and-mul compiled with and without the early launch
    signal (RMSNorm's PDL, SiLU-and-mul's PDL_TRIGGER) give the same values."""
    from pagedserve import gdc
    from pagedserve.gdc import pdl_trigger
    from pagedserve.layers.kernels.fused_ops import rms_norm, silu_and_mul

    monkeypatch.delenv(envs.PDL, raising=False)
    if not pdl_trigger(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("the early signal needs compute capability 9.0+ and Triton 3.3+")

    x = torch.randn(5, 4096, dtype=dtype, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(4096, dtype=dtype, device="cuda")
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(envs.PDL, switch)
        gdc.clear_cache()
        normed, summed = rms_norm(x, weight, 1e-6, residual)
        results.append((normed, summed, silu_and_mul(x)))
    for on, off in zip(*results, strict=True):
        assert torch.equal(on, off)


def test_pdl_gating_on_a_faked_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capability per device (not per the first current device for "cuda" without an index),
    and Triton's interpreter however TRITON_INTERPRET spells "on", without a GPU."""
    from pagedserve import gdc
    from pagedserve.layers.kernels import w4_gemv_cuda

    caps = {0: (9, 0), 1: (8, 0)}
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda i=None: caps[current[0] if i is None else i]
    )
    monkeypatch.delenv(envs.PDL, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    interpret = getattr(getattr(triton, "knobs", None), "runtime", None)
    if interpret is not None:
        monkeypatch.setattr(interpret, "interpret", False)
    try:
        assert gdc.pdl_trigger(torch.device("cuda", 0)) == gdc._HAVE_GDC
        assert not gdc.pdl_trigger(torch.device("cuda", 1))
        assert w4_gemv_cuda.use_pdl(torch.device("cuda", 0))
        assert not w4_gemv_cuda.use_pdl(torch.device("cuda", 1))
        assert not w4_gemv_cuda.use_pdl(torch.device("cpu"))
        assert w4_gemv_cuda.use_pdl(torch.device("cuda"))  # current device 0
        current[0] = 1  # "cuda" follows the current device, not the first one asked about
        assert not w4_gemv_cuda.use_pdl(torch.device("cuda"))
        assert not gdc.pdl_trigger(torch.device("cuda"))
        current[0] = 0
        if interpret is not None:
            monkeypatch.setattr(interpret, "interpret", True)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", "true")
        gdc.clear_cache()
        assert not gdc.pdl_trigger(torch.device("cuda", 0))  # no griddepcontrol interpreted
    finally:
        gdc.clear_cache()
