"""Collectives over this stage's tensor-parallel group (each the identity when tp_size == 1)
and the pipeline's point-to-point transfers between stages."""

import torch
import torch.distributed as dist

from pagedserve.distributed.parallel_state import (
    get_pp_rank,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
)


def tensor_model_parallel_all_reduce(
    x: torch.Tensor,  # any shape, any dtype; the same shape on every rank
) -> torch.Tensor:  # same shape and dtype as x: the sum over ranks
    """Sum `x` over the tensor-parallel ranks (in place when tp_size > 1)."""
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x, group=get_tp_group())
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
    dist.all_gather(shards, x, group=get_tp_group())
    return torch.cat(shards, dim=dim)


def tensor_model_parallel_broadcast(
    x: torch.Tensor,  # any shape and dtype; the same shape on every rank
    src: int = 0,
) -> torch.Tensor:  # x, overwritten with tensor-parallel rank `src`'s values
    """Give every rank of this stage this stage's tp rank `src`'s `x` (in place)."""
    tp_size = get_tp_size()
    if tp_size == 1:
        return x
    dist.broadcast(x, get_pp_rank() * tp_size + src, group=get_tp_group())
    return x


def pipeline_send(
    tensors: list[torch.Tensor],  # e.g. [hidden_states, residual], each [num_tokens, hidden]
) -> None:
    """Send `tensors`, in order, to the same tensor-parallel rank of the next stage (vLLM's
    `get_pp_group().send_tensor_dict`, with shapes that the receiver knows already)."""
    dst = (get_pp_rank() + 1) * get_tp_size() + get_tp_rank()
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst)


def pipeline_recv(
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:  # one tensor per shape, in `pipeline_send`'s order
    """Receive what the same tensor-parallel rank of the previous stage `pipeline_send`s."""
    src = (get_pp_rank() - 1) * get_tp_size() + get_tp_rank()
    received = []
    for shape in shapes:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src)
        received.append(tensor)
    return received
