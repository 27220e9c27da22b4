"""Grid dependency control: when the GPU kernels use programmatic dependent launch (PDL; CUDA
compute capability 9.0+, PTX griddepcontrol), and the Triton side of it.

The W4A16 CUDA GEMV (layers/kernels/w4_gemv_cuda.py) is launched with PDL: it may start while
the kernel before it runs, streams its first weights, and waits (griddepcontrol.wait) for that
kernel's results before it reads x. A kernel lets its dependents launch before it has
finished only when all its programs have executed `launch_dependents()`; the small Triton
kernels that come right before the decode linears (RMSNorm, SiLU-and-mul, the decode
attention and its combine) do so at their start when their `PDL_TRIGGER` constexpr is set
(`pdl_trigger`). The signal is a hint: it has no effect on a kernel launched without PDL,
and none on correctness, since the dependent still waits for this kernel's completion and
memory before it reads anything this kernel wrote. The RMSNorm is also launched with PDL
(`pdl_launch`): it waits (`wait_for_previous`) before anything else, so that it can be resident
while the GEMV before it ends.

A top-level module because both layers/ and attention/ (below it) use it.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import functools
import os

import torch
import triton

from pagedserve import envs

try:  # Triton 3.3+
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait

    _HAVE_GDC = True
except ImportError:  # pragma: no cover (older Triton: the trigger stays off)
    _HAVE_GDC = False


@triton.jit
def launch_dependents():
    """griddepcontrol.launch_dependents (call it under `if PDL_TRIGGER:` only: the
    instruction does not exist below sm_90, nor in Triton's interpreter)."""
    _gdc_launch_dependents()


@triton.jit
def wait_for_previous():
    """griddepcontrol.wait: returns once the kernel before this one in the stream has finished
    and its writes are visible. A kernel launched with PDL (Triton's `launch_pdl=True`) must
    call it before it reads another kernel's output or writes anything (under `if PDL:` only,
    as `launch_dependents`)."""
    _gdc_wait()


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch option of a Triton kernel that calls `wait_for_previous()` first when its
    PDL constexpr (`pdl_trigger`) is set: {"launch_pdl": True} then, else none (Triton's
    interpreter takes no such option)."""
    return {"launch_pdl": True} if pdl_trigger(device) else {}


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch: a CUDA device of compute
    capability 9.0+ (PTX griddepcontrol) and PAGEDSERVE_PDL not "0" (`envs.pdl`). Decided once
    per process and device (the launches ask per call, on the host's hot path)."""
    if device.type != "cuda":
        return False
    # "cuda" without an index is the current device now (a cache keyed by None would keep
    # whichever device was current first)
    return _enabled(device.index if device.index is not None else torch.cuda.current_device())


def pdl_trigger(device: torch.device) -> bool:
    """The PDL_TRIGGER constexpr for a Triton kernel on `device`: `pdl_enabled`, Triton with
    grid dependency control, not Triton's interpreter."""
    if device.type != "cuda":
        return False
    return _trigger(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _enabled(device_index: int) -> bool:
    return envs.pdl() and torch.cuda.get_device_capability(device_index) >= (9, 0)


@functools.cache
def _trigger(device_index: int) -> bool:
    return _HAVE_GDC and not _interpreting() and _enabled(device_index)


def clear_cache() -> None:
    """Forget the decisions (tests that change PAGEDSERVE_PDL or the interpreter switch)."""
    _enabled.cache_clear()
    _trigger.cache_clear()


def _interpreting() -> bool:
    """Triton's own reading of TRITON_INTERPRET ("1", "true", "on", ... all turn it on)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
