"""pagedserve: high-throughput LLM inference with PagedAttention and vLLM's interfaces.

Import rule: the root facade imports leaf modules (outputs, sampling_params, version) at once
and `LLM` / `AsyncLLMEngine` lazily; it is the only module outside entrypoints that imports
entrypoints.
"""

from typing import Any

from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.version import __version__

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; import it lazily so that the torch-free parts
    # (kv_cache, scheduler) stay light to import.
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLMEngine":
        from pagedserve.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
