"""Maps the `architectures` names of HF configs to our model classes, and picks the code that
runs a model (`--model-impl`: our native class, or the transformers backend).

Imports no torch and no model module: the API server's process checks a model's architecture
(`SUPPORTED_ARCHITECTURES`) without loading model code; `get_model_class` imports the one
module it returns a class of (vLLM's registry is lazy the same way).
"""

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pagedserve.errors import UnsupportedModelError
from pagedserve.model_config import MODEL_IMPLS

if TYPE_CHECKING:
    from torch import nn

# architecture -> (module under pagedserve.models, class name)
_MODELS: MappingProxyType[str, tuple[str, str]] = MappingProxyType(
    {
        "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
        "MistralForCausalLM": ("llama", "MistralForCausalLM"),
        "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
        "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
        "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
        "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
        "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
        "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
        "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
        "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
        "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
        "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
        "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    }
)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))
# Native architectures whose layers take no quantization method yet: the mixture-of-experts
# models (their FusedMoE experts have no quantized weights or kernels).
_UNQUANTIZED_ONLY = frozenset({"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})
# Native architectures that split their decoder layers over pipeline stages (the Llama
# family's `LlamaModel`); vLLM's SupportsPP.
PIPELINE_PARALLEL_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
# Multimodal architectures (the language model's config in `text_config`) that our native
# code runs; the transformers backend runs none.
MULTIMODAL_ARCHITECTURES = frozenset(
    {"LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}
)


def resolve_model_impl(architectures: list[str], model_impl: str, hf_config: Any) -> str:
    """The code that runs a model: "pagedserve" (our native class) or "transformers" (the
    transformers backend), for `model_impl` "auto" (native when the registry has one of
    `architectures`, else transformers), "pagedserve" / "vllm" (native only) or "transformers".

    Raises UnsupportedModelError listing what is supported: for "pagedserve" on an
    architecture we have no native code for, and when neither backend can run the model (not
    an architecture that transformers' AutoModelForCausalLM builds, e.g. an encoder).
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    native = any(architecture in _MODELS for architecture in architectures)
    if model_impl in ("pagedserve", "vllm"):
        if not native:
            raise UnsupportedModelError(
                f"model architectures {architectures} have no native pagedserve implementation "
                f"(model_impl={model_impl!r}); native architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}; model_impl 'transformers' or 'auto' "
                f"runs the model through transformers' modeling code instead"
            )
        return "pagedserve"
    if model_impl == "auto" and native:
        return "pagedserve"
    from pagedserve.models.transformers_backend.support import check_transformers_can_run

    check_transformers_can_run(architectures, hf_config, SUPPORTED_ARCHITECTURES)
    return "transformers"


def check_model_impl(
    hf_config: Any,
    model_impl: str,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    pipeline_parallel_size: int = 1,
) -> str:
    """`resolve_model_impl` for a config, checked against the engine options before any worker
    starts: the transformers backend runs unquantized weights only, and on several ranks only
    models with a tensor-parallel plan.

    Returns "pagedserve" or "transformers". Raises UnsupportedModelError as
    `resolve_model_impl`, and for a multimodal config (its language model in `text_config`);
    ValueError for tensor_parallel_size > 1 without a TP plan or a quantization method with
    the transformers backend (each naming the option and the way out); NotImplementedError
    for a quantization method with a native mixture-of-experts model (naming the method), and
    for pipeline_parallel_size > 1 with a model outside PIPELINE_PARALLEL_ARCHITECTURES.
    A multimodal config runs natively when its architecture is in MULTIMODAL_ARCHITECTURES
    (LLaVA, Qwen2.5-VL), with model_impl other than "transformers".
    """
    architectures = list(getattr(hf_config, "architectures", None) or [])
    native_multimodal = model_impl != "transformers" and any(
        a in MULTIMODAL_ARCHITECTURES for a in architectures
    )
    is_multimodal = getattr(hf_config, "text_config", None) is not None
    if is_multimodal and not hasattr(hf_config, "vocab_size") and not native_multimodal:
        # A composite (e.g. vision-language) config: the text model's fields live one level
        # down, where neither backend looks (transformers maps some of these
        # *ForConditionalGeneration classes into AutoModelForCausalLM).
        raise UnsupportedModelError(
            f"model architectures {architectures} are a multimodal model (config.json nests "
            f"its language model in text_config); vision-language models are not supported "
            f"yet, except natively {', '.join(sorted(MULTIMODAL_ARCHITECTURES))}; a text-only "
            f"checkpoint of the family (e.g. Gemma3ForCausalLM) runs"
        )
    impl = resolve_model_impl(architectures, model_impl, hf_config)
    native = next((a for a in architectures if a in _MODELS), None)
    if impl == "pagedserve" and quantization is not None and native in _UNQUANTIZED_ONLY:
        raise NotImplementedError(
            f"{native} with quantization {quantization!r} is not supported yet: the "
            f"mixture-of-experts layers run unquantized (bf16/fp16/fp32) weights only; use an "
            f"unquantized checkpoint"
        )
    if pipeline_parallel_size > 1 and (
        impl == "transformers" or native not in PIPELINE_PARALLEL_ARCHITECTURES
    ):
        runs = "the transformers backend" if impl == "transformers" else native
        raise NotImplementedError(
            f"pipeline parallelism (pipeline_parallel_size={pipeline_parallel_size}) is not "
            f"supported for {architectures} ({runs}) yet; supported natively: "
            f"{', '.join(sorted(PIPELINE_PARALLEL_ARCHITECTURES))}"
        )
    if impl == "transformers":
        from pagedserve.models.transformers_backend.support import check_transformers_options

        check_transformers_options(
            architectures, model_impl, tensor_parallel_size, quantization, hf_config
        )
    return impl


def get_model_class(
    architectures: list[str], model_impl: str = "auto", hf_config: Any = None
) -> "type[nn.Module]":
    """The class that runs a model: the native class of the first supported name in an HF
    config's `architectures` list, or `TransformersForCausalLM` (see `resolve_model_impl`).

    Raises UnsupportedModelError listing the supported architectures when none matches.
    """
    if resolve_model_impl(architectures, model_impl, hf_config) == "transformers":
        from pagedserve.models.transformers_backend.model import TransformersForCausalLM

        return TransformersForCausalLM
    for architecture in architectures:
        if architecture in _MODELS:
            module_name, class_name = _MODELS[architecture]
            module = importlib.import_module(f"pagedserve.models.{module_name}")
            model_class: type[nn.Module] = getattr(module, class_name)
            return model_class
    raise AssertionError("resolve_model_impl returned pagedserve for no native architecture")
