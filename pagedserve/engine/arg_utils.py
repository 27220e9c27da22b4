"""EngineArgs: the flat list of user-facing engine options (vLLM's names) -> EngineConfig.

Each option's default, help and validation live on its config field (pagedserve.config); the
fields here only name the options and their user-facing types, and take the rest from there.
"""

import dataclasses
import numbers
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from pagedserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    cuda_index,
)
from pagedserve.config_options import is_option, option_default
from pagedserve.engine.hub import resolve_model_folder
from pagedserve.engine.model_files import (
    diff_sampling_param,
    generation_config_folder,
    load_hf_config,
    read_eos_token_ids,
    read_generation_config,
)
from pagedserve.errors import UnsupportedModelError
from pagedserve.model_config import get_model_max_len
from pagedserve.quant_config import resolve_quantization

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
    props = torch.cuda.get_device_properties(cuda_index(device))
    if props.total_memory >= 70 * _GiB and "a100" not in props.name.lower():
        return 16384
    return 8192


_FROM_CONFIG: Any = object()  # an EngineArgs field's default: the config field's (filled below)
_T = TypeVar("_T")


def _options_from(*configs: Any) -> Callable[[type[_T]], type[_T]]:
    """Class decorator (under @dataclass): give each `name: type = _FROM_CONFIG` field the
    default and help of the config field of that name, as a `dataclasses.field`. Checks at
    import that the class names every option of `configs` exactly once, each with the config
    field's type (or that type | None where the config derives the value), and that no
    option is declared by two configs; raises TypeError."""
    options = {}
    for config in configs:
        for f in filter(is_option, fields(config)):
            if f.name in options:
                raise TypeError(f"option {f.name} is declared by two configs")
            options[f.name] = (f, typing.get_type_hints(config)[f.name])

    def decorate(cls: type[_T]) -> type[_T]:
        names = typing.get_type_hints(cls)
        missing, unknown = sorted(set(options) - set(names)), sorted(set(names) - set(options))
        if missing or unknown:
            raise TypeError(f"{cls.__name__}: options missing {missing}, unknown {unknown}")
        for name, annotation in names.items():
            source, kind = options[name]
            default = option_default(source)
            expected = kind if default is not None else kind | None
            if vars(cls).get(name) is not _FROM_CONFIG or annotation != expected:
                raise TypeError(f"{cls.__name__}.{name} must be `{expected} = _FROM_CONFIG`")
            setattr(cls, name, field(default=default, metadata=source.metadata))
        return cls

    return decorate


@dataclass(slots=True)
@_options_from(
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    DeviceConfig,
    StructuredOutputsConfig,
)
class EngineArgs:
    """Options of `LLM(...)`, `LLMEngine` and the CLI, named as vLLM's `EngineArgs`.

    Each field's default and help (`dataclasses.fields(EngineArgs)[i].metadata["help"]`) are
    those of the config field of the same name in `pagedserve.config`; None where the config
    derives the value (the model's context length, the tokenizer folder, ...).
    """

    model: str = _FROM_CONFIG
    tokenizer: str | None = _FROM_CONFIG
    skip_tokenizer_init: bool = _FROM_CONFIG
    dtype: str = _FROM_CONFIG
    seed: int = _FROM_CONFIG
    max_model_len: int | None = _FROM_CONFIG
    max_logprobs: int = _FROM_CONFIG
    load_format: str = _FROM_CONFIG
    model_impl: str = _FROM_CONFIG
    quantization: str | None = _FROM_CONFIG
    revision: str | None = _FROM_CONFIG
    tokenizer_revision: str | None = _FROM_CONFIG
    download_dir: str | None = _FROM_CONFIG
    trust_remote_code: bool = _FROM_CONFIG
    hf_overrides: dict[str, Any] | None = _FROM_CONFIG
    generation_config: str = _FROM_CONFIG
    limit_mm_per_prompt: dict[str, int] | None = _FROM_CONFIG
    allowed_local_media_path: str = _FROM_CONFIG
    block_size: int = _FROM_CONFIG
    gpu_memory_utilization: float = _FROM_CONFIG
    kv_cache_memory_bytes: int | None = _FROM_CONFIG
    num_gpu_blocks_override: int | None = _FROM_CONFIG
    enable_prefix_caching: bool = _FROM_CONFIG
    kv_cache_dtype: str = _FROM_CONFIG
    cpu_offload_gb: float = _FROM_CONFIG
    swap_space: float = _FROM_CONFIG
    kv_offload_gb: float = _FROM_CONFIG
    max_num_seqs: int = _FROM_CONFIG
    max_num_batched_tokens: int | None = _FROM_CONFIG
    enable_chunked_prefill: bool = _FROM_CONFIG
    async_scheduling: bool | None = _FROM_CONFIG
    scheduling_policy: str = _FROM_CONFIG
    preemption_mode: str = _FROM_CONFIG
    tensor_parallel_size: int = _FROM_CONFIG
    pipeline_parallel_size: int = _FROM_CONFIG
    data_parallel_size: int = _FROM_CONFIG
    distributed_executor_backend: str | None = _FROM_CONFIG
    distributed_timeout_s: float = _FROM_CONFIG
    enable_expert_parallel: bool = _FROM_CONFIG
    device: str = _FROM_CONFIG
    attention_backend: str = _FROM_CONFIG
    enforce_eager: bool = _FROM_CONFIG
    structured_outputs_backend: str = _FROM_CONFIG
    reasoning_parser: str | None = _FROM_CONFIG
    disable_any_whitespace: bool = _FROM_CONFIG

    def __post_init__(self) -> None:
        # A path object names a folder as well as a string does.
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        if isinstance(self.download_dir, os.PathLike):
            self.download_dir = os.fspath(self.download_dir)
        if isinstance(self.generation_config, os.PathLike):
            self.generation_config = os.fspath(self.generation_config)
        if isinstance(self.allowed_local_media_path, os.PathLike):
            self.allowed_local_media_path = os.fspath(self.allowed_local_media_path)

    @classmethod
    def field_names(cls) -> list[str]:
        """The engine options' names, in declaration order (= the config fields they mirror)."""
        return [f.name for f in fields(cls)]

    def create_engine_config(self, usage_context: str = "engine_context") -> EngineConfig:
        """Load the model's config.json and resolve the derived defaults; `usage_context` (one
        of USAGE_CONTEXTS) picks the default step token budget as vLLM does.

        Raises UnsupportedModelError (a ValueError) when the folder or its config is missing,
        or when no backend of `model_impl` runs its architecture (`registry.check_model_impl`,
        which also refuses tensor parallelism and quantization with the transformers backend),
        and ValueError when an option has the wrong type or is out of range (naming the option
        and the limit; the configs' `__post_init__` check the ranges). The options that need
        no model are checked before the model's config is read. The quantization method is
        the option's, else the checkpoint's (`quant_config.resolve_quantization`: ValueError
        when they contradict or the checkpoint's bits/group size are unsupported,
        NotImplementedError for a method not implemented yet). A model or tokenizer that is
        a Hub id is resolved to its local folder here (`engine.hub`; UnsupportedModelError
        when it cannot be found or fetched).
        """
        if usage_context not in USAGE_CONTEXTS:
            raise ValueError(
                f"usage_context must be one of {USAGE_CONTEXTS}, got {usage_context!r}"
            )
        self._check_types()
        device_config = self._build(DeviceConfig)
        cache_config = self._build(CacheConfig)
        parallel_config = self._build(ParallelConfig)
        model_config = self._build_model_config()
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(
                default_max_num_batched_tokens(usage_context, self.device), self.max_num_seqs
            )
        scheduler_config = self._build(
            SchedulerConfig, max_num_batched_tokens=max_num_batched_tokens
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=parallel_config,
            device_config=device_config,
            structured_outputs_config=self._build(StructuredOutputsConfig),
        )

    def _build_model_config(self) -> ModelConfig:
        """Resolve Hub ids to local folders (once: everything after reads those), read the
        model's config and generation config, and build the ModelConfig."""
        model = resolve_model_folder(
            self.model,
            self.revision,
            self.download_dir,
            weights=self.load_format != "dummy",
            trust_remote_code=self.trust_remote_code,
        )
        tokenizer_revision = self.tokenizer_revision or self.revision  # vLLM's default
        tokenizer = model
        if self.tokenizer is not None and not self.skip_tokenizer_init:
            tokenizer = resolve_model_folder(
                self.tokenizer,
                tokenizer_revision,
                self.download_dir,
                what="tokenizer",
                weights=False,
                trust_remote_code=self.trust_remote_code,
            )
            if not os.path.isdir(tokenizer):  # a path, not an id: transformers' OSError
                raise UnsupportedModelError(  # would call it a malformed Hub id
                    f"tokenizer folder {tokenizer!r} does not exist (nor is it a Hub id)"
                )
        hf_config = load_hf_config(model, self.trust_remote_code, self.hf_overrides)
        generation_config = read_generation_config(
            generation_config_folder(model, self.generation_config)
        )
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = get_model_max_len(hf_config)
        quantization = resolve_quantization(self.quantization, hf_config)
        # Imported here: importing the API server must load no model code (registry included).
        from pagedserve.models.registry import check_model_impl

        check_model_impl(
            hf_config,
            self.model_impl,
            self.tensor_parallel_size,
            quantization,
            self.pipeline_parallel_size,
        )
        config: ModelConfig = self._build(
            ModelConfig,
            model=model,
            tokenizer=tokenizer,
            tokenizer_revision=tokenizer_revision,
            max_model_len=max_model_len,
            quantization=quantization,
            hf_config=hf_config,
            eos_token_ids=read_eos_token_ids(model, hf_config, generation_config),
            model_name=self.model,
            diff_sampling_param=diff_sampling_param(generation_config, self.generation_config),
        )
        return config

    def resolved(self, config: EngineConfig) -> "EngineArgs":
        """These options with the model and tokenizer as the local folders `config` resolved
        them to: what another process (the engine core) builds its config from, so that it
        reads the same files and never the Hub."""
        model_config = config.model_config
        return dataclasses.replace(self, model=model_config.model, tokenizer=model_config.tokenizer)

    def _build(self, config: Any, **derived: Any) -> Any:
        """The config dataclass `config` from this object's options of the same names, and
        `derived` for the values resolved here (its `__post_init__` validates them all)."""
        options = {f.name: getattr(self, f.name) for f in fields(config) if is_option(f)}
        return config(**(options | derived))

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
    """`value` as the first of `kinds` (bool, int, float, str, dict with str keys) it is,
    or _WRONG."""
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
        elif (
            typing.get_origin(kind) is dict
            and isinstance(value, dict)
            and all(isinstance(key, str) for key in value)  # a JSON object's keys
        ):
            return dict(value)
    return _WRONG


def engine_args_from_namespace(namespace: Any) -> EngineArgs:
    """EngineArgs from parsed CLI flags (an argparse Namespace); attributes that are not
    engine options (server flags) are ignored. Raises what EngineArgs raises (ValueError)."""
    values = {
        name: getattr(namespace, name)
        for name in EngineArgs.field_names()
        if hasattr(namespace, name)
    }
    return EngineArgs(**values)
