"""Collectives over the tensor-parallel group; each is the identity when tp_size == 1."""

import torch
import torch.distributed as dist

from pagedserve.distributed.parallel_state import get_tp_size


def tensor_model_parallel_all_reduce(
    x: torch.Tensor,  # any shape, any dtype; the same shape on every rank
) -> torch.Tensor:  # same shape and dtype as x: the sum over ranks
    """Sum `x` over the tensor-parallel ranks (in place when tp_size > 1)."""
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(
    x: torch.Tensor,  # [..., n, ...] this rank's shard along `dim`
    dim: int = -1,
) -> torch.Tensor:  # [..., tp_size * n, ...] shards concatenated in rank order
    """Concatenate every rank's shard of `x` along `dim`."""
    tp_size = get_tp_size()
    if tp_size == 1:
        return x
    x = x.contiguous()
    shards = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(shards, x)
    return torch.cat(shards, dim=dim)


def tensor_model_parallel_broadcast(
    x: torch.Tensor,  # any shape and dtype; the same shape on every rank
    src: int = 0,
) -> torch.Tensor:  # x, overwritten with rank `src`'s values
    """Give every rank rank `src`'s `x` (in place)."""
    if get_tp_size() == 1:
        return x
    dist.broadcast(x, src)
    return x
