"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): our vision encoder
(`qwen2_5_vl_vision`) and our Qwen2 language model with multimodal RoPE, on the paged KV cache.

Mirrors transformers' modeling_qwen2_5_vl (get_image_features: the encoder's merged patches,
one row per `<|image_pad|>` token; get_rope_index: the prompt's 3-D positions) and vLLM's
qwen2_5_vl.py design: the model runner asks for image embeddings (`embed_mm_features`) and
token embeddings (`embed_input_ids`), puts the images' rows in at their placeholder positions,
and runs the language model on those `inputs_embeds` with positions [3, num_tokens]
(`get_mrope_input_positions` once per request; decode tokens continue as text from the
request's `mrope_position_delta`). The vision encoder is replicated on every rank; the
language model is tensor-parallel and quantizable as Qwen2. Images only: video input is
refused by the input processor (modality 'video' is not supported).
"""

import copy
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from pagedserve.layers.rotary import MRotaryEmbedding, read_rope_parameters
from pagedserve.models.llama import get_head_dim
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from pagedserve.models.vlm_base import VisionLanguageModel
from pagedserve.multimodal import MultiModalFeature, image_token_id
from pagedserve.quant_config import QuantizationConfig

# Checkpoint name prefixes -> ours. transformers >= 4.52 saves the first layout; older
# checkpoints (e.g. Qwen/Qwen2.5-VL-3B-Instruct) "visual." and "model." (the language model).
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.visual.", "visual."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("visual.", "visual."),
    ("model.", "language_model.model."),
)


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2.5-VL for paged inference; `forward` and `compute_logits` are the language
    model's, with `inputs_embeds` carrying the images (see the module docstring).

    Raises NotImplementedError for a config this code does not run: a text rope_type other
    than M-RoPE's default frequencies, or a vision config of another family.
    """

    supports_quantization: ClassVar[bool] = True  # the language model's linears
    uses_mrope: ClassVar[bool] = True  # the model runner gives positions [3, num_tokens]

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        vision_config = hf_config.vision_config
        if getattr(vision_config, "model_type", None) != "qwen2_5_vl_vision":
            raise NotImplementedError(
                f"Qwen2.5-VL with vision config {getattr(vision_config, 'model_type', None)!r} "
                f"is not supported; supported: 'qwen2_5_vl_vision'"
            )
        # The top-level tie_word_embeddings is the one transformers applies.
        text_config = copy.copy(hf_config.text_config)
        text_config.tie_word_embeddings = bool(
            getattr(hf_config, "tie_word_embeddings", False)
            or getattr(text_config, "tie_word_embeddings", False)
        )
        self.visual = Qwen2_5_VisionTransformer(vision_config)
        self.language_model = Qwen2ForCausalLM(text_config, quant_config)
        rotary = _mrope(text_config)
        for layer in self.language_model.model.layers:
            layer.self_attn.rotary_emb = rotary
        self.image_token_id = image_token_id(hf_config)
        self.merge_size = int(vision_config.spatial_merge_size)

    def get_mrope_input_positions(
        self, prompt_token_ids: Sequence[int], mm_features: Sequence[MultiModalFeature]
    ) -> tuple[np.ndarray, int]:  # ([3, num_prompt_tokens] int64, mrope_position_delta)
        """The prompt's (temporal, height, width) positions and the delta that decode
        positions add to their token index (transformers' get_rope_index): text tokens count
        up, equal on all three axes; an image's tokens take its merged grid's (t, row, column)
        offset by the position after the text before it; the text after an image continues
        from that offset + max(rows, columns). Raises ValueError for a feature without
        `grid_thw` (not made by a Qwen2-VL processor)."""
        n = len(prompt_token_ids)
        positions = np.empty((3, n), np.int64)
        cursor, current = 0, 0  # next prompt index; next text position
        for feature in sorted(mm_features, key=lambda f: f.offset):
            if feature.grid_thw is None:
                raise ValueError("Qwen2.5-VL image features need grid_thw (its processor's)")
            positions[:, cursor : feature.offset] = current + np.arange(feature.offset - cursor)
            current += feature.offset - cursor
            t, h, w = feature.grid_thw
            rows, cols = h // self.merge_size, w // self.merge_size
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols),
                                        indexing="ij")).reshape(3, -1)  # fmt: skip
            positions[:, feature.offset : feature.end] = grid + current
            current += max(rows, cols)
            cursor = feature.end
        positions[:, cursor:] = current + np.arange(n - cursor)
        delta = int(positions.max()) + 1 - n if n else 0
        return positions, delta

    def embed_multimodal(
        self,
        pixel_values: torch.Tensor,  # [total_patches, C * T * P * P] float, images back to back
        grid_thw: Sequence[tuple[int, int, int]],  # each image's patch grid
    ) -> list[torch.Tensor]:  # per image [t * h * w / merge^2, text_hidden] float
        """Each image's embeddings, one row per `<|image_pad|>` token (transformers'
        Qwen2_5_VLModel.get_image_features), the images encoded in one batch."""
        merged = self.visual(pixel_values, grid_thw)
        sizes = [t * h * w // self.merge_size**2 for t, h, w in grid_thw]
        return list(torch.split(merged, sizes))

    def embed_mm_features(
        self, features: Sequence[MultiModalFeature], device: torch.device
    ) -> list[torch.Tensor]:  # per image [length, text_hidden] float
        """`embed_multimodal` of the images' patches concatenated (the encoder cache's entry
        point). Raises ValueError for a feature without `grid_thw`."""
        grids = []
        for feature in features:
            if feature.grid_thw is None:
                raise ValueError("Qwen2.5-VL image features need grid_thw (its processor's)")
            grids.append(feature.grid_thw)
        pixels = np.concatenate([feature.pixel_values for feature in features])
        return self.embed_multimodal(torch.from_numpy(pixels).to(device), grids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load either checkpoint layout (`_PREFIXES`); returns the names of our parameters
        loaded. Raises UnsupportedModelError naming a tensor we have no parameter for."""
        return self._load_weights(weights, _our_name)


def _mrope(text_config: Any) -> MRotaryEmbedding:
    """The text model's M-RoPE from its rope parameters (transformers 5 reads "mrope" as the
    default frequencies plus `mrope_section`). Raises NotImplementedError for scaled RoPE."""
    rope_theta, rope_scaling = read_rope_parameters(text_config)
    parameters = dict(getattr(text_config, "rope_parameters", None) or {})
    parameters.update(getattr(text_config, "rope_scaling", None) or {})
    section = parameters.get("mrope_section")
    if rope_scaling is not None and rope_scaling["rope_type"] != "mrope":
        raise NotImplementedError(
            f"Qwen2.5-VL with rope_type {rope_scaling['rope_type']!r} is not supported; "
            f"supported: M-RoPE with default frequencies"
        )
    if section is None:
        raise NotImplementedError("Qwen2.5-VL without rope_scaling mrope_section is not supported")
    return MRotaryEmbedding(
        get_head_dim(text_config),
        int(text_config.max_position_embeddings),
        rope_theta,
        [int(s) for s in section],
    )


def _our_name(checkpoint_name: str) -> str:
    """A checkpoint tensor's name in our modules (the first matching prefix of `_PREFIXES`)."""
    for prefix, ours in _PREFIXES:
        if checkpoint_name.startswith(prefix):
            return ours + checkpoint_name[len(prefix) :]
    return checkpoint_name
