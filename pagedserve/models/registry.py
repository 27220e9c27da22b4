"""Maps the `architectures` names of HF configs to our model classes.

Imports no torch and no model module: the API server's process checks a model's architecture
(`SUPPORTED_ARCHITECTURES`) without loading model code; `get_model_class` imports the one
module it returns a class of (vLLM's registry is lazy the same way).
"""

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING

from pagedserve.errors import UnsupportedModelError

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
    }
)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))


def get_model_class(architectures: list[str]) -> "type[nn.Module]":
    """The class of the first supported name in an HF config's `architectures` list.

    Raises UnsupportedModelError listing the supported architectures when none matches.
    """
    for architecture in architectures:
        if architecture in _MODELS:
            module_name, class_name = _MODELS[architecture]
            module = importlib.import_module(f"pagedserve.models.{module_name}")
            model_class: type[nn.Module] = getattr(module, class_name)
            return model_class
    raise UnsupportedModelError(
        f"model architectures {architectures} are not supported; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )
