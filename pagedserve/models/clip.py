"""CLIP's vision tower (ViT) in plain torch, the image encoder of LLaVA.

Mirrors transformers' modeling_clip (CLIPVisionEmbeddings, CLIPAttention, CLIPMLP,
CLIPEncoderLayer, CLIPVisionModel) and vLLM's clip.py: patch conv + class token + learned
positions, `pre_layrnorm`, then pre-norm encoder layers with full (bidirectional) attention.
The tower is small next to the language model, so every tensor-parallel rank runs all of it
(plain nn.Linear, unsharded). Only the layers up to the deepest hidden state a caller reads
are built (LLaVA reads the second-to-last), and `post_layernorm` is never applied (LLaVA
takes hidden states, not the pooled output), as in vLLM.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.activation import get_act_fn


class CLIPVisionEmbeddings(nn.Module):
    """Patch embeddings with a class token in front and learned absolute positions."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        hidden = vision_config.hidden_size
        self.image_size = int(vision_config.image_size)
        self.patch_size = int(vision_config.patch_size)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(
            int(getattr(vision_config, "num_channels", 3)),
            hidden,
            kernel_size=self.patch_size,
            stride=self.patch_size,
            bias=False,
        )
        self.num_patches = (self.image_size // self.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches + 1, hidden)

    def forward(
        self,
        pixel_values: torch.Tensor,  # [num_images, num_channels, image_size, image_size] float
    ) -> torch.Tensor:  # [num_images, 1 + num_patches, hidden] float
        height, width = pixel_values.shape[-2:]
        if height != self.image_size or width != self.image_size:
            # transformers would interpolate the positions only when asked; LLaVA-1.5's
            # processor always crops to image_size.
            raise ValueError(
                f"image of {height}x{width} pixels does not match the vision tower's "
                f"image_size ({self.image_size}); the model's processor resizes and crops to it"
            )
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [n, hidden, g, g]
        patches = patches.flatten(2).transpose(1, 2)  # [n, g * g, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        embeddings: torch.Tensor = torch.cat([cls, patches], dim=1)
        return embeddings + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Multi-head self-attention over all of an image's tokens (no mask, no cache)."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        hidden = vision_config.hidden_size
        self.num_heads = int(vision_config.num_attention_heads)
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(
        self,
        x: torch.Tensor,  # [num_images, seq_len, hidden] float
    ) -> torch.Tensor:  # [num_images, seq_len, hidden] float
        n, seq_len, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # -> [n, num_heads, seq_len, head_dim]
            return t.view(n, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        # SDPA's default scale is head_dim ** -0.5, CLIP's.
        out = F.scaled_dot_product_attention(q, k, v)
        result: torch.Tensor = self.out_proj(out.transpose(1, 2).reshape(n, seq_len, hidden))
        return result


class CLIPMLP(nn.Module):
    """fc2(act(fc1(x))), act quick_gelu in OpenAI's CLIP."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vision_config.hidden_size, vision_config.intermediate_size)
        self.act = get_act_fn(str(vision_config.hidden_act))
        self.fc2 = nn.Linear(vision_config.intermediate_size, vision_config.hidden_size)

    def forward(
        self,
        x: torch.Tensor,  # [num_images, seq_len, hidden] float
    ) -> torch.Tensor:  # [num_images, seq_len, hidden] float
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class CLIPEncoderLayer(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        eps = float(vision_config.layer_norm_eps)
        self.layer_norm1 = nn.LayerNorm(vision_config.hidden_size, eps=eps)
        self.self_attn = CLIPAttention(vision_config)
        self.layer_norm2 = nn.LayerNorm(vision_config.hidden_size, eps=eps)
        self.mlp = CLIPMLP(vision_config)

    def forward(
        self,
        x: torch.Tensor,  # [num_images, seq_len, hidden] float
    ) -> torch.Tensor:  # [num_images, seq_len, hidden] float
        x = x + self.self_attn(self.layer_norm1(x))
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class CLIPEncoder(nn.Module):
    def __init__(self, vision_config: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(vision_config) for _ in range(num_layers))


def hidden_state_index(layer: int, num_hidden_layers: int) -> int:
    """transformers' `hidden_states[layer]` as a count of layers run: index 0 is the encoder's
    input (after pre_layrnorm), index i the output of layer i; negative counts from the end
    (-1: the last layer's output). Raises ValueError outside [-(L + 1), L]."""
    index = layer if layer >= 0 else num_hidden_layers + 1 + layer
    if not 0 <= index <= num_hidden_layers:
        raise ValueError(
            f"vision_feature_layer {layer} is out of range for a vision tower of "
            f"{num_hidden_layers} layers"
        )
    return index


class CLIPVisionTower(nn.Module):
    """Embeddings, pre_layrnorm and the encoder's first `num_layers` layers (HF's
    CLIPVisionModel names, without its `vision_model.` level, as transformers 5 saves it)."""

    def __init__(self, vision_config: Any, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(vision_config)
        eps = float(vision_config.layer_norm_eps)
        self.pre_layrnorm = nn.LayerNorm(vision_config.hidden_size, eps=eps)
        self.encoder = CLIPEncoder(vision_config, num_layers)

    def forward(
        self,
        pixel_values: torch.Tensor,  # [num_images, num_channels, image_size, image_size]
        indices: list[int],  # hidden states wanted (`hidden_state_index`), each <= num_layers
    ) -> list[torch.Tensor]:  # each [num_images, 1 + num_patches, hidden] float
        hidden_states = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: hidden_states}
        for i, layer in enumerate(self.encoder.layers, start=1):
            if i > max(indices):
                break
            hidden_states = layer(hidden_states)
            states[i] = hidden_states
        return [states[i] for i in indices]
