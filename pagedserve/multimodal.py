"""MultiModalFeature: one image of a request, as the scheduler, the prefix cache and the
workers see it (vLLM's `MultiModalFeatureSpec`). Import rule: a leaf (numpy only, no torch).

The input processor makes them (the model's transformers processor gives the pixels and
expands each image placeholder to its tokens); the prefix cache hashes `identifier` into the
blocks that hold the image's tokens; the model runner encodes `pixel_values` when a step
first feeds one of the image's tokens (`worker/encoder_cache.py`).
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def image_token_id(hf_config: Any) -> int:
    """The id of a vision-language config's image placeholder token: `image_token_id`
    (transformers 5), else the older `image_token_index`. Raises AttributeError without
    either."""
    token_id = getattr(hf_config, "image_token_id", None)
    if token_id is None:
        token_id = hf_config.image_token_index
    return int(token_id)


@dataclass(frozen=True, slots=True, eq=False)
class MultiModalFeature:
    """An image and where its tokens sit in the prompt.

    |<-- offset -->|<-- length placeholder tokens -->|   (prompt token positions)
    The model replaces the embeddings of those `length` tokens by the image's
    (`length` rows of the projector's output).

    `pixel_values` is the processor's output for this one image: LLaVA's
    [num_channels, height, width] (every image the same size), or Qwen2-VL's flattened
    patches [grid_t * grid_h * grid_w, num_channels * temporal_patch * patch * patch] with the
    patch grid in `grid_thw` (each image its own size, `length` = t * h * w / merge_size^2).
    """

    pixel_values: np.ndarray  # float32, the processor's (see above)
    offset: int  # position of the image's first placeholder token in the prompt
    length: int  # number of placeholder tokens (the image's embeddings)
    identifier: str  # sha256 hex of the pixels: equal images share prefix-cache blocks
    modality: str = "image"
    grid_thw: tuple[int, int, int] | None = None  # patch grid (t, h, w); None: fixed-size image

    @property
    def end(self) -> int:
        """One past the image's last placeholder position."""
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether token positions [start, end) hold any of this image's tokens."""
        return self.offset < end and start < self.end


def hash_pixels(pixel_values: np.ndarray, grid_thw: tuple[int, int, int] | None = None) -> str:
    """sha256 hex of an image's pixels, with its shape, dtype and patch grid (two images of
    the same bytes but other shapes or grids are different images)."""
    digest = hashlib.sha256(f"{pixel_values.dtype}{pixel_values.shape}{grid_thw}".encode())
    digest.update(np.ascontiguousarray(pixel_values).tobytes())
    return digest.hexdigest()


def placeholder_ranges(
    token_ids: Sequence[int],
    placeholder_id: int,
    num_items: int,
    lengths: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """(offset, length) of each of `num_items` items whose placeholder tokens are the runs of
    `placeholder_id` in `token_ids`, in order. `lengths` gives each item's number of tokens
    (Qwen2-VL: each image its own grid); without it every item has the same number (LLaVA-1.5:
    one fixed-size grid per image), so adjacent images' runs split evenly.

    Raises ValueError when the placeholder tokens do not split into `num_items` contiguous
    runs of those lengths."""
    positions = [i for i, t in enumerate(token_ids) if t == placeholder_id]
    if lengths is None:
        if num_items <= 0 or not positions or len(positions) % num_items:
            raise ValueError(
                f"the prompt has {len(positions)} image placeholder tokens for {num_items} images"
            )
        lengths = [len(positions) // num_items] * num_items
    if len(lengths) != num_items or sum(lengths) != len(positions) or min(lengths) <= 0:
        raise ValueError(
            f"the prompt has {len(positions)} image placeholder tokens for {num_items} images "
            f"of {list(lengths)} tokens"
        )
    ranges = []
    start = 0
    for k, length in enumerate(lengths):
        run = positions[start : start + length]
        if run[-1] - run[0] != length - 1:
            raise ValueError(f"image {k}'s {length} placeholder tokens are not contiguous")
        ranges.append((run[0], length))
        start += length
    return ranges


def fit_encoder_budget(
    features: Sequence[MultiModalFeature],
    start: int,
    num_new_tokens: int,
    budget: int,
    budget_untouched: bool,
    admitted: bool,
) -> tuple[int, int]:
    """How many of a request's `num_new_tokens` from prompt position `start` a step can feed
    under the encoder budget (vLLM's encoder compute budget, in embedding rows: the images
    this step must encode), and the budget they spend: (num_new_tokens, encoder tokens).

    An image costs its `length` in the step that first feeds one of its tokens: one starting
    in [start, start + num_new_tokens), or, when the request was `admitted` this step (after
    a prefix hit or a preemption the worker has no encoding of it), one under way at `start`.
    The chunk is cut before the first image past `budget`; an image larger than the whole
    budget still runs, alone, in a step whose budget is `budget_untouched`. A result of 0
    tokens means the request waits for the next step."""
    end = start + num_new_tokens
    cost = 0
    for feature in sorted(features, key=lambda f: f.offset):
        if not feature.overlaps(start, end) or (feature.offset < start and not admitted):
            continue
        if cost + feature.length > budget and (cost > 0 or not budget_untouched):
            return max(feature.offset - start, 0), cost
        cost += feature.length
    return num_new_tokens, cost
