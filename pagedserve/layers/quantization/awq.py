"""AWQ weight-only quantization (AutoAWQ "gemm" checkpoints): the parameters, the torch
reference matmul (dequantize, then a dense matmul) used on the CPU, and on CUDA the conversion
to the Triton kernels' layout (qweight repacked along K: `packed.py`).

The layout, as AutoAWQ's `WQLinear_GEMM.from_linear` writes it (awq/modules/linear/gemm.py,
awq/utils/packing_utils.py) and vLLM's AWQ method reads it, for a weight W [N out, K in]:

    qweight [K, N / 8] int32   row k packs columns 8c .. 8c+7 of W^T[k] into word c, in
                               AWQ's interleaved order: bits [4j, 4j+4) hold column
                               8c + AWQ_PACK_ORDER[j] (nibbles hold columns 0 2 4 6 1 3 5 7)
    qzeros  [G, N / 8] int32   zero points, packed the same way (stored as is, no offset)
    scales  [G, N] float16     one scale per (group, output column), G = K / group_size

    W^T[k, n] = scales[g, n] * (q[k, n] - zero[g, n]),  g = k // group_size

Unlike GPTQ, qweight is packed along N (the output features), so column-parallel layers
split qweight's and qzeros' columns / 8 and scales' columns, and row-parallel layers split
the rows of qweight (K) and of qzeros/scales (groups; a shard may not split a group).
"""

from typing import Any

import torch
from torch import nn

from pagedserve.layers.quantization.base import (
    DequantizingLinearMethod,
    check_input_split,
    check_output_packing,
    layer_tensor,
    register_param,
)
from pagedserve.layers.quantization.packed import (
    PackedWeights,
    awq_packed_weights,
    unpack_int32,
)
from pagedserve.quant_config import AWQConfig

# Position (within a run of 8 output columns) of the value in nibble j of an AWQ word.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def dequantize_awq(
    qweight: torch.Tensor,  # [K, N / 8] int32
    qzeros: torch.Tensor,  # [G, N / 8] int32
    scales: torch.Tensor,  # [G, N] float
    group_size: int,
) -> torch.Tensor:  # [K, N] float32: W^T
    """The float weight W^T of an AWQ (GEMM, 4-bit) tensor set (see the module docstring)."""
    q = unpack_int32(qweight, 4, 1, AWQ_PACK_ORDER)
    zeros = unpack_int32(qzeros, 4, 1, AWQ_PACK_ORDER)
    groups = torch.arange(q.size(0), device=q.device) // group_size
    return (q - zeros[groups]).to(torch.float32) * scales.to(torch.float32)[groups]


class AWQLinearMethod(DequantizingLinearMethod):
    """AWQ linear method (vLLM's `AWQLinearMethod`): the Triton GEMM on CUDA, the torch
    reference elsewhere (`DequantizingLinearMethod`)."""

    checkpoint_tensors = ("qweight", "qzeros", "scales")

    def __init__(self, quant_config: AWQConfig) -> None:
        self.quant_config = quant_config

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        weight_loader: Any,
    ) -> None:
        config = self.quant_config
        pack, group_size = config.pack_factor, config.group_size
        check_input_split("AWQ", input_size_per_partition, input_size, group_size, 1)
        check_output_packing("AWQ", output_partition_sizes, pack)
        n = sum(output_partition_sizes)
        num_groups = input_size_per_partition // group_size
        packed = {"input_dim": 0, "output_dim": 1, "packed_dim": 1, "pack_factor": pack}
        int32 = torch.int32
        for name, tensor, attrs in (
            ("qweight", torch.empty(input_size_per_partition, n // pack, dtype=int32), packed),
            ("qzeros", torch.empty(num_groups, n // pack, dtype=int32), packed),
            (
                "scales",
                torch.empty(num_groups, n, dtype=params_dtype),
                {"input_dim": 0, "output_dim": 1},
            ),
        ):
            register_param(layer, name, tensor, attrs, weight_loader)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [K / tp, N / tp] float32
        return dequantize_awq(
            layer_tensor(layer, "qweight"),
            layer_tensor(layer, "qzeros"),
            layer_tensor(layer, "scales"),
            self.quant_config.group_size,
        )

    def packed_weights(self, layer: nn.Module) -> PackedWeights:
        """This rank's AWQ tensors in the kernels' layout (qweight repacked along K)."""
        return awq_packed_weights(
            layer_tensor(layer, "qweight"),
            layer_tensor(layer, "qzeros"),
            layer_tensor(layer, "scales"),
            self.quant_config.group_size,
            AWQ_PACK_ORDER,
        )
