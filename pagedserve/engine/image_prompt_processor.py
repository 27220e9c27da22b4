"""ImagePromptProcessor: Qwen2-VL-style prompt processing (images and text only) from the
model folder's tokenizer and image processor, for where transformers' own processor cannot
load: Qwen2_5_VLProcessor needs its video processor, which needs torchvision.

It does what Qwen2_5_VLProcessor.__call__ does for images: the image processor (the PIL
backend, `Qwen2VLImageProcessorPil`, when torchvision is missing) gives the patches and each
image's grid (t, h, w); each "<|image_pad|>" of the text becomes t * h * w / merge_size^2 of
them; then the tokenizer.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np


class ImagePromptProcessor:
    """The image half of a Qwen2-VL processor. `image_token` is the placeholder that the text
    holds once per image; `chat_template` is the tokenizer's (the folder's
    chat_template.jinja)."""

    image_token = "<|image_pad|>"

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = getattr(tokenizer, "chat_template", None)

    @classmethod
    def from_pretrained(
        cls, model_dir: str, trust_remote_code: bool = False
    ) -> "ImagePromptProcessor":
        """Load the folder's tokenizer and image processor. Raises ValueError when the image
        processor is not a Qwen2-VL one (no `merge_size`: the folder needs its own
        processor)."""
        from transformers import AutoImageProcessor, AutoTokenizer

        kwargs: dict[str, Any] = dict(local_files_only=True, trust_remote_code=trust_remote_code)
        # untyped before transformers 5.25, typed since
        image_processor = AutoImageProcessor.from_pretrained(model_dir, **kwargs)  # type: ignore[no-untyped-call, unused-ignore]
        if getattr(image_processor, "merge_size", None) is None:
            raise ValueError(f"{type(image_processor).__name__} is not a Qwen2-VL image processor")
        tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
        return cls(tokenizer, image_processor)

    def __call__(
        self, text: str, images: Sequence[Any], return_tensors: str = "np"
    ) -> dict[str, np.ndarray]:
        """{"input_ids": [1, num_tokens] int64, "pixel_values": [total_patches, C*T*P*P],
        "image_grid_thw": [num_images, 3] int64}, as the transformers processor returns
        them. Raises ValueError when the text's placeholders do not match the images."""
        if return_tensors != "np":
            raise ValueError(f"return_tensors must be 'np', got {return_tensors!r}")
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(images):
            raise ValueError(
                f"the text has {len(parts) - 1} {self.image_token} for {len(images)} images"
            )
        out = self.image_processor(list(images), return_tensors="np")
        grids = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        merge = int(self.image_processor.merge_size) ** 2
        expanded = parts[0] + "".join(
            self.image_token * (int(np.prod(grid)) // merge) + part
            for grid, part in zip(grids, parts[1:], strict=True)
        )
        token_ids = self.tokenizer(expanded)["input_ids"]
        return {
            "input_ids": np.asarray([token_ids], dtype=np.int64),
            "pixel_values": np.asarray(out["pixel_values"]),
            "image_grid_thw": grids,
        }
