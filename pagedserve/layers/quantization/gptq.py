"""GPTQ weight-only quantization (AutoGPTQ / GPTQModel checkpoints): the parameters, the
torch reference matmul (dequantize, then a dense matmul) used on the CPU, and on CUDA the
conversion to the Triton kernels' layout (`packed.py`, `pagedserve/layers/kernels/quant_gemm.py`).

The layout, as AutoGPTQ's `QuantLinear.pack` writes it (auto_gptq/nn_modules/qlinear/
qlinear_cuda_old.py) and vLLM's GPTQ method reads it, for a weight W [N out, K in]:

    qweight [K / pack, N] int32   row i packs input rows i*pack .. i*pack+pack-1 of W^T,
                                  row i*pack+j in bits [j*bits, (j+1)*bits) (LSB first)
    qzeros  [G, N / pack] int32   zero points packed the same way along N; v1 format stores
                                  zero - 1 (`zero_offset` adds it back)
    scales  [G, N] float16        one scale per (group, output column)
    g_idx   [K] int32             group of each input row (k // group_size without act-order,
                                  an arbitrary permutation of groups with desc_act)

    W^T[k, n] = scales[g, n] * (q[k, n] - zero[g, n]),  g = g_idx[k]

Tensor parallelism (as vLLM): column-parallel layers split N (qweight and scales columns,
qzeros columns / pack); row-parallel layers split K (qweight rows / pack, g_idx, and the
scale/zero groups, except with act-order or one group, where every rank keeps all groups).
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
    gptq_packed_weights,
    unpack_int32,
)
from pagedserve.quant_config import GPTQConfig


def dequantize_gptq(
    qweight: torch.Tensor,  # [K / pack, N] int32
    qzeros: torch.Tensor,  # [G, N / pack] int32
    scales: torch.Tensor,  # [G, N] float
    groups: torch.Tensor,  # [K] int64: the group (row of scales/qzeros) of each input row
    bits: int,
    zero_offset: int,
) -> torch.Tensor:  # [K, N] float32: W^T
    """The float weight W^T of a GPTQ tensor set (see the module docstring)."""
    q = unpack_int32(qweight, bits, 0)
    zeros = unpack_int32(qzeros, bits, 1) + zero_offset
    scales32 = scales.to(torch.float32)
    return (q - zeros[groups]).to(torch.float32) * scales32[groups]


class GPTQLinearMethod(DequantizingLinearMethod):
    """GPTQ linear method (vLLM's `GPTQLinearMethod`): the Triton GEMM on CUDA, the torch
    reference elsewhere (`DequantizingLinearMethod`)."""

    checkpoint_tensors = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, quant_config: GPTQConfig) -> None:
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
        pack = config.pack_factor
        check_input_split("GPTQ", input_size_per_partition, input_size, config.group_size, pack)
        group_size = config.group_size if config.group_size != -1 else input_size
        check_output_packing("GPTQ", output_partition_sizes, pack)
        output_size_per_partition = sum(output_partition_sizes)
        # Row-parallel shards keep their own groups, unless rows of a shard may belong to any
        # group (act-order) or there is one group: then every rank holds all of them.
        num_groups, group_dim = input_size // group_size, None
        row_sharded = input_size != input_size_per_partition
        if row_sharded and config.group_size != -1 and not config.desc_act:
            num_groups, group_dim = input_size_per_partition // group_size, 0
        self.group_size = group_size

        def register(name: str, tensor: torch.Tensor, attrs: dict[str, Any]) -> None:
            register_param(layer, name, tensor, attrs, weight_loader)

        int32 = torch.int32
        register(
            "qweight",
            torch.empty(input_size_per_partition // pack, output_size_per_partition, dtype=int32),
            {"input_dim": 0, "output_dim": 1, "packed_dim": 0, "pack_factor": pack},
        )
        register("g_idx", torch.empty(input_size_per_partition, dtype=int32), {"input_dim": 0})
        zero_attrs = {"output_dim": 1, "packed_dim": 1, "pack_factor": pack}
        scale_attrs: dict[str, Any] = {"output_dim": 1}
        if group_dim is not None:
            zero_attrs["input_dim"] = scale_attrs["input_dim"] = group_dim
        register(
            "qzeros",
            torch.empty(num_groups, output_size_per_partition // pack, dtype=int32),
            zero_attrs,
        )
        register(
            "scales",
            torch.empty(num_groups, output_size_per_partition, dtype=params_dtype),
            scale_attrs,
        )

    def groups(self, layer: nn.Module) -> torch.Tensor:  # [K / tp] int64
        """The row of scales/qzeros of each of this rank's input rows: `g_idx` with
        act-order (global groups; every rank holds them all), else position // group_size
        (as vLLM, which ignores g_idx then)."""
        g_idx = layer_tensor(layer, "g_idx")
        if self.quant_config.desc_act:
            return g_idx.long()
        return torch.arange(g_idx.numel(), device=g_idx.device) // self.group_size

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [K / tp, N / tp] float32
        """This rank's float weight W^T from the layer's GPTQ parameters."""
        config = self.quant_config
        return dequantize_gptq(
            layer_tensor(layer, "qweight"),
            layer_tensor(layer, "qzeros"),
            layer_tensor(layer, "scales"),
            self.groups(layer),
            config.weight_bits,
            config.zero_offset,
        )

    def packed_weights(self, layer: nn.Module) -> PackedWeights:
        """This rank's GPTQ tensors in the kernels' layout; with act-order the rows are sorted
        by group and x's columns are gathered through the permutation at apply time."""
        config = self.quant_config
        qweight, qzeros, scales = (layer_tensor(layer, n) for n in self.checkpoint_tensors[:3])
        groups = self.groups(layer)
        bits, offset = config.weight_bits, config.zero_offset
        return gptq_packed_weights(qweight, qzeros, scales, groups, bits, offset, self.group_size)
