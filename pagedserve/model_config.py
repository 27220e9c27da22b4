"""ModelConfig: which model to run and how, with the readers of its Hugging Face config
(the language model's config and its context length).

Its fields are options declared with `option(...)` (config_options.py); `EngineConfig`
(pagedserve.config, which re-exports `ModelConfig` and `DEFAULT_MODEL`) holds a ModelConfig.
Import rule: a leaf; imports from pagedserve only the torch-free leaves
`pagedserve.config_options` and `pagedserve.quant_config`.
"""

import dataclasses
import os
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from pagedserve.config_options import json_object, option
from pagedserve.quant_config import QUANTIZATION_METHODS

DEFAULT_MODEL = str(files("pagedserve.assets") / "stories260k")
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# vLLM's `--model-impl` values; "pagedserve" is our native code (vLLM calls its own "vllm",
# accepted here as the same).
MODEL_IMPLS = ("auto", "pagedserve", "vllm", "transformers")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's; also InputProcessor's default
DEFAULT_MM_LIMIT = 999  # items per modality and prompt, vLLM V1's limit_mm_per_prompt default


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
