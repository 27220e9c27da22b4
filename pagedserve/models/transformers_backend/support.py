"""Which models the transformers backend can run, checked from the config alone.

Torch-free at import (the registry imports it lazily); `check_transformers_can_run` imports
transformers' auto-model tables, which import torch.
"""

import inspect
import sys
from typing import Any

from pagedserve.errors import UnsupportedModelError

# The oldest transformers the backend runs on: it relies on 5.x's attention and mask
# interfaces (masking_utils mask functions, `dtype=` at construction, checkpoint renamings).
MIN_TRANSFORMERS_VERSION = "5.0"


def check_transformers_version(model: str = "this model") -> None:
    """Raise UnsupportedModelError (one line naming `model`, the installed and the needed
    version) when the installed transformers is older than MIN_TRANSFORMERS_VERSION."""
    import transformers
    from packaging.version import Version

    installed = transformers.__version__
    if Version(installed) < Version(MIN_TRANSFORMERS_VERSION):
        raise UnsupportedModelError(
            f"the transformers backend (model_impl 'transformers'), which runs {model}, needs "
            f"transformers >= {MIN_TRANSFORMERS_VERSION}, installed: {installed} (pip install "
            f"-U 'transformers>={MIN_TRANSFORMERS_VERSION}')"
        )


def causal_lm_architectures() -> dict[str, str]:
    """transformers' AutoModelForCausalLM table: model_type -> class name
    (e.g. "gemma" -> "GemmaForCausalLM")."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def causal_lm_class(hf_config: Any, architectures: list[str] | None = None) -> Any:
    """The transformers class that builds the model: the first of `architectures` (default:
    the config's) that is an AutoModelForCausalLM class, else the one AutoModelForCausalLM
    maps the config's type to. Raises UnsupportedModelError when there is none."""
    import transformers

    names = set(causal_lm_architectures().values())
    if architectures is None:
        architectures = list(getattr(hf_config, "architectures", None) or [])
    for architecture in architectures:
        if architecture in names and hasattr(transformers, architecture):
            return getattr(transformers, architecture)
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(hf_config)]
    except KeyError:
        raise UnsupportedModelError(
            f"transformers' AutoModelForCausalLM has no class for {type(hf_config).__name__} "
            f"(architectures {getattr(hf_config, 'architectures', None)})"
        ) from None


def uses_attention_interface(model_class: Any) -> bool:
    """Whether a transformers model class attends through the attention-function registry:
    its `_supports_attention_backend` flag, or (the flag is missing on some that do, e.g.
    StableLM) its modeling module looking functions up in ALL_ATTENTION_FUNCTIONS. Models
    that pass this but skip the registry in some layers are caught by the wrapper's probe."""
    if getattr(model_class, "_supports_attention_backend", False):
        return True
    module = sys.modules.get(model_class.__module__)
    try:
        return module is not None and "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module)
    except (OSError, TypeError):  # no source (a compiled module): trust the flag
        return False


def check_transformers_can_run(
    architectures: list[str], hf_config: Any, native_architectures: tuple[str, ...]
) -> None:
    """Raise UnsupportedModelError unless transformers' AutoModelForCausalLM builds one of
    `architectures` (or, for a config without `architectures`, has a causal LM for its
    `model_type`). The message lists what is supported: our native architectures and every
    causal-LM architecture of the installed transformers. Models whose code comes with the
    checkpoint (`auto_map`, trust_remote_code) are not run by this backend."""
    import transformers

    check_transformers_version(f"model architectures {architectures}")
    table = causal_lm_architectures()
    names = set(table.values())
    if (architectures and any(a in names for a in architectures)) or (
        not architectures and getattr(hf_config, "model_type", None) in table
    ):
        model_class = causal_lm_class(hf_config, architectures)
        if not uses_attention_interface(model_class):
            raise UnsupportedModelError(
                f"{model_class.__name__} computes attention in its own code rather than through "
                f"transformers' attention interface (ALL_ATTENTION_FUNCTIONS), so the "
                f"transformers backend cannot plug paged attention into it; supported: "
                f"native {', '.join(native_architectures)}, and the AutoModelForCausalLM "
                f"architectures of transformers {transformers.__version__} that support "
                f"attention backends"
            )
        return

    what = (
        f"model architectures {architectures}"
        if architectures
        else f"model_type {getattr(hf_config, 'model_type', None)!r} (config.json lists no "
        f"architectures)"
    )
    raise UnsupportedModelError(
        f"{what} can be run by neither pagedserve's native models nor its transformers backend "
        f"(which runs text-generation models that transformers' AutoModelForCausalLM builds; "
        f"encoders, encoder-decoders and models with their own remote code are not); "
        f"supported: native {', '.join(native_architectures)}; transformers "
        f"{transformers.__version__} AutoModelForCausalLM {', '.join(sorted(names))}"
    )


def check_transformers_options(
    architectures: list[str],
    model_impl: str,
    tensor_parallel_size: int,
    quantization: str | None,
    hf_config: Any = None,
) -> None:
    """Raise ValueError for the engine options this backend does not support: tensor
    parallelism for a model whose transformers config has no TP plan (`base_model_tp_plan`;
    the styles in it are checked when the model is built, `tensor_parallel.shard_model`) and
    quantized weights (each message names the option and the way out)."""
    how = f"model architectures {architectures} run with the transformers backend (model_impl "
    how += f"{model_impl!r})"
    if tensor_parallel_size > 1 and not getattr(hf_config, "base_model_tp_plan", None):
        raise ValueError(
            f"{how}, which splits a model over ranks only by its transformers tensor-parallel "
            f"plan (base_model_tp_plan), and this model's config has none: "
            f"tensor_parallel_size must be 1, got {tensor_parallel_size} (or use a native "
            f"model, model_impl 'pagedserve')"
        )
    if quantization is not None:
        raise ValueError(
            f"{how}, which runs unquantized weights only: quantization {quantization!r} is "
            f"not supported with it (quantized checkpoints need a native model)"
        )
