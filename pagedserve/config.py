"""Engine configuration: small frozen dataclasses, one per domain, validated on creation.

Each user-facing engine option is a field declared with `option(...)` (config_options.py):
its default, its help text and its validation (the class's `__post_init__`) live on that field
and nowhere else. `EngineArgs` (engine/arg_utils.py), the CLI flags and the README's option
table are generated from these fields. `ModelConfig`, the model's constants and the readers of
its Hugging Face config are in model_config.py (`ModelConfig` and `DEFAULT_MODEL` are
re-exported here); the checks that span domains are in `config_checks.py`. Import rule: a
leaf; imports from pagedserve only the torch-free leaves `pagedserve.config_options`,
`pagedserve.model_config`, `pagedserve.config_checks` and `pagedserve.envs` (torch only
lazily, to check a CUDA device).
"""

import dataclasses
import re
from dataclasses import dataclass

from pagedserve import envs
from pagedserve.config_checks import (
    check_cpu_kv_memory,
    check_experts_split,
    check_gpu_count,
    check_pipeline_parallel,
    check_tensor_parallel_size,
)
from pagedserve.config_options import option
from pagedserve.model_config import DEFAULT_MODEL as DEFAULT_MODEL
from pagedserve.model_config import ModelConfig as ModelConfig

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# vLLM's `--kv-cache-dtype` values that we support: "fp8" and "fp8_e4m3" are e4m3 (float8_e4m3fn).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's `--scheduling-policy` values (see request_queue.py).
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM v0's `--preemption-mode` values (see scheduler.py).
PREEMPTION_MODES = ("recompute", "swap")
# vLLM's `--structured-outputs-config.backend` values that we have (issue 17).
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
# vLLM's `--reasoning-parser` names that we have; pagedserve.reasoning registers each.
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """KV cache layout and sizing."""

    block_size: int = option(16, help="tokens per KV cache block (a power of two)")
    gpu_memory_utilization: float = option(
        0.9,
        help="fraction of GPU memory for weights, activations and KV cache (when "
        "kv_cache_memory_bytes is not given)",
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        help="bytes of KV cache, overriding the automatic sizing (GPU: after a profiling pass, "
        "gpu_memory_utilization of the card; CPU: a fraction of free RAM)",
    )
    num_gpu_blocks_override: int | None = option(
        None,
        help="exact number of KV cache blocks, overriding kv_cache_memory_bytes and "
        "gpu_memory_utilization",
    )
    enable_prefix_caching: bool = option(
        True,
        help="reuse KV blocks of shared prompt prefixes (full blocks whose chained hash matches)",
    )
    kv_cache_dtype: str = option(
        "auto",
        help="dtype of the KV cache: auto (the model's dtype), or fp8 / fp8_e4m3 (float8 e4m3) "
        "or fp8_e5m2, which store K / k_scale and V / v_scale per layer (scales from the "
        "checkpoint, else 1.0) in half the memory of 16-bit",
        cli={"choices": KV_CACHE_DTYPES},
    )
    cpu_offload_gb: float = option(
        0.0,
        help="GiB of weights (per device) kept in pinned CPU memory and copied to the device "
        "layer by layer during each forward, so that a model larger than the device runs; "
        "whole layers of the layer stacks, first layers first; turns off CUDA graphs",
    )
    swap_space: float = option(
        4.0,
        help="GiB of CPU memory per GPU for the KV blocks of requests preempted with "
        "preemption_mode swap (taken only then)",
    )
    kv_offload_gb: float = option(
        0.0,
        help="GiB of CPU memory per GPU for a CPU tier of the prefix cache: cached blocks that "
        "the GPU cache evicts are kept there (least recently used out first) and copied back "
        "on a prefix hit; 0 = off",
    )

    def __post_init__(self) -> None:
        for name in ("cpu_offload_gb", "swap_space", "kv_offload_gb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 GiB, got {getattr(self, name)}")
        if self.kv_offload_gb > 0 and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gb (a CPU tier of the prefix cache) needs "
                             "enable_prefix_caching")  # fmt: skip
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
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ValueError(
                f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step limits of continuous batching."""

    max_num_seqs: int = option(256, help="most requests running at once")
    max_num_batched_tokens: int = option(
        help="token budget of one engine step (prefill chunks + decodes)",
        default_text="8192; 16384 for the offline LLM class on GPUs with >= 70 GiB other than "
        "the A100, as vLLM; at least max_num_seqs",
    )
    enable_chunked_prefill: bool = option(
        True, help="split prompts longer than the remaining budget over several steps"
    )
    async_scheduling: bool | None = option(
        None,
        help="schedule the next step while the device runs this one (a decode's input token is "
        "then the one the step before samples, taken on the device)",
        default_text="on for CUDA devices",
    )
    scheduling_policy: str = option(
        "fcfs",
        help="order of the waiting requests: fcfs (arrival) or priority (a request's priority, "
        "lower first, then arrival; when blocks run out the worst running request is "
        "preempted first)",
        cli={"choices": SCHEDULING_POLICIES},
    )
    preemption_mode: str = option(
        "recompute",
        help="what preempting a running request does when KV blocks run out: recompute (free "
        "its blocks; its tokens are computed again when it resumes) or swap (copy its blocks "
        "to swap_space GiB of CPU memory and back when it resumes; recompute when that is full)",
        cli={"choices": PREEMPTION_MODES},
    )

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How the model is spread over devices: tensor parallelism, pipeline parallelism (the
    decoder layers split over stages, each stage tensor-parallel; pipeline_parallel_size x
    tensor_parallel_size ranks in all), and expert parallelism for the experts of
    mixture-of-experts layers."""

    tensor_parallel_size: int = option(
        1,
        help="number of tensor-parallel ranks (each holds a 1/size shard of every layer)",
        cli={"aliases": ["-tp"]},
    )
    pipeline_parallel_size: int = option(
        1,
        help="number of pipeline stages (each holds a contiguous slice of the decoder layers; "
        "PAGEDSERVE_PP_LAYER_PARTITION='3,5' sets an uneven split)",
        cli={"aliases": ["-pp"]},
    )
    data_parallel_size: int = option(
        1,
        help="number of engine cores behind one API server, each with its own "
        "pipeline_parallel_size x tensor_parallel_size ranks (on GPUs, core i takes the "
        "next pp*tp GPUs); each "
        "request runs on the least loaded core (the server's and the offline LLM's)",
        cli={"aliases": ["-dp"]},
    )
    distributed_executor_backend: str | None = option(
        None,
        help="where the ranks run: uni (in the engine's process; one rank only), mp (a worker "
        "process per rank on this host) or ray (a Ray actor per rank, on a Ray cluster)",
        default_text="uni for one rank, else mp",
    )
    distributed_timeout_s: float = option(
        300.0,
        help="seconds a collective or a worker's reply may take before the workers are "
        "declared dead",
    )
    enable_expert_parallel: bool = option(
        False,
        help="mixture-of-experts layers put whole experts on the tensor-parallel ranks "
        "(num_experts / tensor_parallel_size each) instead of a slice of every expert",
    )
    # Not an option: PAGEDSERVE_PP_LAYER_PARTITION as the engine's process read it when this
    # config was made. The workers split the layers by this (their own environment may be
    # older: a forkserver's, or another node's).
    pp_layer_partition: str | None = dataclasses.field(default_factory=envs.pp_layer_partition)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.data_parallel_size < 1:
            raise ValueError(
                f"data_parallel_size must be at least 1, got {self.data_parallel_size}"
            )
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS} or None, "
                f"got {backend!r}"
            )
        if backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank, but tensor_parallel_size "
                f"({self.tensor_parallel_size}) x pipeline_parallel_size "
                f"({self.pipeline_parallel_size}) is {self.world_size}; use 'mp' or 'ray'"
            )
        if self.distributed_timeout_s <= 0:
            raise ValueError(
                f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}"
            )

    @property
    def world_size(self) -> int:
        """All the ranks: pipeline_parallel_size x tensor_parallel_size."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend in use: the one given, else "uni" for one rank and "mp" for more."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Where and how the model runs."""

    device: str = option("auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    attention_backend: str = option("auto", help="auto, torch or triton")
    enforce_eager: bool = option(False, help="never use CUDA graphs")

    def __post_init__(self) -> None:
        _check_device(self.device)


def _check_device(device: str) -> None:
    """One of auto, cpu (or cpu:N), cuda or cuda:N, and CUDA only where torch has it.
    Raises ValueError."""
    if device in ("auto", "cpu") or re.fullmatch(r"cpu:\d+", device):
        return
    if device != "cuda" and not re.fullmatch(r"cuda:\d+", device):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} asked for, but torch sees no CUDA GPU "
            f"(torch {torch.__version__}; torch.cuda.is_available() is False)"
        )
    if cuda_index(device) >= torch.cuda.device_count():
        raise ValueError(
            f"device {device!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)"
        )


def cuda_index(device: str) -> int:
    """N of "cuda:N"; 0 for "cuda" and "auto"."""
    return int(device.partition(":")[2] or 0)


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """Constrained decoding (vLLM's StructuredOutputsConfig) and the reasoning parser, whose
    end-of-thinking marker is where a constrained answer starts."""

    structured_outputs_backend: str = option(
        "auto",
        help="grammar engine of structured outputs (response_format, structured_outputs, "
        "guided_*): auto or xgrammar",
        cli={"choices": STRUCTURED_OUTPUTS_BACKENDS},
    )
    reasoning_parser: str | None = option(
        None,
        help="splits the model's thinking text from its answer (the message's "
        "reasoning field); a constrained answer starts after the thinking ends",
        default_text="none",
        cli={"choices": REASONING_PARSERS},
    )

    disable_any_whitespace: bool = option(
        False,
        help="JSON outputs (response_format, json schemas) without optional whitespace, for "
        "every request (vLLM's structured_outputs_config.disable_any_whitespace); a weak "
        "model may otherwise emit whitespace until max_tokens",
    )

    def __post_init__(self) -> None:
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, got "
                f"{self.structured_outputs_backend!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                f"{self.reasoning_parser!r}"
            )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """All of the above, as one object handed to the engine's parts; checks the options that
    depend on each other or on the model."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()

    def cpu_block_counts(self, block_bytes: int) -> tuple[int, int]:
        """(swap space blocks, CPU-tier blocks) of one rank whose KV block takes `block_bytes`
        bytes: `swap_space` GiB (only with preemption_mode "swap": otherwise nothing is
        swapped, and the 4 GiB default is not taken) and `kv_offload_gb` GiB. The engine and
        every worker compute the same numbers from the same config."""
        cache = self.cache_config
        swap_gib = cache.swap_space if self.scheduler_config.preemption_mode == "swap" else 0.0
        return int(swap_gib * 2**30) // block_bytes, int(cache.kv_offload_gb * 2**30) // block_bytes

    def __post_init__(self) -> None:
        device = self.device_config.device
        dp_size = self.parallel_config.data_parallel_size
        if dp_size > 1 and re.fullmatch(r"cuda:\d+", device):
            raise ValueError(
                f"device {device!r} names one GPU, but data_parallel_size is {dp_size}: each "
                f"engine core needs its own GPUs; use device='cuda' and choose the GPUs with "
                f"CUDA_VISIBLE_DEVICES"
            )
        check_tensor_parallel_size(
            self.model_config.hf_text_config, self.parallel_config.tensor_parallel_size
        )
        check_experts_split(
            self.model_config.hf_text_config,
            self.parallel_config.tensor_parallel_size,
            self.parallel_config.enable_expert_parallel,
        )
        check_pipeline_parallel(self.model_config.hf_text_config, self.parallel_config)
        check_gpu_count(self.device_config.device, self.parallel_config)
        check_cpu_kv_memory(
            self.cache_config,
            self.scheduler_config.preemption_mode,
            self.parallel_config.world_size * dp_size,  # every core's pp x tp ranks
        )
        budget = self.scheduler_config.max_num_batched_tokens
        max_model_len = self.model_config.max_model_len
        if not self.scheduler_config.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than "
                f"max_model_len ({max_model_len}); enable chunked prefill or raise the budget"
            )
