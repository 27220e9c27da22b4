"""compressed-tensors (llm-compressor) W4A16 / W8A16 "pack-quantized" linear layers, served
by the GPTQ method: the checkpoint's tensors are converted to GPTQ's layout once, after
loading, and GPTQ's `apply` (CPU reference, or its GPU kernel) computes the layer.

The layout, as compressed-tensors' `PackedQuantizationCompressor` writes it, for a weight
W [N out, K in], bits b (4 or 8), pack = 32 / b, G groups along K (G = 1 for the channel
strategy):

    weight_packed     [N, K / pack] int32   row n packs W's quantized row along K, value k
                                            in bits [(k % pack) * b, ...) of word k // pack
                                            (LSB first), stored as q + 2**(b-1) (unsigned)
    weight_scale      [N, G] float          one scale per (output row, group)
    weight_zero_point [N / pack, G] int32   asymmetric only: zero + 2**(b-1), packed along N
    weight_shape      [2] int               (N, K)
    weight_g_idx      [K] int32             actorder "group" only: the group of each input row

    W[n, k] = weight_scale[n, g] * (u[n, k] - z[n, g]),  g = k // group_size (or g_idx[k]);
    u the stored unsigned value, z the stored zero (2**(b-1) when symmetric)

which is GPTQ's formula with W^T: qweight = u^T packed along K, qzeros = z^T packed along N,
scales = weight_scale^T, zero_offset 0 (compressed-tensors stores the zero itself).
Tensor parallelism shards the checkpoint tensors as GPTQ's (rows of W: N; columns: K and
groups, except with act-order or one group, where every rank keeps all groups).
"""

from typing import Any

import torch
from torch import nn

from pagedserve.layers.quantization.base import (
    LinearMethodBase,
    check_input_split,
    check_output_packing,
    layer_tensor,
    register_param,
)
from pagedserve.layers.quantization.gptq import GPTQLinearMethod
from pagedserve.layers.quantization.packed import pack_int32, unpack_int32
from pagedserve.quant_config import GPTQConfig


class CompressedTensorsWNA16Method(LinearMethodBase):
    """compressed-tensors pack-quantized weights (W4A16 / W8A16, group or channel strategy,
    symmetric or not, act-order "group"), converted to GPTQ's tensors after loading and
    applied by `GPTQLinearMethod` (see the module docstring)."""

    def __init__(self, quant_config: GPTQConfig) -> None:
        self.quant_config = quant_config
        self.gptq = GPTQLinearMethod(quant_config)

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
        check_input_split(
            "compressed-tensors", input_size_per_partition, input_size, config.group_size, pack
        )
        group_size = config.group_size if config.group_size != -1 else input_size
        check_output_packing("compressed-tensors", output_partition_sizes, pack)
        self.sizes = (input_size_per_partition, output_partition_sizes, input_size, output_size)
        self.params_dtype, self.layer_loader = params_dtype, weight_loader
        n = sum(output_partition_sizes)
        # Groups follow a row-parallel shard, except with act-order or one group (as GPTQ).
        groups_sharded = config.group_size != -1 and not config.desc_act
        num_groups = (input_size_per_partition if groups_sharded else input_size) // group_size
        group_attrs = {"input_dim": 1} if groups_sharded else {}

        def register(name: str, tensor: torch.Tensor, attrs: dict[str, Any]) -> None:
            register_param(layer, name, tensor, attrs, weight_loader)

        int32 = torch.int32
        register(
            "weight_packed",
            torch.empty(n, input_size_per_partition // pack, dtype=int32),
            {"output_dim": 0, "input_dim": 1, "packed_dim": 1, "pack_factor": pack},
        )
        register(
            "weight_scale",
            torch.empty(n, num_groups, dtype=params_dtype),
            {"output_dim": 0, **group_attrs},
        )
        if not config.sym:
            register(
                "weight_zero_point",
                torch.empty(n // pack, num_groups, dtype=int32),
                {"output_dim": 0, "packed_dim": 0, "pack_factor": pack, **group_attrs},
            )
        if config.desc_act:
            register(
                "weight_g_idx", torch.empty(input_size_per_partition, dtype=int32), {"input_dim": 0}
            )
        register_param(
            layer, "weight_shape", torch.empty(2, dtype=torch.int64), {}, self._check_shape
        )

    def _check_shape(
        self,
        param: nn.Parameter,  # [2] int64
        loaded: torch.Tensor,  # [2] int: (N of this shard, K), over all ranks
        shard_id: int | str | None = None,
    ) -> None:
        """Check a `weight_shape` tensor against the layer's input size (its N differs per
        fused shard; the weight_packed loader checks those rows)."""
        shape = [int(v) for v in torch.reshape(loaded, (-1,)).tolist()]  # reads a lazy slice
        input_size = self.sizes[2]
        if len(shape) != 2 or shape[1] != input_size:
            raise ValueError(
                f"weight_shape is {shape}, but the layer's input size is {input_size} "
                f"(expected [N, {input_size}])"
            )
        param.data.copy_(torch.tensor(shape))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Replace the checkpoint's tensors with GPTQ's (`qweight`, `qzeros`, `scales`,
        `g_idx`), registered by `GPTQLinearMethod.create_weights`, then let GPTQ process them."""
        config = self.quant_config
        bits = config.weight_bits
        packed = layer_tensor(layer, "weight_packed").data
        unsigned = unpack_int32(packed, bits, 1)  # [N, K]
        scale = layer_tensor(layer, "weight_scale").data  # [N, G]
        if config.sym:
            zeros = torch.full_like(scale, 2 ** (bits - 1), dtype=torch.int32)
        else:
            zeros = unpack_int32(layer_tensor(layer, "weight_zero_point").data, bits, 0)
        k = unsigned.size(1)
        if config.desc_act:
            g_idx = layer_tensor(layer, "weight_g_idx").data.to(torch.int32)
        else:
            g_idx = torch.arange(k, dtype=torch.int32, device=packed.device) // (
                config.group_size if config.group_size != -1 else k
            )
        converted = {
            "qweight": pack_int32(unsigned.t(), bits, 0),
            "qzeros": pack_int32(zeros.t(), bits, 1),
            "scales": scale.t().contiguous(),
            "g_idx": g_idx,
        }
        for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        delattr(layer, "weight_shape")
        in_part, out_parts, in_size, out_size = self.sizes
        with torch.device(packed.device):
            self.gptq.create_weights(
                layer, in_part, out_parts, in_size, out_size, self.params_dtype, self.layer_loader
            )
        for name, tensor in converted.items():
            param = layer_tensor(layer, name)
            if param.shape != tensor.shape:
                raise ValueError(
                    f"compressed-tensors -> GPTQ: {name} has shape {tuple(tensor.shape)}, "
                    f"GPTQ expects {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
        self.gptq.process_weights_after_loading(layer)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.gptq.apply(layer, x, bias)
