"""The model architectures (`llama`, `qwen2`, `qwen3`, `gpt2`) as plain `nn.Module`s with
`forward(input_ids, positions, attn_metadata)`, the transformers backend that runs any other
causal LM on transformers' code (`transformers_backend`), the lazy architecture registry
(`registry`, torch-free) and the safetensors weight loader (`loader`).

Import rule: models imports layers, attention, distributed and the leaf modules; never worker,
executor or engine (the engine imports only `models.registry`, to check an architecture;
entrypoints import nothing of models).
"""
