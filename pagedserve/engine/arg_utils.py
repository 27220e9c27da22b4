"""EngineArgs: the flat list of user-facing engine options (vLLM's names) -> EngineConfig."""

import json
import numbers
import os
import re
import typing
from dataclasses import dataclass, fields
from importlib.resources import files
from pathlib import Path
from typing import Any

from pagedserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedserve.errors import UnsupportedModelError

DEFAULT_MODEL = str(files("pagedserve.assets") / "stories260k")

# Who builds the engine (vLLM's UsageContext): the offline `LLM` class gets a larger default
# step token budget on big GPUs than the server, where a smaller one keeps decodes of running
# requests from waiting behind long prefill steps.
USAGE_CONTEXTS = ("engine_context", "llm_class", "openai_api_server")
_GiB = 1 << 30


def default_max_num_batched_tokens(usage_context: str, device: str) -> int:
    """vLLM's default `max_num_batched_tokens` (EngineArgs.get_batch_defaults): 16384 for the
    `LLM` class on a GPU with >= 70 GiB that is not an A100 (H100, H200, ...), else 8192.
    (vLLM's server on smaller GPUs defaults to 2048; ours keeps 8192 there.) Measured on an
    H200: Llama-3.1-8B 2,000 x 128/128 +3-4% output tok/s over 8192 (BENCHMARKS.md)."""
    if usage_context != "llm_class" or device.startswith("cpu"):
        return 8192
    import torch

    if not torch.cuda.is_available():
        return 8192
    props = torch.cuda.get_device_properties(_cuda_index(device))
    if props.total_memory >= 70 * _GiB and "a100" not in props.name.lower():
        return 16384
    return 8192


@dataclass(slots=True)
class EngineArgs:
    """Options of `LLM(...)`, `LLMEngine` and the CLI, named as vLLM's `EngineArgs`.

    See the config dataclasses in `pagedserve.config` for each field's meaning.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_logprobs: int = 20
    load_format: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    distributed_timeout_s: float = 300.0
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        # A path object names a folder as well as a string does.
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def create_engine_config(self, usage_context: str = "engine_context") -> EngineConfig:
        """Load the model's config.json and resolve defaults; `usage_context` (one of
        USAGE_CONTEXTS) picks the default step token budget as vLLM does.

        Raises UnsupportedModelError (a ValueError) when the folder or its config is missing,
        and ValueError when an option is out of range (naming the option and the limit).
        """
        if usage_context not in USAGE_CONTEXTS:
            raise ValueError(
                f"usage_context must be one of {USAGE_CONTEXTS}, got {usage_context!r}"
            )
        self._check_types()
        _check_device(self.device)
        if not -(2**63) <= self.seed < 2**64:  # torch.manual_seed's range
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        hf_config = load_hf_config(self.model)
        _check_tensor_parallel_size(hf_config, self.tensor_parallel_size)
        model_max_len = get_model_max_len(hf_config)
        max_model_len = model_max_len if self.max_model_len is None else self.max_model_len
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's context length "
                f"({model_max_len}, from config.json)"
            )
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(
                default_max_num_batched_tokens(usage_context, self.device), self.max_num_seqs
            )
        if not self.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than "
                f"max_model_len ({max_model_len}); enable chunked prefill or raise the budget"
            )
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer or self.model,
            skip_tokenizer_init=self.skip_tokenizer_init,
            dtype=self.dtype,
            max_model_len=max_model_len,
            load_format=self.load_format,
            seed=self.seed,
            hf_config=hf_config,
            eos_token_ids=read_eos_token_ids(self.model, hf_config),
            max_logprobs=self.max_logprobs,
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=self.async_scheduling,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                distributed_timeout_s=self.distributed_timeout_s,
            ),
            device_config=DeviceConfig(
                device=self.device,
                attention_backend=self.attention_backend,
                enforce_eager=self.enforce_eager,
            ),
        )

    def _check_types(self) -> None:
        """Every option has its annotated type, so that a wrong one fails now, naming the
        option, not deep inside the engine. Any integral number (numpy's too) is an int, any
        real number a float, and 0/1 a bool; they are normalised to Python's types. A bool is
        not an int here, nor a float an int. Raises ValueError."""
        for f in fields(self):
            value = getattr(self, f.name)
            allowed = typing.get_args(f.type) or (f.type,)
            if value is None and type(None) in allowed:
                continue
            normalised = _as_one_of(value, allowed)
            if normalised is _WRONG:
                names = " or ".join(
                    "None" if k is type(None) else getattr(k, "__name__", str(k)) for k in allowed
                )
                raise ValueError(f"{f.name} must be {names}, got {value!r}")
            setattr(self, f.name, normalised)


_WRONG = object()


def _as_one_of(value: Any, kinds: tuple[Any, ...]) -> Any:
    """`value` as the first of `kinds` (bool, int, float, str) it is, or _WRONG."""
    is_bool = isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's too
    for kind in kinds:
        if kind is bool:
            if is_bool:
                return bool(value)
            if isinstance(value, numbers.Integral) and value in (0, 1):
                return bool(value)
        elif kind is int and isinstance(value, numbers.Integral) and not is_bool:
            return int(value)
        elif kind is float and isinstance(value, numbers.Real) and not is_bool:
            return float(value)
        elif kind is str and isinstance(value, str):
            return value
    return _WRONG


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
    if _cuda_index(device) >= torch.cuda.device_count():
        raise ValueError(
            f"device {device!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)"
        )


def _cuda_index(device: str) -> int:
    """N of "cuda:N"; 0 for "cuda" and "auto"."""
    return int(device.partition(":")[2] or 0)


def _check_tensor_parallel_size(hf_config: Any, tp_size: int) -> None:
    """Tensor parallelism splits the attention heads (and the KV heads, or replicates them
    when there are fewer than ranks) evenly: check before any worker starts. Raises
    ValueError naming the counts."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp_size}")
    num_heads = getattr(hf_config, "num_attention_heads", None) or getattr(
        hf_config, "n_head", None
    )
    if not isinstance(num_heads, int) or tp_size == 1:
        return
    if num_heads % tp_size:
        raise ValueError(
            f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size "
            f"({tp_size})"
        )
    intermediate_size = getattr(hf_config, "intermediate_size", None)
    if isinstance(intermediate_size, int) and intermediate_size % tp_size:
        raise ValueError(
            f"intermediate_size ({intermediate_size}) is not divisible by tensor_parallel_size "
            f"({tp_size})"
        )
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({tp_size}): "
            f"one must divide the other"
        )


def load_hf_config(model: str) -> Any:
    """transformers' config of a local model folder; raises UnsupportedModelError if absent."""
    from transformers import AutoConfig

    from pagedserve.models.registry import SUPPORTED_ARCHITECTURES

    path = Path(model)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise UnsupportedModelError(
            f"model folder {model!r} {what}; pagedserve loads local Hugging Face folders "
            f"(config.json + *.safetensors) of these architectures: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return AutoConfig.from_pretrained(model, local_files_only=True)


def get_model_max_len(hf_config: Any) -> int:
    """The model's context length from its config (`max_position_embeddings` or `n_positions`)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def read_eos_token_ids(model: str, hf_config: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json and config.json (either may hold a list)."""
    ids: list[int] = []
    generation_config = os.path.join(model, "generation_config.json")
    sources: list[Any] = []
    if os.path.isfile(generation_config):
        with open(generation_config) as f:
            sources.append(json.load(f).get("eos_token_id"))
    sources.append(getattr(hf_config, "eos_token_id", None))
    for source in sources:
        for token_id in source if isinstance(source, list) else [source]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


_FLAG_HELP = {
    "model": "local Hugging Face model folder (default: the bundled stories260k)",
    "tokenizer": "tokenizer folder (default: the model folder)",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids, outputs have no text",
    "dtype": "auto, float32, float16 or bfloat16",
    "seed": "random seed of the engine",
    "max_model_len": "longest prompt + output in tokens (default: the model's context)",
    "max_logprobs": "most logprobs or prompt_logprobs a request may ask for (-1: no cap)",
    "load_format": "auto/safetensors (read weights) or dummy (random weights)",
    "block_size": "tokens per KV cache block (a power of two)",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "kv_cache_memory_bytes": "bytes of KV cache (overrides automatic sizing)",
    "num_gpu_blocks_override": "exact number of KV cache blocks",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one engine step (default: 8192; 16384 for the "
    "offline LLM class on GPUs with >= 70 GiB, as vLLM)",
    "enable_chunked_prefill": "split long prompts over several steps",
    "async_scheduling": "schedule the next step while the device runs this one (default: on "
    "for CUDA devices)",
    "tensor_parallel_size": "number of tensor-parallel ranks",
    "distributed_executor_backend": "uni, mp or ray (default: uni for one rank, else mp)",
    "distributed_timeout_s": "seconds a collective or a worker's reply may take before the "
    "workers are declared dead",
    "device": "auto, cpu, cuda or cuda:N",
    "attention_backend": "auto, torch or triton",
    "enforce_eager": "never use CUDA graphs",
}


def add_engine_args(parser: Any, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag-name` per EngineArgs field (vLLM's spelling) to an argparse parser."""
    import argparse

    defaults = EngineArgs()
    for f in fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help_text = _FLAG_HELP.get(f.name, "")
        if "default" not in help_text:
            help_text += " (default: %(default)s)"
        if isinstance(default, bool) or "bool" in str(f.type):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        kind = type(default) if default is not None else _optional_type(f.type)
        parser.add_argument(flag, type=kind, default=default, help=help_text)


def _optional_type(annotation: Any) -> Any:
    text = str(annotation)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def engine_args_from_namespace(namespace: Any) -> EngineArgs:
    values = {
        name: getattr(namespace, name)
        for name in EngineArgs.field_names()
        if hasattr(namespace, name)
    }
    return EngineArgs(**values)
