"""Tensor-parallel rank and size of this process, set once at startup (1 process = rank 0).

A worker process joins the tensor-parallel group with `init_distributed`; the layers read
`get_tp_rank()`/`get_tp_size()` when they are built, and the collectives in `comm` use the
default process group. The engine's own process never joins a group: with tensor
parallelism every rank, rank 0 included, is a worker process (see `executor/`).
"""

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(slots=True)
class _ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    # Expert parallelism (`--enable-expert-parallel`): the MoE layers place whole experts on
    # the tensor-parallel ranks instead of splitting every expert across them.
    expert_parallel: bool = False


_STATE = _ParallelState()


def set_tensor_parallel_state(tp_rank: int, tp_size: int, expert_parallel: bool = False) -> None:
    """Record this process's tensor-parallel rank and whether the MoE layers use expert
    parallelism over the same ranks; called once by the worker at startup."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    _STATE.tp_rank, _STATE.tp_size = tp_rank, tp_size
    _STATE.expert_parallel = expert_parallel


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def get_expert_parallel() -> bool:
    """Whether MoE layers hold whole experts per rank (expert parallelism) rather than a
    1/tp_size slice of every expert; the expert-parallel ranks are the tensor-parallel ones."""
    return _STATE.expert_parallel


def init_distributed(
    tp_rank: int,
    tp_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float,
    expert_parallel: bool = False,
) -> None:
    """Join the tensor-parallel group (the default process group) as `tp_rank`.

    init_method: "tcp://HOST:PORT" of rank 0's rendezvous store.
    device: this rank's device; NCCL on a GPU, gloo on the CPU.
    timeout_s: how long the rendezvous and every collective may wait for the other ranks
        before raising (gloo) or aborting the process (NCCL's watchdog): a dead or stuck
        peer never hangs this rank forever.
    expert_parallel: MoE layers place whole experts on the ranks (`get_expert_parallel`).
    """
    set_tensor_parallel_state(tp_rank, tp_size, expert_parallel)
    if tp_size == 1:
        return  # no collectives: comm's functions are the identity
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=tp_rank,
        world_size=tp_size,
        timeout=timedelta(seconds=timeout_s),
    )
    # One all-reduce now: NCCL builds its communicator lazily, on the first collective, which
    # must not be inside a CUDA graph capture; and a broken link fails at startup, not mid-step.
    dist.all_reduce(torch.ones(1, device=device))


def destroy_distributed() -> None:
    """Leave the process group, if this process joined one, and reset to a single rank."""
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tensor_parallel_state(0, 1)


def get_ip() -> str:
    """An address of this host that other nodes can reach (the one of the default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            ip: str = s.getsockname()[0]
            return ip
        except OSError:
            return "127.0.0.1"


def get_open_port() -> int:
    """A TCP port that is free now (the OS picks it); rank 0 binds it right after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port
