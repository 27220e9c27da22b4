"""Linear layers sharded Megatron-style over the tensor-parallel group, with weight loaders.

Each layer's parameters come from its linear method (`pagedserve.layers.quantization`):
a plain `weight` [output, input], or GPTQ's / AWQ's packed `qweight`/`qzeros`/`scales`
(and GPTQ's `g_idx`).
The loaders shard every parameter by the attributes the method gives it: column-parallel
layers split `output_dim`, row-parallel layers split `input_dim`, offsets and sizes along a
`packed_dim` are divided by its `pack_factor`, and a tensor without the split dim is
replicated.
"""

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.distributed.comm import tensor_model_parallel_all_reduce
from pagedserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pagedserve.layers.quantization import get_linear_method
from pagedserve.layers.quantization.base import set_weight_attrs
from pagedserve.quant_config import QuantizationConfig

__all__ = ["set_weight_attrs"]

# Copies this rank's part of a full checkpoint tensor into a parameter:
# weight_loader(param, loaded_weight) or weight_loader(param, loaded_weight, shard_id).
WeightLoader = Callable[..., None]


def default_weight_loader(
    param: nn.Parameter,  # any shape and dtype
    loaded_weight: torch.Tensor,  # same shape as param, any dtype and device
) -> None:
    """Copy a replicated (unsharded) tensor, casting to the parameter's dtype and device."""
    check_same_shape(param, loaded_weight)
    param.data.copy_(loaded_weight)


def check_same_shape(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Raise ValueError naming both shapes unless they are equal (copy_ would broadcast a
    [1] tensor silently). The loader (`models.loader`) adds the checkpoint tensor's name."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"but the parameter expects {tuple(param.shape)}"
        )


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    """The parameter's own `weight_loader`, or `default_weight_loader` if it has none."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division; raises ValueError naming `what` when the split would be uneven."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def _copy_shard(
    param_slice: torch.Tensor,  # [n, ...] or [..., n]: this rank's part of a parameter
    loaded_weight: torch.Tensor,  # [num_shards * n, ...] or [..., num_shards * n] full tensor
    dim: int,
    shard_rank: int,
    num_shards: int,
) -> None:
    """Copy shard `shard_rank` of `num_shards` equal slices of `loaded_weight` along `dim`."""
    shard_size = param_slice.size(dim)
    expected = list(param_slice.shape)
    expected[dim] *= num_shards
    if list(loaded_weight.shape) != expected:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {tuple(expected)}"
        )
    param_slice.copy_(loaded_weight.narrow(dim, shard_rank * shard_size, shard_size))


def _packed_narrow(
    param: nn.Parameter, dim: int, offset: int, size: int
) -> torch.Tensor:  # a view of param.data
    """`param.data.narrow(dim, offset, size)` in unpacked units: divided by the parameter's
    pack_factor when `dim` is its packed dim."""
    if getattr(param, "packed_dim", None) == dim:
        pack_factor: int = param.pack_factor  # type: ignore[attr-defined]
        offset, size = offset // pack_factor, size // pack_factor
    return param.data.narrow(dim, offset, size)


def _load_shared(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Load a tensor that every fused shard carries whole (GPTQ's g_idx of q/k/v, which see
    the same input): the first copy is kept, a different later one is an error (one g_idx
    cannot serve both)."""
    if not getattr(param, "shared_loaded", False):
        default_weight_loader(param, loaded_weight)
        param.shared_loaded = True  # type: ignore[attr-defined]
        return
    check_same_shape(param, loaded_weight)  # else a [1] would compare as broadcast
    other = torch.empty_like(param.data)
    other.copy_(loaded_weight)  # also reads a lazy SafetensorsSlice
    if not torch.equal(param.data, other):
        raise ValueError(
            "the fused projections of this layer have different tensors where one is shared "
            "(e.g. act-order g_idx of q/k/v or gate/up): they must be quantized alike"
        )


class LinearBase(nn.Module):
    """y = x W^T + b, W [output_size, input_size] as stored on this rank, in the parameters
    of the layer's linear method (`self.quant_method`: `quant_config`'s, unquantized for None;
    the model passes its quantization config down to every linear, as in vLLM)."""

    def __init__(
        self,
        input_size: int,  # on this rank
        output_size: int,  # on this rank
        bias: bool,
        output_partition_sizes: list[int] | None = None,  # per rank, of fused outputs
        full_sizes: tuple[int, int] | None = None,  # (input_size, output_size) over ranks
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.quant_method = get_linear_method(quant_config)
        self.quant_method.create_weights(
            self,
            input_size,
            output_partition_sizes or [output_size],
            *(full_sizes or (input_size, output_size)),
            torch.get_default_dtype(),
            self.weight_loader,
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(
        self,
        param: nn.Parameter,  # any parameter of the layer, unsharded
        loaded_weight: torch.Tensor,  # same shape as param
    ) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size] float
    ) -> torch.Tensor:  # [num_tokens, output_size] float
        return self.quant_method.apply(self, x, self.bias)

    def forward_silu_and_mul(
        self,
        x: torch.Tensor,  # [num_tokens, input_size] float
    ) -> torch.Tensor | None:  # [num_tokens, output_size / 2] float
        """silu(gate) * up of this [gate | up] layer's output in one kernel where its linear
        method has one for x (the 4-bit CUDA GEMV's epilogue: decode, up to 8 rows), else
        None: the caller then runs the layer and the activation."""
        return self.quant_method.apply_silu_and_mul(self, x, self.bias)

    def forward_rope(
        self,
        x: torch.Tensor,  # [num_tokens, input_size] float
        positions: torch.Tensor,  # [num_tokens] int64
        cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] float32, [cos | sin]
        head_dim: int,
        rot_cols: int,  # the q and k heads' columns (rotated); the v heads' follow
    ) -> torch.Tensor | None:  # [num_tokens, output_size] float
        """This qkv layer's output with the rotary embedding (neox layout) of its q and k heads
        applied in the same kernel where its linear method has one for x (the 4-bit CUDA
        GEMV's epilogue: decode, up to 8 rows), else None: the caller then runs the layer and
        the rotary embedding."""
        return self.quant_method.apply_rope(
            self, x, self.bias, positions, cos_sin_cache, head_dim, rot_cols
        )


class ReplicatedLinear(LinearBase):
    """A linear layer whose full weight lives on every rank."""


class ColumnParallelLinear(LinearBase):
    """Splits the output features: rank r holds rows [r * n, (r + 1) * n) of W and of b,
    with n = output_size / tp_size. Its output stays sharded (no communication)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        output_partition_sizes: list[int] | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        per_rank = divide(output_size, get_tp_size(), "output_size")
        super().__init__(
            input_size,
            per_rank,
            bias,
            output_partition_sizes,
            (input_size, output_size),
            quant_config,
        )
        self.input_size = input_size
        self.output_size = output_size  # total over ranks

    def weight_loader(
        self,
        param: nn.Parameter,  # this rank's part along param.output_dim (if it has one)
        loaded_weight: torch.Tensor,  # the full tensor
    ) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:
            default_weight_loader(param, loaded_weight)
        else:
            _copy_shard(param.data, loaded_weight, dim, self.tp_rank, self.tp_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears fused into one matmul (e.g. gate_proj and up_proj).

    On each rank the weight is [sum(output_sizes) / tp_size, input_size], laid out
    [shard 0 of this rank | shard 1 of this rank | ...]; checkpoint tensors are loaded one at a
    time with `weight_loader(param, loaded_weight, shard_id)`, shard_id = index in output_sizes.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        tp_size = get_tp_size()
        per_rank = [divide(size, tp_size, "each merged output size") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, per_rank, quant_config)

    def weight_loader(  # type: ignore[override]
        self,
        param: nn.Parameter,  # [sum(output_sizes) / tp_size, ...] along param.output_dim
        loaded_weight: torch.Tensor,  # output_sizes[shard_id] along output_dim
        shard_id: int,
    ) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:
            _load_shared(param, loaded_weight)
            return
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = _packed_narrow(param, dim, offset, size)
        _copy_shard(shard, loaded_weight, dim, self.tp_rank, self.tp_size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, sharded by attention heads.

    Per rank the output is [q (num_heads * head_dim) | k (num_kv_heads * head_dim) | v (same)].
    When there are fewer KV heads than ranks, each KV head is replicated on
    tp_size / total_num_kv_heads consecutive ranks (rank r holds KV head r // replicas).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        tp_size = get_tp_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(
                tp_size, total_num_kv_heads, "tp_size (as a multiple of num_kv_heads)"
            )
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_dim  # per rank
        self.kv_size = self.num_kv_heads * head_dim  # per rank
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_dim
        per_rank = [self.q_size, self.kv_size, self.kv_size]
        super().__init__(hidden_size, output_size, bias, per_rank, quant_config)

    def weight_loader(  # type: ignore[override]
        self,
        param: nn.Parameter,  # [q_size + 2 * kv_size, ...] along param.output_dim
        loaded_weight: torch.Tensor,  # full q_proj/k_proj/v_proj tensor
        shard_id: str,
    ) -> None:
        if shard_id == "q":
            offset, size, shard_rank, num_shards = 0, self.q_size, self.tp_rank, self.tp_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, shard_rank = self.kv_size, self.tp_rank // self.num_kv_head_replicas
            num_shards = self.tp_size // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        dim = getattr(param, "output_dim", None)
        if dim is None:
            _load_shared(param, loaded_weight)
            return
        shard = _packed_narrow(param, dim, offset, size)
        _copy_shard(shard, loaded_weight, dim, shard_rank, num_shards)


class RowParallelLinear(LinearBase):
    """Splits the input features: rank r holds columns [r * n, (r + 1) * n) of W, with
    n = input_size / tp_size, takes a sharded input and all-reduces the partial sums.
    The bias is replicated and added once (by rank 0, before the reduction)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        per_rank = divide(input_size, get_tp_size(), "input_size")
        super().__init__(per_rank, output_size, bias, None, (input_size, output_size), quant_config)
        self.input_size = input_size  # total over ranks
        self.output_size = output_size

    def weight_loader(
        self,
        param: nn.Parameter,  # this rank's part along param.input_dim (if it has one)
        loaded_weight: torch.Tensor,  # the full tensor
    ) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:  # bias, or groups every rank keeps: replicated
            default_weight_loader(param, loaded_weight)
        else:
            _copy_shard(param.data, loaded_weight, dim, self.tp_rank, self.tp_size)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size / tp_size] float
    ) -> torch.Tensor:  # [num_tokens, output_size] float
        bias = self.bias if self.tp_rank == 0 else None
        return tensor_model_parallel_all_reduce(self.quant_method.apply(self, x, bias))
