"""The engine: `EngineCore` (scheduler, KV cache manager and executor, stepping; `core.py`),
its process and client for the server (`core_proc.py`, `core_client.py`), `LLMEngine` and
`AsyncLLMEngine`, and the caller's side of a request: tokenizing and validation
(`input_processor`, `prompt_bound`), detokenizing, stop strings and logprob text
(`output_processor`, `detokenizer`, `stop_matcher`, `logprob_text`), beam search, and the
engine options (`arg_utils.EngineArgs`).

Import rule: engine imports scheduler, kv_cache, executor (through `executor.factory`),
messages, metrics, request, step, process_start, the leaf modules and `models.registry`; never
worker, models' code, layers, attention or entrypoints. The API server's process imports
engine but no model code.
"""
