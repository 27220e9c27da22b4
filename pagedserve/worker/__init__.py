"""What runs on one tensor-parallel rank: `Worker` (device, process group, start-up calls),
`ModelRunner` (one step: state, inputs, forward, sampling), `runner_setup` (model loading, KV
cache sizing and allocation, CUDA graphs, warm-up), the sampler, the input batch and the CUDA
graph runner.

Import rule: worker imports models, layers, attention, distributed and the leaf modules
(`config`, `step`, `sampling_params`, ...); never `executor` or `engine`.
"""
