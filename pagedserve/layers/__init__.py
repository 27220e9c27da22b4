"""The model building blocks: tensor-parallel linear layers and embeddings (Megatron names),
norms, rotary embeddings, activations, and `Attention` (a layer's view of the paged KV cache,
calling the attention backend); `kernels/` has the small fused Triton ops.

Import rule: layers imports attention, distributed and the leaf modules; never models, worker
or engine.
"""
