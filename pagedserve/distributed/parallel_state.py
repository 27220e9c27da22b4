"""Tensor- and pipeline-parallel rank and size of this process, set once at startup (1
process = rank 0 of both).

A worker process joins the process groups with `init_distributed`; the layers read
`get_tp_rank()`/`get_tp_size()` and the models `get_pp_rank()`/`get_pp_size()` when they are
built. The world is pipeline_parallel_size x tensor_parallel_size ranks, numbered as vLLM does:

    rank = pp_rank * tp_size + tp_rank        e.g. pp 2 x tp 2:  stage 0: ranks 0 1
                                                                 stage 1: ranks 2 3

The collectives in `comm` run over this stage's tensor-parallel group (`get_tp_group`: the
default group when pp_size is 1); a stage sends its hidden states to the same tp_rank of the
next stage (`comm.pipeline_send` / `pipeline_recv`, global ranks over the default group). The
engine's own process never joins a group: with several ranks every rank, rank 0 included, is
a worker process (see `executor/`).
"""

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(slots=True)
class _ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    # Expert parallelism (`--enable-expert-parallel`): the MoE layers place whole experts on
    # the tensor-parallel ranks instead of splitting every expert across them.
    expert_parallel: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    # The decoder layers per stage, "3,5" (`pp_layers.pp_partition`); None: the even split.
    pp_layer_partition: str | None = None
    # This stage's tensor-parallel ranks; None: the default group (pp_size 1, or no group).
    tp_group: ProcessGroup | None = None


_STATE = _ParallelState()


def set_tensor_parallel_state(tp_rank: int, tp_size: int, expert_parallel: bool = False) -> None:
    """Record this process's tensor-parallel rank and whether the MoE layers use expert
    parallelism over the same ranks; called once by the worker at startup."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    _STATE.tp_rank, _STATE.tp_size = tp_rank, tp_size
    _STATE.expert_parallel = expert_parallel


def set_pipeline_parallel_state(
    pp_rank: int, pp_size: int, layer_partition: str | None = None
) -> None:
    """Record this process's pipeline stage (0 .. pp_size - 1) and the split of the decoder
    layers over the stages (`ParallelConfig.pp_layer_partition`; None: even); called once by
    the worker at startup (and by tests building one stage's model in-process)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} out of range for pp_size {pp_size}")
    _STATE.pp_rank, _STATE.pp_size = pp_rank, pp_size
    _STATE.pp_layer_partition = layer_partition


def get_pp_layer_partition() -> str | None:
    """The split of the decoder layers over the stages ("3,5"), None for the even split."""
    return _STATE.pp_layer_partition


def get_pp_rank() -> int:
    """This process's pipeline stage (0: owns the embeddings; pp_size - 1: the final norm,
    the LM head and sampling)."""
    return _STATE.pp_rank


def get_pp_size() -> int:
    return _STATE.pp_size


def is_first_pp_rank() -> bool:
    return _STATE.pp_rank == 0


def is_last_pp_rank() -> bool:
    return _STATE.pp_rank == _STATE.pp_size - 1


def get_tp_group() -> ProcessGroup | None:
    """This stage's tensor-parallel process group (None: the default group)."""
    return _STATE.tp_group


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def get_expert_parallel() -> bool:
    """Whether MoE layers hold whole experts per rank (expert parallelism) rather than a
    1/tp_size slice of every expert; the expert-parallel ranks are the tensor-parallel ones."""
    return _STATE.expert_parallel


def init_distributed(
    rank: int,
    tp_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float,
    expert_parallel: bool = False,
    pp_size: int = 1,
    pp_layer_partition: str | None = None,
) -> None:
    """Join the world of pp_size x tp_size ranks (the default process group) as global
    `rank` (= pp_rank * tp_size + tp_rank), and this stage's tensor-parallel group.

    init_method: "tcp://HOST:PORT" of rank 0's rendezvous store.
    device: this rank's device; NCCL on a GPU, gloo on the CPU.
    timeout_s: how long the rendezvous and every collective may wait for the other ranks
        before raising (gloo) or aborting the process (NCCL's watchdog): a dead or stuck
        peer never hangs this rank forever.
    expert_parallel: MoE layers place whole experts on the ranks (`get_expert_parallel`).
    pp_size: pipeline stages; every stage has tp_size ranks.
    pp_layer_partition: the decoder layers per stage, "3,5" (None: the even split).
    Raises ValueError for a rank outside the world.
    """
    world_size = tp_size * pp_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for a world of {world_size} ranks")
    set_tensor_parallel_state(rank % tp_size, tp_size, expert_parallel)
    set_pipeline_parallel_state(rank // tp_size, pp_size, pp_layer_partition)
    if world_size == 1:
        return  # no collectives: comm's functions are the identity
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    if pp_size > 1 and tp_size > 1:
        # Every rank creates every stage's group, in the same order (new_group's contract).
        for stage in range(pp_size):
            ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if stage == rank // tp_size:
                _STATE.tp_group = group
    # One all-reduce now: NCCL builds its communicator lazily, on the first collective, which
    # must not be inside a CUDA graph capture; and a broken link fails at startup, not mid-step.
    dist.all_reduce(torch.ones(1, device=device))
    if _STATE.tp_group is not None:
        dist.all_reduce(torch.ones(1, device=device), group=_STATE.tp_group)


def destroy_distributed() -> None:
    """Leave the process group, if this process joined one, and reset to a single rank."""
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tensor_parallel_state(0, 1)
    set_pipeline_parallel_state(0, 1)
    _STATE.tp_group = None


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
