"""Engine configuration: small frozen dataclasses, one per domain, validated on creation.

Each user-facing engine option is a field declared here with `option(...)`: its default, its
help text and its validation (the class's `__post_init__`) live on that field and nowhere else.
`EngineArgs` (engine/arg_utils.py), the CLI flags and the README's option table are generated
from these fields. Import rule: a leaf; imports nothing from pagedserve (torch only lazily, to
check a CUDA device), and the torch-free leaves `pagedserve.quant_config` and
`pagedserve.pp_layers` (and `pagedserve.envs`); the checks that span domains are in
`config_checks.py`.
"""

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from pagedserve import envs
from pagedserve.config_checks import (
    check_cpu_kv_memory,
    check_experts_split,
    check_gpu_count,
    check_pipeline_parallel,
    check_tensor_parallel_size,
)
from pagedserve.quant_config import QUANTIZATION_METHODS

DEFAULT_MODEL = str(files("pagedserve.assets") / "stories260k")
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# vLLM's `--model-impl` values; "pagedserve" is our native code (vLLM calls its own "vllm",
# accepted here as the same).
MODEL_IMPLS = ("auto", "pagedserve", "vllm", "transformers")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# vLLM's `--kv-cache-dtype` values that we support: "fp8" and "fp8_e4m3" are e4m3 (float8_e4m3fn).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's `--scheduling-policy` values (see request_queue.py).
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM v0's `--preemption-mode` values (see scheduler.py).
PREEMPTION_MODES = ("recompute", "swap")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's; also InputProcessor's default
# vLLM's `--structured-outputs-config.backend` values that we have (issue 17).
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
# vLLM's `--reasoning-parser` names that we have; pagedserve.reasoning registers each.
REASONING_PARSERS = ("deepseek_r1", "qwen3")


DEFAULT_MM_LIMIT = 999  # items per modality and prompt, vLLM V1's limit_mm_per_prompt default


def json_object(text: str) -> dict[str, Any]:
    """argparse type of a JSON object flag (`--hf-overrides '{"key": 1}'`)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text!r}")
    return value


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_text: str | None = None,
    cli: dict[str, Any] | None = None,
) -> Any:
    """A dataclass field that is a user-facing option (vLLM's name), with its one default.

    help: what the option does, shown by `--help` and in the README's option table.
    default_text: what the default means, where its value alone does not say it (shown as
        "(default: TEXT)" instead of the value).
    cli: extra `argparse.add_argument` keywords (type, nargs, choices, action) where the
        field's annotation does not give them.
    Without `default`, the config holds a value derived when it is created (e.g. from the
    model's config.json); the option then defaults to None ("derive it"), the field is
    keyword-only, and `default_text` (required) says how it is derived.
    Returns a `dataclasses.field`; raises ValueError when `default_text` is missing there.
    """
    if default is dataclasses.MISSING and not default_text:
        raise ValueError("an option without a default needs default_text saying how it is derived")
    metadata = {"help": help, "default_text": default_text, "cli": cli or {}}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata, kw_only=True)
    return dataclasses.field(default=default, metadata=metadata)


def is_option(f: dataclasses.Field[Any]) -> bool:
    """Whether a dataclass field was declared with `option(...)`."""
    return "help" in f.metadata


def option_default(f: dataclasses.Field[Any]) -> Any:
    """The default of an option as the user sees it: the field's, or None where it is derived."""
    return None if f.default is dataclasses.MISSING else f.default


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Which model to run and how. `model` and `tokenizer` hold local folders (a Hub id is
    resolved to its folder in the Hugging Face cache when the config is built; `model_name`
    keeps the name the user gave). `hf_config` (the loaded `transformers.PretrainedConfig`,
    with `hf_overrides`), `eos_token_ids` and `diff_sampling_param` (the sampling defaults of
    the generation config) are read from the model folder, not options."""

    model: str = option(
        DEFAULT_MODEL,
        help="Hugging Face model: a local folder, or a Hub id (ORG/NAME) downloaded to the "
        "Hugging Face cache",
        default_text="the bundled stories260k",
    )
    tokenizer: str = option(
        help="tokenizer: a local folder or a Hub id", default_text="the model's"
    )
    skip_tokenizer_init: bool = option(
        False, help="load no tokenizer: prompts must be token ids, outputs have no text"
    )
    dtype: str = option(
        "auto",
        help="auto (the checkpoint's dtype; float32 on CPU for half-precision checkpoints), "
        "float32, float16 or bfloat16",
    )
    seed: int = option(0, help="random seed of the engine")
    max_model_len: int = option(
        help="longest prompt + output in tokens", default_text="the model's context"
    )
    max_logprobs: int = option(
        DEFAULT_MAX_LOGPROBS,
        help="most logprobs or prompt_logprobs a request may ask for (-1: no cap)",
    )
    load_format: str = option(
        "auto", help="auto/safetensors (read weights) or dummy (random weights)"
    )
    model_impl: str = option(
        "auto",
        help="which code runs the model: pagedserve (our native model of the architecture; "
        "vllm is the same), transformers (transformers' own modeling code of any "
        "AutoModelForCausalLM architecture, on our paged attention), or auto (native when we "
        "have it, else transformers)",
        cli={"choices": MODEL_IMPLS},
    )
    quantization: str | None = option(
        help="weight quantization: gptq, awq, fp8 or compressed-tensors as the checkpoint "
        "stores it; fp8 on an unquantized checkpoint quantizes its weights at load (online FP8)",
        default_text="config.json's quantization_config.quant_method; none if absent",
        cli={"choices": QUANTIZATION_METHODS},
    )
    # Where the model's files come from and how they are read (issue 16).
    revision: str | None = option(
        None,
        help="Hub revision (branch, tag or commit) of the model when --model is a Hub id",
        default_text="the repository's main branch",
    )
    tokenizer_revision: str | None = option(
        None,
        help="Hub revision of the tokenizer when --tokenizer is a Hub id",
        default_text="--revision",
    )
    download_dir: str | None = option(
        None,
        help="Hugging Face cache folder that Hub models are downloaded to and looked up in",
        default_text="$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub",
    )
    trust_remote_code: bool = option(
        False,
        help="let transformers run the Python code of the model folder (config.json's "
        "auto_map) for its config and tokenizer",
    )
    hf_overrides: dict[str, Any] | None = option(
        None,
        help="JSON object merged into the model's config.json after it is read (a nested "
        "object updates a nested config, such as text_config)",
        cli={"type": json_object, "metavar": "JSON"},
    )
    generation_config: str = option(
        "auto",
        help="defaults of the sampling parameters (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_tokens) that a request leaves out: auto (the model's "
        "generation_config.json), vllm (vLLM's neutral defaults) or a folder holding a "
        "generation_config.json",
    )
    # Images (vision-language models; issue 18), as vLLM's flags of these names.
    limit_mm_per_prompt: dict[str, int] | None = option(
        None,
        help='most multimodal items one prompt may hold, per modality, e.g. {"image": 4} '
        "(a prompt with more is refused)",
        default_text=f"{DEFAULT_MM_LIMIT} per modality, as vLLM V1",
        cli={"type": json_object, "metavar": "JSON"},
    )
    allowed_local_media_path: str = option(
        "",
        help="folder whose files chat messages may name as images (file:// URLs in image_url "
        "parts); empty: no local files",
        default_text="none: file:// URLs are refused",
    )
    hf_config: Any
    eos_token_ids: tuple[int, ...]
    # The model as the user named it (a Hub id or a folder); `model` is its local folder.
    model_name: str = ""
    # generation_config's sampling defaults (vLLM's get_diff_sampling_param); {} for "vllm".
    diff_sampling_param: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not -(2**63) <= self.seed < 2**64:  # torch.manual_seed's range
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or >= 0, got {self.max_logprobs}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}"
            )
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(
            self.generation_config
        ):
            raise ValueError(
                f"generation_config must be auto, vllm or a folder holding a "
                f"generation_config.json, got {self.generation_config!r} (no such folder)"
            )
        for modality, limit in (self.limit_mm_per_prompt or {}).items():
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(
                    f"limit_mm_per_prompt[{modality!r}] must be an int >= 0, got {limit!r}"
                )
        if self.allowed_local_media_path and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(
                f"allowed_local_media_path must be an existing folder, got "
                f"{self.allowed_local_media_path!r}"
            )
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        model_max_len = get_model_max_len(self.hf_config)
        if self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's context length "
                f"({model_max_len}, from config.json)"
            )

    @property
    def hf_text_config(self) -> Any:
        """The language model's config (vLLM's name): `text_config` of a multimodal config
        (LLaVA nests its Llama there), else `hf_config` itself. Read the text model's fields
        (vocab_size, layers, heads, context length) here, never on `hf_config`."""
        return get_hf_text_config(self.hf_config)

    def mm_limit(self, modality: str) -> int:
        """The most items of `modality` one prompt may hold (`limit_mm_per_prompt`)."""
        return (self.limit_mm_per_prompt or {}).get(modality, DEFAULT_MM_LIMIT)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling defaults the generation config sets (vLLM's name): a copy of
        `diff_sampling_param`, e.g. {"temperature": 0.6, "max_tokens": 512}."""
        return dict(self.diff_sampling_param)


def get_hf_text_config(hf_config: Any) -> Any:
    """The config of a model's language side: a multimodal config's `text_config` (e.g.
    LlavaConfig's LlamaConfig), else the config itself."""
    text_config = getattr(hf_config, "text_config", None)
    return hf_config if text_config is None else text_config


def get_model_max_len(hf_config: Any) -> int:
    """The model's context length from its (language model's) config
    (`max_position_embeddings` or `n_positions`)."""
    hf_config = get_hf_text_config(hf_config)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


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
