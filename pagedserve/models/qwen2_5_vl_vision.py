"""Qwen2.5-VL's vision encoder (a ViT on 14-px patches with 2-D RoPE, window attention and a
2x2 patch merger), our own implementation of transformers'
Qwen2_5_VisionTransformerPretrainedModel (modeling_qwen2_5_vl.py), with the same parameter
names so that checkpoints load as they are.

Images of different sizes are one batch: their patches back to back ([total_patches, C*T*P*P],
the processor's layout) and each image's patch grid (t, h, w). Attention never crosses an
image (full-attention blocks attend within each frame of an image; the others within windows
of `window_size` pixels), so each image's output is what it would get alone.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.activation import get_act_fn
from pagedserve.layers.norm import RMSNorm

_NORM_EPS = 1e-6  # transformers' Qwen2_5_VLRMSNorm default, fixed for the vision blocks


class _PatchWeight(nn.Module):
    """Holds the Conv3d's weight under the checkpoint's name (`patch_embed.proj.weight`)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class PatchEmbed(nn.Module):
    """The Conv3d over one (temporal_patch, patch, patch) patch with its kernel the size of the
    patch: a linear map of the flattened patch. `proj.weight` keeps the checkpoint's 5-D shape
    [hidden, C, T, P, P] (flattened in forward)."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        patch = int(vision_config.patch_size)
        temporal = int(vision_config.temporal_patch_size)
        self.hidden_size = int(vision_config.hidden_size)
        channels = int(vision_config.in_channels)
        self.proj = _PatchWeight(self.hidden_size, channels, temporal, patch, patch)

    def forward(
        self,
        patches: torch.Tensor,  # [num_patches, C * T * P * P] float
    ) -> torch.Tensor:  # [num_patches, hidden] float
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(self.hidden_size, -1))


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within segments (frames or windows: contiguous
    rows of the batch)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(
        self,
        x: torch.Tensor,  # [num_patches, hidden] float
        cos: torch.Tensor,  # [num_patches, head_dim] float32
        sin: torch.Tensor,  # [num_patches, head_dim] float32
        segments: list[torch.Tensor],  # `segment_groups`: [num_segments, length] row indices
    ) -> torch.Tensor:  # [num_patches, hidden] float
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for rows in segments:  # one batched call per segment length
            q_s, k_s, v_s = (t[rows].transpose(1, 2) for t in (q, k, v))  # [s, heads, len, d]
            out[rows] = F.scaled_dot_product_attention(q_s, k_s, v_s).transpose(1, 2)
        projected: torch.Tensor = self.proj(out.reshape(n, -1))
        return projected


def segment_groups(bounds: Sequence[int] | np.ndarray, device: torch.device) -> list[torch.Tensor]:
    """The segments [bounds[i], bounds[i + 1]) grouped by length: per length, the row
    indices [num_segments, length] int64 of its segments (empty segments dropped), so that
    attention runs one batched call per length rather than one per segment (a 1-megapixel
    image has ~80 windows, mostly of one size)."""
    edges = np.asarray(bounds, dtype=np.int64)
    starts, lengths = edges[:-1], np.diff(edges)
    groups = []
    for length in np.unique(lengths[lengths > 0]):
        rows = starts[lengths == length][:, None] + np.arange(length)
        groups.append(torch.from_numpy(rows).to(device))
    return groups


def _rotate(
    x: torch.Tensor,  # [num_patches, heads, head_dim] float
    cos: torch.Tensor,  # [num_patches, head_dim] float32
    sin: torch.Tensor,  # [num_patches, head_dim] float32
) -> torch.Tensor:  # [num_patches, heads, head_dim], dtype of x
    """Rotate-half RoPE in float32, as transformers' apply_rotary_pos_emb_vision."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), all with bias (SwiGLU for silu)."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        hidden, intermediate = int(vision_config.hidden_size), int(vision_config.intermediate_size)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=True)
        self.up_proj = nn.Linear(hidden, intermediate, bias=True)
        self.down_proj = nn.Linear(intermediate, hidden, bias=True)
        act = str(vision_config.hidden_act)
        self.act_fn = nn.SiLU() if act == "silu" else get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return out


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        hidden = int(vision_config.hidden_size)
        self.norm1 = RMSNorm(hidden, _NORM_EPS)
        self.norm2 = RMSNorm(hidden, _NORM_EPS)
        self.attn = VisionAttention(hidden, int(vision_config.num_heads))
        self.mlp = VisionMLP(vision_config)

    def forward(
        self,
        x: torch.Tensor,  # [num_patches, hidden] float
        cos: torch.Tensor,  # [num_patches, head_dim] float32
        sin: torch.Tensor,  # [num_patches, head_dim] float32
        segments: list[torch.Tensor],  # `segment_groups`
    ) -> torch.Tensor:  # [num_patches, hidden] float
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class PatchMerger(nn.Module):
    """RMSNorm, then each 2x2 group of adjacent patches (consecutive rows: the processor orders
    patches merge-block-major) concatenated and mapped by an MLP to the language model's
    hidden size. Names as transformers' (`ln_q`, `mlp.0`, `mlp.2`)."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        hidden = int(vision_config.hidden_size)
        self.merged_size = hidden * int(vision_config.spatial_merge_size) ** 2
        self.ln_q = RMSNorm(hidden, _NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_size, self.merged_size),
            nn.GELU(),
            nn.Linear(self.merged_size, int(vision_config.out_hidden_size)),
        )

    def forward(
        self,
        x: torch.Tensor,  # [num_patches, hidden] float
    ) -> torch.Tensor:  # [num_patches / merge^2, out_hidden_size] float
        out: torch.Tensor = self.mlp(self.ln_q(x).view(-1, self.merged_size))
        return out


class Qwen2_5_VisionTransformer(nn.Module):
    """The encoder: patch embedding, `depth` blocks (full attention at
    `fullatt_block_indexes`, window attention elsewhere) and the merger. Images' tokens are
    permuted into window order for the blocks and back after the merger, as transformers
    does."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        self.merge_size = int(vision_config.spatial_merge_size)
        self.patch_size = int(vision_config.patch_size)
        self.window_size = int(vision_config.window_size)
        self.fullatt_block_indexes = {int(i) for i in vision_config.fullatt_block_indexes}
        self.head_dim = int(vision_config.hidden_size) // int(vision_config.num_heads)
        rope = getattr(vision_config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0))
        quarter = self.head_dim // 2  # h and w each rotate half of the head
        inv_freq = 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.inv_freq: torch.Tensor
        self.patch_embed = PatchEmbed(vision_config)
        self.blocks = nn.ModuleList(VisionBlock(vision_config) for _ in range(vision_config.depth))
        self.merger = PatchMerger(vision_config)

    def forward(
        self,
        pixel_values: torch.Tensor,  # [total_patches, C * T * P * P] float, images back to back
        grid_thw: Sequence[tuple[int, int, int]],  # each image's patch grid
    ) -> torch.Tensor:  # [total_patches / merge^2, out_hidden_size] float, in image order
        positions = self._rope_positions(grid_thw)  # [total_patches, 2] (h, w)
        window_index, cu_window = self._window_index(grid_thw)
        cu_full = np.cumsum([0] + [h * w for t, h, w in grid_thw for _ in range(t)])
        full = segment_groups(cu_full, pixel_values.device)  # each frame of each image
        windows = segment_groups(cu_window, pixel_values.device)
        unit = self.merge_size**2
        order = torch.from_numpy(window_index).to(pixel_values.device)

        def to_window_order(x: torch.Tensor) -> torch.Tensor:  # merge groups permuted
            return x.view(-1, unit, *x.shape[1:])[order].flatten(0, 1)

        x = to_window_order(self.patch_embed(pixel_values))
        freqs = positions.to(pixel_values.device)[..., None].float() * self.inv_freq
        half = freqs.flatten(1)  # [n, head_dim / 2]: h frequencies, then w's
        angles = to_window_order(torch.cat([half, half], dim=-1))
        cos, sin = angles.cos(), angles.sin()
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in self.fullatt_block_indexes else windows)
        merged: torch.Tensor = self.merger(x)
        return merged[torch.argsort(order)]

    def _rope_positions(
        self, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:  # [total_patches, 2] int64, (row, column) of each patch
        """Each patch's (h, w) in its image's grid, in the processor's patch order: merge
        blocks row-major, the merge_size^2 patches of a block row-major within it."""
        m = self.merge_size
        out = []
        for t, h, w in grid_thw:
            rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            blocks = [a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).ravel()
                      for a in (rows, cols)]  # fmt: skip
            out.append(np.tile(np.stack(blocks, axis=-1), (t, 1)))
        return torch.from_numpy(np.concatenate(out))

    def _window_index(
        self, grid_thw: Sequence[tuple[int, int, int]]
    ) -> tuple[np.ndarray, list[int]]:
        """(merge groups in window order [total_patches / merge^2] int64, window bounds in
        patches): each image's merged grid cut into windows of window_size / merge_size /
        patch_size merge groups a side (the last row/column of windows may be smaller), as
        transformers' get_vision_window_index."""
        side = self.window_size // self.merge_size // self.patch_size
        unit = self.merge_size**2
        index, bounds, first = [], [0], 0
        for t, h, w in grid_thw:
            gh, gw = h // self.merge_size, w // self.merge_size
            ids = np.arange(t * gh * gw).reshape(t, gh, gw)
            for frame in range(t):
                for r in range(0, gh, side):
                    for c in range(0, gw, side):
                        window = ids[frame, r : r + side, c : c + side].ravel()
                        index.append(window + first)
                        bounds.append(bounds[-1] + window.size * unit)
            first += t * gh * gw
        return np.concatenate(index), bounds
