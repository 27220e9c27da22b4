"""Triton kernels of the layers, used for CUDA tensors only: the small fused ops (half
precision; `fused_ops`) and the GPTQ / AWQ weight-only GEMM (`quant_gemm`)."""

import functools

import torch

_HALF = (torch.float16, torch.bfloat16)


@functools.cache
def _triton_importable() -> bool:
    try:
        import pagedserve.layers.kernels.fused_ops  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused_ops(x: torch.Tensor) -> bool:
    """Whether the fused kernels apply to `x`: a float16/bfloat16 CUDA tensor, Triton present.

    Float32 keeps the PyTorch ops, which match transformers bit for bit in the tests."""
    return x.is_cuda and x.dtype in _HALF and _triton_importable()


def use_quant_kernels(weight: torch.Tensor) -> bool:
    """Whether the Triton GPTQ / AWQ GEMM serves a layer whose quantized weight is `weight`:
    on a CUDA device, with Triton importable (any float activation dtype)."""
    return weight.is_cuda and _triton_importable()


@functools.cache
def num_sms(device_index: int) -> int:
    """The CUDA device's streaming multiprocessors (kernels size their grids by it)."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)
