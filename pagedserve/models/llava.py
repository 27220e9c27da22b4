"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector
and our Llama language model on the paged KV cache.

Mirrors transformers' modeling_llava (LlavaModel.get_image_features: hidden states of
`vision_feature_layer`, the class token dropped for strategy "default", then the projector;
the image features replace the embeddings of the image placeholder tokens) and vLLM's
llava.py design: the model runner asks for image embeddings (`embed_multimodal`) and token
embeddings (`embed_input_ids`), puts the images' rows in at their placeholder positions, and
runs the language model on those `inputs_embeds`. The language side is our
LlamaForCausalLM built from `text_config` (tensor parallelism and quantization as Llama);
the vision tower and projector are replicated on every rank.
"""

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pagedserve.layers.activation import get_act_fn
from pagedserve.models.clip import CLIPVisionTower, hidden_state_index
from pagedserve.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagedserve.models.vlm_base import VisionLanguageModel
from pagedserve.multimodal import MultiModalFeature, image_token_id
from pagedserve.quant_config import QuantizationConfig

# text_config.model_type -> the language model class
_LANGUAGE_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
}
# Checkpoint name prefixes -> ours. transformers >= 4.52 saves the "model." layout, older
# ones the other; our language model takes its own names ("model.", "lm_head.").
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)


class LlavaMultiModalProjector(nn.Module):
    """linear_2(act(linear_1(features))): vision hidden size (times the number of feature
    layers, concatenated) -> the language model's hidden size."""

    def __init__(self, hf_config: Any, num_feature_layers: int) -> None:
        super().__init__()
        bias = bool(getattr(hf_config, "multimodal_projector_bias", True))
        vision_hidden = hf_config.vision_config.hidden_size * num_feature_layers
        text_hidden = hf_config.text_config.hidden_size
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = get_act_fn(str(getattr(hf_config, "projector_hidden_act", "gelu")))
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(
        self,
        features: torch.Tensor,  # [num_images, num_image_tokens, vision_hidden] float
    ) -> torch.Tensor:  # [num_images, num_image_tokens, text_hidden] float
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(features)))
        return out


class LlavaForConditionalGeneration(VisionLanguageModel):
    """LLaVA-1.5 for paged inference; `forward` and `compute_logits` are the language
    model's, with `inputs_embeds` carrying the images (see the module docstring)."""

    supports_quantization: ClassVar[bool] = True  # the language model's linears

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        vision_config, text_config = hf_config.vision_config, hf_config.text_config
        if getattr(vision_config, "model_type", None) != "clip_vision_model":
            raise NotImplementedError(
                f"LLaVA with vision tower {getattr(vision_config, 'model_type', None)!r} is "
                f"not supported yet; supported: 'clip_vision_model' (LLaVA-1.5)"
            )
        language_cls = _LANGUAGE_MODELS.get(getattr(text_config, "model_type", ""))
        if language_cls is None:
            raise NotImplementedError(
                f"LLaVA with language model {getattr(text_config, 'model_type', None)!r} is "
                f"not supported yet; supported: {', '.join(_LANGUAGE_MODELS)}"
            )
        self.strategy = str(getattr(hf_config, "vision_feature_select_strategy", "default"))
        if self.strategy not in ("default", "full"):
            raise NotImplementedError(
                f"vision_feature_select_strategy {self.strategy!r} is not supported; "
                f"supported: 'default' (drop the class token), 'full'"
            )
        layer = getattr(hf_config, "vision_feature_layer", -2)
        layers = [layer] if isinstance(layer, int) else list(layer)
        num_vision_layers = int(vision_config.num_hidden_layers)
        self.feature_indices = [hidden_state_index(i, num_vision_layers) for i in layers]
        self.vision_tower = CLIPVisionTower(vision_config, max(self.feature_indices))
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config, len(layers))
        self.language_model = language_cls(text_config, quant_config)
        self.image_token_id = image_token_id(hf_config)

    def embed_multimodal(
        self,
        pixel_values: torch.Tensor,  # [num_images, num_channels, image_size, image_size]
    ) -> torch.Tensor:  # [num_images, num_image_tokens, text_hidden] float
        """Each image's embeddings, one row per placeholder token (transformers'
        LlavaModel.get_image_features): num_image_tokens = num_patches, + 1 for "full"."""
        states = self.vision_tower(pixel_values, self.feature_indices)
        if self.strategy == "default":
            states = [s[:, 1:] for s in states]
        features: torch.Tensor = self.multi_modal_projector(torch.cat(states, dim=-1))
        return features

    def embed_mm_features(
        self, features: Sequence[MultiModalFeature], device: torch.device
    ) -> torch.Tensor:  # [num_images, num_image_tokens, text_hidden] float
        """`embed_multimodal` of the images' pixels stacked into one batch (the encoder
        cache's entry point: every LLaVA-1.5 image has the same size)."""
        pixels = np.stack([feature.pixel_values for feature in features])
        return self.embed_multimodal(torch.from_numpy(pixels).to(device))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load either checkpoint layout (`_PREFIXES`); returns the names of our parameters
        loaded. Vision layers past the deepest feature layer and `post_layernorm` are
        skipped (never run)."""
        return self._load_weights(weights, _our_name, self._is_unused_vision_weight)

    def _is_unused_vision_weight(self, name: str) -> bool:
        if name.startswith("vision_tower.post_layernorm."):
            return True
        if name == "vision_tower.embeddings.position_ids":
            return True  # a buffer old transformers versions saved (arange); never read
        prefix = "vision_tower.encoder.layers."
        if not name.startswith(prefix):
            return False
        return int(name[len(prefix) :].split(".")[0]) >= len(self.vision_tower.encoder.layers)


def _our_name(checkpoint_name: str) -> str:
    """A checkpoint tensor's name in our modules: the new layout's prefixes mapped to the old
    one's, and the `vision_model.` level of transformers 4's CLIPVisionModel dropped."""
    name = checkpoint_name
    for new, old in _PREFIXES:
        if name.startswith(new):
            name = old + name[len(new) :]
            break
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model.") :]
    return name
