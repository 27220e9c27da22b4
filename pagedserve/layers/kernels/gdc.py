"""Grid dependency control for Triton kernels: the early "launch dependents" signal of
programmatic dependent launch (PDL; CUDA compute capability 9.0+, PTX griddepcontrol).

The W4A16 CUDA kernels (w4_gemv_cuda) are launched with PDL: each may start while the kernel
before it runs, streams its first weights, and waits (griddepcontrol.wait) for that kernel's
results before it reads x. A kernel only lets its dependents launch before it has finished
when all its programs have executed `launch_dependents()`; the small Triton kernels that come
right before those linears (RMSNorm, SiLU-and-mul, the decode attention and its combine) do
so at their start when their `PDL_TRIGGER` constexpr is set (`pdl_trigger`). The signal is a
hint with no effect on a kernel launched without PDL, and never on correctness: the dependent
still waits for this kernel's completion and memory before it reads anything it wrote.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import functools
import os

import torch
import triton

from pagedserve import envs

try:  # Triton 3.3+
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents

    _HAVE_GDC = True
except ImportError:  # pragma: no cover (older Triton: the trigger stays off)
    _HAVE_GDC = False


@triton.jit
def launch_dependents():
    """griddepcontrol.launch_dependents (call it under `if PDL_TRIGGER:` only: the
    instruction does not exist below sm_90, nor in Triton's interpreter)."""
    _gdc_launch_dependents()


def pdl_trigger(device: torch.device) -> bool:
    """The PDL_TRIGGER constexpr for a kernel on `device`: a CUDA device of compute capability
    9.0+, Triton with grid dependency control, not Triton's interpreter, PAGEDSERVE_PDL not
    "0" (`envs.pdl`)."""
    return device.type == "cuda" and envs.pdl() and _capable(device.index)


@functools.cache
def _capable(device_index: int | None) -> bool:
    if not _HAVE_GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_capability(index) >= (9, 0)
