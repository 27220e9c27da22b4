"""MultiModalProcessor: a prompt's text and images -> token ids (each image placeholder
expanded to its tokens) and the images as MultiModalFeature (pixels, placeholder range,
content hash), through the model folder's transformers processor (`AutoProcessor`, e.g.
LlavaProcessor; `ImagePromptProcessor` for Qwen2-VL without torchvision), as vLLM's
multimodal processors wrap the HF processor.
"""

import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pagedserve.engine.image_prompt_processor import ImagePromptProcessor
from pagedserve.errors import InvalidRequestError
from pagedserve.model_config import DEFAULT_MM_LIMIT
from pagedserve.multimodal import MultiModalFeature, hash_pixels, placeholder_ranges

SUPPORTED_MODALITIES = ("image",)
_PREFETCH_THREADS = min(8, os.cpu_count() or 1)
_Processed = tuple[list[int], tuple[MultiModalFeature, ...]]


class MultiModalProcessor:
    """Loads the processor of `model_dir` on first use (once; the server tokenizes from a
    thread pool), then prepares prompts with images. `image_token_id` is the config's
    (LlavaConfig.image_token_index): the id of each image's placeholder tokens;
    `max_images`: limit_mm_per_prompt's "image" (vLLM's; default 999)."""

    def __init__(
        self,
        model_dir: str,
        image_token_id: int,
        trust_remote_code: bool = False,
        max_images: int = DEFAULT_MM_LIMIT,
    ):
        self.model_dir = model_dir
        self.max_images = max_images
        self.image_token_id = image_token_id
        self.trust_remote_code = trust_remote_code
        self._processor: Any = None
        self._lock = threading.Lock()
        # (text, id(multi_modal_data)) -> `prefetch`'s result or error for `process`
        self._prefetched: dict[tuple[str, int], _Processed | Exception] = {}

    @property
    def processor(self) -> Any:
        with self._lock:
            if self._processor is None:
                self._processor = self._load()
            return self._processor

    def _load(self) -> Any:
        """AutoProcessor's, or where it cannot load for lack of torchvision (Qwen2-VL's
        processor needs it for its video processor) our ImagePromptProcessor of the same
        tokenizer and image processor. Raises the ImportError when that fallback does not
        apply (the folder's image processor is not Qwen2-VL's)."""
        from transformers import AutoProcessor

        try:
            return AutoProcessor.from_pretrained(  # type: ignore[no-untyped-call]
                self.model_dir, local_files_only=True, trust_remote_code=self.trust_remote_code
            )
        except ImportError as error:
            try:
                return ImagePromptProcessor.from_pretrained(self.model_dir, self.trust_remote_code)
            except ValueError:
                raise error from None

    @property
    def image_placeholder(self) -> str:
        """The text that stands for one image in a prompt: the processor's image_token, e.g.
        LLaVA's "<image>"; Qwen2-VL's "<|image_pad|>" between its vision markers (as vLLM's
        Qwen2-VL placeholder)."""
        token = str(self.processor.image_token)
        if token == "<|image_pad|>":
            return "<|vision_start|><|image_pad|><|vision_end|>"
        return token

    @property
    def chat_template(self) -> str | None:
        """The processor's chat template (llava-hf's folders keep it in chat_template.json,
        which only the processor reads, or in chat_template.jinja, which the tokenizer
        reads too)."""
        template = getattr(self.processor, "chat_template", None)
        return template if isinstance(template, str) else None

    def prefetch(self, items: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        """Process many prompts at once on a thread pool (the image processor's PIL and
        numpy work runs outside the GIL), keeping each result, or its error, for the
        `process` call that follows with the same text and multi_modal_data object: an
        offline batch's images are prepared in parallel instead of one by one before the
        first step. `clear_prefetched` drops what was not asked for."""
        if len(items) < 2:
            return
        self.processor  # noqa: B018 (load it once, before the threads)

        def run(item: tuple[str, Mapping[str, Any]]) -> _Processed | Exception:
            try:
                return self._process(*item)
            except Exception as e:  # handed to the process() call that asks for it
                return e

        workers = min(len(items), _PREFETCH_THREADS)
        with ThreadPoolExecutor(workers, thread_name_prefix="mm-prefetch") as pool:
            for (text, mm_data), result in zip(items, pool.map(run, items), strict=True):
                self._prefetched[(text, id(mm_data))] = result

    def clear_prefetched(self) -> None:
        self._prefetched.clear()

    def process(self, text: str, mm_data: Mapping[str, Any]) -> _Processed:
        """(prompt token ids, the images in prompt order). Raises InvalidRequestError naming
        multi_modal_data for an unknown modality, more images than `max_images`, an image
        that is not a PIL image, or a prompt whose image placeholders do not match the
        images given."""
        result = self._prefetched.pop((text, id(mm_data)), None)
        if isinstance(result, Exception):
            raise result
        return result if result is not None else self._process(text, mm_data)

    def _process(self, text: str, mm_data: Mapping[str, Any]) -> _Processed:
        images = _images(mm_data)
        if len(images) > self.max_images:
            raise InvalidRequestError(
                f"multi_modal_data has {len(images)} images, more than limit_mm_per_prompt "
                f'allows ({{"image": {self.max_images}}}); send fewer, or start the engine '
                f"with a higher limit_mm_per_prompt (--limit-mm-per-prompt)",
                "multi_modal_data",
            )
        try:
            out = self.processor(text=text, images=images, return_tensors="np")
            token_ids = [int(t) for t in out["input_ids"][0]]
            pixel_values = np.asarray(out["pixel_values"], dtype=np.float32)
            grids, lengths = self._grids(out, len(images))
            ranges = placeholder_ranges(token_ids, self.image_token_id, len(images), lengths)
        except ValueError as e:  # e.g. 2 "<image>" in the text for 1 image
            raise InvalidRequestError(
                f"multi_modal_data: the prompt and its {len(images)} image(s) do not match: {e}",
                "multi_modal_data",
            ) from None
        grid_of: list[tuple[int, int, int] | None] = [None] * len(ranges)
        if grids is None:  # one [C, H, W] array per image
            per_image = list(pixel_values)
        else:  # the images' patches back to back: each image its grid's t * h * w rows
            bounds = np.cumsum([0] + [t * h * w for t, h, w in grids])
            per_image = [pixel_values[bounds[k] : bounds[k + 1]] for k in range(len(grids))]
            grid_of = list(grids)
        features = tuple(
            MultiModalFeature(pixels, offset, length, hash_pixels(pixels, grid), grid_thw=grid)
            for pixels, (offset, length), grid in zip(per_image, ranges, grid_of, strict=True)
        )
        return token_ids, features

    def _grids(
        self, out: Mapping[str, Any], num_images: int
    ) -> tuple[list[tuple[int, int, int]] | None, list[int] | None]:
        """Each image's patch grid (t, h, w) and number of tokens, t * h * w / merge_size^2,
        where the processor gives `image_grid_thw` (Qwen2-VL); (None, None) otherwise (every
        image the same size). Raises ValueError when the grids do not match the images."""
        if "image_grid_thw" not in out:
            return None, None
        grid_thw = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        if len(grid_thw) != num_images:
            raise ValueError(f"the processor gave {len(grid_thw)} image grids")
        merge = int(self.processor.image_processor.merge_size)
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        return grids, [t * h * w // merge**2 for t, h, w in grids]


def _images(mm_data: Mapping[str, Any]) -> list[Any]:
    """The images of a prompt's multi_modal_data ({"image": img or [img, ...]})."""
    from PIL import Image

    if not isinstance(mm_data, Mapping):
        raise InvalidRequestError(
            f"multi_modal_data must be a dict such as {{'image': image}}, got "
            f"{type(mm_data).__name__}",
            "multi_modal_data",
        )
    unknown = sorted(set(mm_data) - set(SUPPORTED_MODALITIES))
    if unknown:
        raise InvalidRequestError(
            f"multi_modal_data: modality {unknown[0]!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODALITIES)}",
            "multi_modal_data",
        )
    value = mm_data.get("image")
    images = list(value) if isinstance(value, list | tuple) else [value]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(
                f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got "
                f"{type(image).__name__}",
                "multi_modal_data",
            )
    if not images:
        raise InvalidRequestError("multi_modal_data['image'] is empty", "multi_modal_data")
    return images
