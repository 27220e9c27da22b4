"""Programmatic dependent launch switches (envs.pdl, layers/kernels/gdc.py, w4_gemv_cuda.use_pdl):
off on the CPU and when PAGEDSERVE_PDL=0; on an sm_90+ GPU the Triton kernels that signal
their dependents early give the same values as without the signal."""

import pytest
import torch

from pagedserve import envs

triton = pytest.importorskip("triton")


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
    from pagedserve.layers.kernels import w4_gemv_cuda
    from pagedserve.layers.kernels.gdc import pdl_trigger

    assert not pdl_trigger(torch.device("cpu"))
    monkeypatch.setenv(envs.PDL, "0")
    assert not pdl_trigger(torch.device("cuda", 0))
    assert not w4_gemv_cuda.use_pdl(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_trigger_changes_no_value(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """RMSNorm (with residual) and SiLU-and-mul with and without the early launch signal."""
    from pagedserve.layers.kernels.fused_ops import rms_norm, silu_and_mul

    x = torch.randn(5, 4096, dtype=dtype, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(4096, dtype=dtype, device="cuda")
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(envs.PDL, switch)
        normed, summed = rms_norm(x, weight, 1e-6, residual)
        results.append((normed, summed, silu_and_mul(x)))
    for on, off in zip(*results, strict=True):
        assert torch.equal(on, off)
