"""Maps the `architectures` names of HF configs to our model classes."""

from types import MappingProxyType

from torch import nn

from pagedserve.errors import UnsupportedModelError
from pagedserve.models.gpt2 import GPT2LMHeadModel
from pagedserve.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM

_MODEL_CLASSES: MappingProxyType[str, type[nn.Module]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": MistralForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "GPT2LMHeadModel": GPT2LMHeadModel,
    }
)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODEL_CLASSES))


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class of the first supported name in an HF config's `architectures` list.

    Raises UnsupportedModelError listing the supported architectures when none matches.
    """
    for architecture in architectures:
        if architecture in _MODEL_CLASSES:
            return _MODEL_CLASSES[architecture]
    raise UnsupportedModelError(
        f"model architectures {architectures} are not supported; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )
