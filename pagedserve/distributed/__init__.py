"""Tensor and pipeline parallelism's process groups: `parallel_state` (init_distributed, the
tp/pp ranks and sizes, set once per process), `comm` (the tensor-parallel collectives, the
pipeline's send/recv between stages, the sampled tokens' broadcast). Which decoder layers
each stage holds is `pagedserve.pp_layers` (torch-free, for the engine's config checks, which
the API server's process runs too).

Import rule: torch and the leaf modules only.
"""
