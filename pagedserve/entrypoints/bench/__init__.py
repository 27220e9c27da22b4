"""`pagedserve bench {throughput,latency,serve}` (vLLM's `vllm bench`): workloads, runs, metrics."""
