"""Tensor parallelism's process group: `parallel_state` (init_distributed, tp_rank, tp_size,
set once per process) and `comm` (tensor_model_parallel_all_reduce, _all_gather, _broadcast).

Import rule: torch and the leaf modules only.
"""
