"""A test-side AWQ (AutoAWQ "gemm") packer written from the format (not from our loader):
AutoAWQ's zero-point round-to-nearest quantizer (`pseudo_quantize_tensor`: per group and
output column, scale = (max - min) / 15, zero = clamp(-round(min / scale), 0, 15)), packed
as `WQLinear_GEMM.from_linear` lays it out (awq/modules/linear/gemm.py): W^T [K, N] packed
along N, 8 columns per int32, nibble j holding column AWQ_ORDER[j] of its run of 8.
AWQ's activation-aware scale search is not reproduced: it only changes the float weights
before this step, not the layout.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from .gptq_pack import pack_int32, write_quantized_checkpoint

# AutoAWQ's `order_map`: bits [4j, 4j+4) of a word hold column AWQ_ORDER[j] of its 8.
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass
class AWQPacked:
    qweight: torch.Tensor  # [K, N / 8] int32
    qzeros: torch.Tensor  # [K / group_size, N / 8] int32
    scales: torch.Tensor  # [K / group_size, N] float16
    dequantized: torch.Tensor  # [N, K] float32: the quantized grid, as the float weight W


def pack_awq(values: torch.Tensor) -> torch.Tensor:  # [R, C / 8] int32
    """Pack 4-bit `values` [R, C] along C in AWQ's interleaved order."""
    runs = values.reshape(values.shape[0], -1, 8)[:, :, AWQ_ORDER]  # nibble j <- AWQ_ORDER[j]
    return torch.from_numpy(pack_int32(runs.reshape(values.shape).numpy(), 4, axis=1))


def quantize_awq(weight: torch.Tensor, group_size: int) -> AWQPacked:  # weight [N, K] float
    """Quantize W per (group of K, output column) with zero points and pack it."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    max_val, min_val = groups.amax(dim=2), groups.amin(dim=2)  # [N, G]
    scales = ((max_val - min_val).clamp(min=1e-5) / 15).to(torch.float16)  # stored in fp16
    s = scales.float()
    zeros = torch.clamp(-torch.round(min_val / s), 0, 15)
    q = torch.clamp(torch.round(groups / s[..., None]) + zeros[..., None], 0, 15)
    dequantized = ((q - zeros[..., None]) * s[..., None]).reshape(n, k)
    q_t = q.reshape(n, k).T.to(torch.int64)  # W^T [K, N]
    return AWQPacked(
        qweight=pack_awq(q_t),
        qzeros=pack_awq(zeros.T.to(torch.int64)),
        scales=scales.T.contiguous(),
        dequantized=dequantized,
    )


def awq_quantization_config(group_size: int) -> dict:
    """config.json's quantization_config as transformers writes it for an AutoAWQ GEMM model."""
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


def write_awq_checkpoint(
    float_model_path: Path, out: Path, dequantized_out: Path, group_size: int
) -> None:
    """An AWQ checkpoint of the float model (`write_quantized_checkpoint`)."""
    write_quantized_checkpoint(
        float_model_path,
        out,
        dequantized_out,
        lambda prefix, weight: quantize_awq(weight, group_size),
        ("qweight", "qzeros", "scales"),
        awq_quantization_config(group_size),
    )
