"""Tensor and pipeline parallelism's process groups: `parallel_state` (init_distributed, the
tp/pp ranks and sizes, set once per process), `comm` (the tensor-parallel collectives, the
pipeline's send/recv between stages, the sampled tokens' broadcast) and `pp_layers` (which
decoder layers each stage holds; torch-free, for the engine's config checks).

Import rule: torch and the leaf modules only.
"""
