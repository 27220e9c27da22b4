"""The transformers backend (`--model-impl transformers`): any architecture that transformers'
`AutoModelForCausalLM` builds runs on transformers' own modeling code, with pagedserve's paged
attention plugged into transformers' attention-function registry (vLLM's
`TransformersForCausalLM` does the same).

- `support`: which configs it can run (torch-free at import; the registry asks it).
- `attention`: the attention function registered as `attn_implementation="pagedserve"` and the
  forward context that hands it the step's AttentionMetadata.
- `model`: `TransformersForCausalLM`, the wrapper with our model interface.
"""
