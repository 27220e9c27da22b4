"""Tensor-parallel rank and size of this process, set once at startup (1 process = rank 0)."""

from dataclasses import dataclass


@dataclass(slots=True)
class _ParallelState:
    tp_rank: int = 0
    tp_size: int = 1


_STATE = _ParallelState()


def set_tensor_parallel_state(tp_rank: int, tp_size: int) -> None:
    """Record this process's tensor-parallel rank; called once by the worker at startup."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    _STATE.tp_rank, _STATE.tp_size = tp_rank, tp_size


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size
