"""Engine configuration: small frozen dataclasses, one per domain, validated on creation."""

from dataclasses import dataclass
from typing import Any

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_EXECUTOR_BACKENDS = (None, "uni", "mp", "ray")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to run and how.

    model: local folder with config.json and *.safetensors (Hugging Face layout).
    tokenizer: folder of the tokenizer; defaults to `model`.
    skip_tokenizer_init: load no tokenizer (token-id prompts only, no output text).
    dtype: "auto" (the checkpoint's dtype; float32 on CPU for half-precision checkpoints),
        "float32", "float16" or "bfloat16".
    max_model_len: longest prompt + output in tokens; defaults to the model's context length.
    load_format: "auto"/"safetensors" reads the weights, "dummy" fills random weights.
    hf_config: the loaded `transformers.PretrainedConfig` (derived, not a user field).
    max_logprobs: most logprobs / prompt_logprobs a request may ask for (-1: the vocabulary).
    """

    model: str
    tokenizer: str
    skip_tokenizer_init: bool
    dtype: str
    max_model_len: int
    load_format: str
    seed: int
    hf_config: Any
    eos_token_ids: tuple[int, ...]
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or >= 0, got {self.max_logprobs}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """KV cache layout and sizing.

    block_size: token slots per block (a power of two; 16 by default as in vLLM).
    kv_cache_memory_bytes: bytes given to K/V blocks; None = size automatically (GPU: after a
        profiling pass, `gpu_memory_utilization` of the card; CPU: a fraction of free RAM).
    num_gpu_blocks_override: exact number of blocks, overriding the sizing above.
    enable_prefix_caching: reuse full blocks whose chained hash matches (on by default).
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ValueError(
                f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step limits of continuous batching.

    max_num_seqs: most requests running at once.
    max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
    enable_chunked_prefill: split prompts longer than the remaining budget over several steps.
    async_scheduling: schedule step N+1 while the device runs step N (vLLM's
        `--async-scheduling`); a decode's input token is then the one step N samples, taken on
        the device. None = on for CUDA devices (off on the CPU, where nothing overlaps).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How the model is spread over devices (tensor parallelism).

    tensor_parallel_size: ranks that each hold a 1/tp_size shard of every layer.
    distributed_executor_backend: where the ranks run: "uni" (in the engine's process; one
        rank only), "mp" (one worker process per rank on this host) or "ray" (one Ray actor
        per rank, anywhere on a Ray cluster). None = "uni" for one rank, else "mp".
    distributed_timeout_s: how long a collective, or the engine waiting for a worker's reply
        to a step, may take before the workers are declared dead (EngineDeadError).
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size <= 0:
            raise ValueError(
                f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}"
            )
        if self.distributed_executor_backend not in _EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {_EXECUTOR_BACKENDS[1:]} or "
                f"None, got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank, but tensor_parallel_size is "
                f"{self.tensor_parallel_size}; use 'mp' or 'ray'"
            )
        if self.distributed_timeout_s <= 0:
            raise ValueError(
                f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}"
            )

    @property
    def executor_backend(self) -> str:
        """The backend in use: the one given, else "uni" for one rank and "mp" for more."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Where the model runs: "cpu", "cuda" or "cuda:N"; "auto" picks CUDA when available.

    attention_backend: "auto", "torch" or "triton". enforce_eager: never use CUDA graphs.
    """

    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """All of the above, as one object handed to the engine's parts."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
