"""Linear layers sharded Megatron-style over the tensor-parallel group, with weight loaders."""

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.comm import tensor_model_parallel_all_reduce
from pagedserve.distributed.parallel_state import get_tp_rank, get_tp_size

# Copies this rank's part of a full checkpoint tensor into a parameter:
# weight_loader(param, loaded_weight) or weight_loader(param, loaded_weight, shard_id).
WeightLoader = Callable[..., None]


def set_weight_attrs(param: nn.Parameter, attrs: Mapping[str, Any]) -> None:
    """Attach loading metadata (e.g. `weight_loader`) to a parameter, as vLLM does."""
    for key, value in attrs.items():
        setattr(param, key, value)


def default_weight_loader(
    param: nn.Parameter,  # any shape and dtype
    loaded_weight: torch.Tensor,  # same shape as param, any dtype and device
) -> None:
    """Copy a replicated (unsharded) tensor, casting to the parameter's dtype and device."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"but the parameter expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


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


class LinearBase(nn.Module):
    """y = x W^T + b with W [output_size, input_size] as stored on this rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})

    def weight_loader(
        self,
        param: nn.Parameter,  # [output_size, input_size] or [output_size]
        loaded_weight: torch.Tensor,  # same shape as param
    ) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size] float
    ) -> torch.Tensor:  # [num_tokens, output_size] float
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """A linear layer whose full weight lives on every rank."""


class ColumnParallelLinear(LinearBase):
    """Splits the output features: rank r holds rows [r * n, (r + 1) * n) of W and of b,
    with n = output_size / tp_size. Its output stays sharded (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, get_tp_size(), "output_size"), bias)
        self.input_size = input_size
        self.output_size = output_size  # total over ranks

    def weight_loader(
        self,
        param: nn.Parameter,  # [output_size / tp_size, input_size] or [output_size / tp_size]
        loaded_weight: torch.Tensor,  # [output_size, input_size] or [output_size]
    ) -> None:
        _copy_shard(param.data, loaded_weight, 0, self.tp_rank, self.tp_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears fused into one matmul (e.g. gate_proj and up_proj).

    On each rank the weight is [sum(output_sizes) / tp_size, input_size], laid out
    [shard 0 of this rank | shard 1 of this rank | ...]; checkpoint tensors are loaded one at a
    time with `weight_loader(param, loaded_weight, shard_id)`, shard_id = index in output_sizes.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        for size in output_sizes:
            divide(size, self.tp_size, "each merged output size")

    def weight_loader(  # type: ignore[override]
        self,
        param: nn.Parameter,  # [sum(output_sizes) / tp_size, input_size] or [sum / tp_size]
        loaded_weight: torch.Tensor,  # [output_sizes[shard_id], input_size] or [output_sizes[i]]
        shard_id: int,
    ) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = param.data.narrow(0, offset, size)
        _copy_shard(shard, loaded_weight, 0, self.tp_rank, self.tp_size)


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
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(  # type: ignore[override]
        self,
        param: nn.Parameter,  # [q_size + 2 * kv_size, hidden_size] or [q_size + 2 * kv_size]
        loaded_weight: torch.Tensor,  # full q_proj/k_proj/v_proj weight or bias
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
        shard = param.data.narrow(0, offset, size)
        _copy_shard(shard, loaded_weight, 0, shard_rank, num_shards)


class RowParallelLinear(LinearBase):
    """Splits the input features: rank r holds columns [r * n, (r + 1) * n) of W, with
    n = input_size / tp_size, takes a sharded input and all-reduces the partial sums.
    The bias is replicated and added once (by rank 0, before the reduction)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, get_tp_size(), "input_size"), output_size, bias)
        self.input_size = input_size  # total over ranks
        self.output_size = output_size

    def weight_loader(
        self,
        param: nn.Parameter,  # [output_size, input_size / tp_size] or [output_size]
        loaded_weight: torch.Tensor,  # [output_size, input_size] or [output_size]
    ) -> None:
        if param.dim() == 1:  # bias: replicated
            default_weight_loader(param, loaded_weight)
        else:
            _copy_shard(param.data, loaded_weight, 1, self.tp_rank, self.tp_size)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size / tp_size] float
    ) -> torch.Tensor:  # [num_tokens, output_size] float
        bias = self.bias if self.tp_rank == 0 else None
        return tensor_model_parallel_all_reduce(F.linear(x, self.weight, bias))
