"""The linear-method interface of quantized (and plain) linear layers, as vLLM's
`LinearMethodBase`: a method registers its parameters on the layer (`create_weights`) and
computes the layer's output from them (`apply`)."""

import functools
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.kernels import use_quant_kernels
from pagedserve.layers.quantization.packed import PackedWeights


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, Any]) -> None:
    """Attach loading metadata (e.g. `weight_loader`, `output_dim`) to a parameter, as vLLM."""
    for key, value in attrs.items():
        setattr(param, key, value)


def register_param(
    layer: nn.Module,
    name: str,
    tensor: torch.Tensor,
    attrs: dict[str, Any],
    weight_loader: Any,
) -> None:
    """Register `tensor` as the frozen parameter `name` of `layer`, with the loading
    attributes `attrs` and the layer's `weight_loader`."""
    param = nn.Parameter(tensor, requires_grad=False)
    set_weight_attrs(param, {**attrs, "weight_loader": weight_loader})
    layer.register_parameter(name, param)


def check_input_split(
    method: str, input_size_per_partition: int, input_size: int, group_size: int, pack: int
) -> None:
    """Raise ValueError unless this rank's input rows hold whole groups and whole int32
    words along K. group_size -1 is one group over all of K, which row-parallel ranks keep
    whole (every rank holds it); pack is the values per int32 along K (1: not packed)."""
    split_group = group_size != -1 and input_size_per_partition % group_size
    if split_group or input_size_per_partition % pack:
        words = f" and of {pack} values per int32" if pack > 1 else ""
        raise ValueError(
            f"{method}: this rank's input size {input_size_per_partition} (of {input_size}) "
            f"is not a multiple of group_size {group_size}{words}; the tensor parallel size "
            f"may be too large"
        )


def check_output_packing(method: str, output_partition_sizes: list[int], pack: int) -> None:
    """Raise ValueError unless each of this rank's fused output sizes fills whole int32 words
    (the output features are packed `pack` per word in qzeros, and in AWQ's qweight)."""
    for size in output_partition_sizes:
        if size % pack:
            raise ValueError(
                f"{method}: this rank's output size {size} is not a multiple of {pack} values "
                f"per int32 (the output features are packed); the tensor parallel size may "
                f"be too large"
            )


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """The parameter `name` a linear method registered on `layer`."""
    return cast(torch.Tensor, getattr(layer, name))


class LinearMethodBase:
    """How a linear layer stores and applies its weight.

    Each parameter a method registers carries the attributes the layer's weight loaders use
    to shard it (vLLM's names): `output_dim` (the dim of the output features, sharded by
    column-parallel layers; absent: the tensor is replicated there), `input_dim` (the dim of
    the input features, sharded by row-parallel layers; absent: replicated), and for packed
    int32 tensors `packed_dim` and `pack_factor` (values per int32 along `packed_dim`, so a
    shard's offset and size along it are divided by pack_factor).
    """

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],  # per rank; several for fused (merged, QKV) layers
        input_size: int,  # over all ranks
        output_size: int,  # over all ranks
        params_dtype: torch.dtype,
        weight_loader: Any,
    ) -> None:
        """Register this method's parameters on `layer`. Raises ValueError when the sizes do
        not fit the method's layout (e.g. a tensor-parallel shard splitting a group)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded checkpoint tensors into what `apply` reads (e.g. repack for a
        kernel, quantize a float weight online); called once per layer after every weight
        (or the dummy weights) is in place, as vLLM's hook of the same name. No-op here."""

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [num_tokens, input_size_per_partition] float
        bias: torch.Tensor | None = None,  # [output_size_per_partition]
    ) -> torch.Tensor:  # [num_tokens, output_size_per_partition], x's dtype
        """The layer's output x W^T + bias from its registered parameters."""
        raise NotImplementedError

    def apply_silu_and_mul(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [num_tokens, input_size_per_partition] float
        bias: torch.Tensor | None = None,  # [output_size_per_partition]
    ) -> torch.Tensor | None:  # [num_tokens, output_size_per_partition / 2], x's dtype
        """silu(gate) * up of the layer's [gate | up] output computed in one kernel, or None
        where this method has no such kernel for x (the caller then runs `apply` and the
        activation). None here."""
        return None

    def apply_rope(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [num_tokens, input_size_per_partition] float
        bias: torch.Tensor | None,  # [output_size_per_partition]
        positions: torch.Tensor,  # [num_tokens] int64
        cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] float32, [cos | sin]
        head_dim: int,
        rot_cols: int,  # the q and k heads' columns, rotated; the rest (v) is not
    ) -> torch.Tensor | None:  # [num_tokens, output_size_per_partition], x's dtype
        """The layer's qkv output with the rotary embedding (neox layout) of its first
        `rot_cols` columns applied in the same kernel, or None where this method has no such
        kernel for x (the caller then runs `apply` and the rotary embedding). None here."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    """A plain weight [output_size_per_partition, input_size_per_partition] in params_dtype."""

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
        weight = torch.empty(
            sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype
        )
        register_param(layer, "weight", weight, {"input_dim": 1, "output_dim": 0}, weight_loader)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, layer_tensor(layer, "weight"), bias)


class DequantizingLinearMethod(LinearMethodBase):
    """A packed-integer method (GPTQ, AWQ) with three `apply` paths:

    - CUDA, 4-bit without act-order, fp16/bf16, nvcc present: `process_weights_after_loading`
      converts the checkpoint tensors (`checkpoint_tensors`, then removed from the layer) into
      the CUDA kernels' `RepackedWeights`, kept as the layer's submodule `packed_weights`, and
      `apply` runs `pagedserve.layers.kernels.w4_gemv_cuda.w4_linear` (GEMV, tensor-core GEMM,
      or dequantize + cuBLAS by M).
    - other CUDA cases with Triton: `PackedWeights` as `packed_weights`, and the Triton GEMM
      (`pagedserve.layers.kernels.quant_gemm.quant_linear`).
    - otherwise (CPU, or no Triton): the torch reference, which dequantizes this rank's weight
      and runs a dense matmul; the checkpoint tensors stay as loaded. The GPU kernels are
      tested against it.
    """

    # The parameters `create_weights` registers, replaced by `packed_weights` on the GPU path.
    checkpoint_tensors: tuple[str, ...] = ()

    def dequantize(self, layer: nn.Module) -> torch.Tensor:  # [K / tp, N / tp] float32
        """This rank's float weight W^T from the layer's quantized parameters."""
        raise NotImplementedError

    def packed_weights(self, layer: nn.Module) -> PackedWeights | None:
        """The layer's weight in the GPU kernels' layout (None: this method has no kernel)."""
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack for the GPU kernels when the weights are on a CUDA device and Triton is
        importable (once; a later call is a no-op): the CUDA W4A16 kernels' layout where they
        take the weight (`_cuda_repacked`), else the Triton kernels'. CPU tensors are left
        untouched."""
        if hasattr(layer, "packed_weights") or not self.checkpoint_tensors:
            return
        if not use_quant_kernels(layer_tensor(layer, self.checkpoint_tensors[0])):
            return
        packed = self.packed_weights(layer)
        if packed is None:
            return
        for name in self.checkpoint_tensors:
            delattr(layer, name)
        layer.packed_weights = _cuda_repacked(packed)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed = getattr(layer, "packed_weights", None)
        if isinstance(packed, PackedWeights):
            from pagedserve.layers.kernels.quant_gemm import quant_linear

            return quant_linear(x, packed, bias)
        if packed is not None:
            from pagedserve.layers.kernels.w4_gemv_cuda import w4_linear

            return w4_linear(x, packed, bias)
        out = x @ self.dequantize(layer).to(x.dtype)
        return out + bias if bias is not None else out

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The CUDA W4A16 GEMV's SwiGLU epilogue (`w4_gemv_cuda.w4_gemv_silu_and_mul`: 1..8
        rows of x, PAGEDSERVE_W4_EPILOGUES on), else None."""
        packed = _cuda_weights(layer)
        if packed is None:
            return None
        from pagedserve.layers.kernels import w4_gemv_cuda

        if not w4_gemv_cuda.supports_silu_and_mul(packed, x):
            return None
        return w4_gemv_cuda.w4_gemv_silu_and_mul(x, packed, packed.repacked, bias)

    def apply_rope(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        head_dim: int,
        rot_cols: int,
    ) -> torch.Tensor | None:
        """The CUDA W4A16 GEMV's rotary epilogue (`w4_gemv_cuda.w4_gemv_rope`: 1..8 rows of
        x, PAGEDSERVE_W4_EPILOGUES on), else None."""
        packed = _cuda_weights(layer)
        if packed is None:
            return None
        from pagedserve.layers.kernels import w4_gemv_cuda

        if not w4_gemv_cuda.supports_rope(packed, x, positions, cos_sin_cache, head_dim, rot_cols):
            return None
        return w4_gemv_cuda.w4_gemv_rope(
            x, packed, packed.repacked, positions, cos_sin_cache, head_dim, rot_cols, bias
        )


def _cuda_weights(layer: nn.Module) -> Any:
    """The layer's CUDA kernels' `RepackedWeights` when it holds them and the fused
    epilogues are on (`epilogues_enabled`), else None."""
    packed = getattr(layer, "packed_weights", None)
    if packed is None or isinstance(packed, PackedWeights) or not epilogues_enabled():
        return None
    return packed


@functools.cache
def epilogues_enabled() -> bool:
    """envs.w4_epilogues, read once per process (the layers ask on every eager decode call;
    CUDA graphs freeze the choice at capture anyway). Tests that change it call
    `epilogues_enabled.cache_clear()`."""
    from pagedserve import envs

    return envs.w4_epilogues()


def _cuda_repacked(packed: PackedWeights) -> nn.Module:
    """The CUDA kernels' `RepackedWeights` in place of `packed` where they take it (4-bit,
    no act-order, fp16/bf16 scales, i.e. model dtype, the extension built, PAGEDSERVE_W4_CUDA
    not 0), else `packed` (the Triton kernels)."""
    from pagedserve import envs
    from pagedserve.layers.kernels import w4_gemv_cuda

    if not envs.w4_cuda() or not w4_gemv_cuda.supports_weight(packed):
        return packed
    if not w4_gemv_cuda.built():  # built here, at the first such layer's load
        return packed
    return w4_gemv_cuda.RepackedWeights(packed)
