"""Paged attention: `AttentionMetadata` (one step's query_start_loc, seq_lens, block_tables,
slot_mapping), the `AttentionBackend` protocol and its backends (`torch_backend`, the CPU
reference and ground truth; `triton_backend`, the GPU default, with its kernels in `kernels/`).

Import rule: attention imports torch, triton and the leaf modules only; never layers, models,
worker or engine (the `Attention` layer in `layers/attention.py` calls a backend).
"""
