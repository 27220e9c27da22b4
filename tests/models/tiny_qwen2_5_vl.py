"""A tiny random Qwen2.5-VL model folder with its real processor, for the model's offline tests
and the server's: the Qwen3 tokenizer (it has the Qwen vision tokens), Qwen2VLImageProcessorPil
(no torchvision) on small images (14-px patches merged 2x2: a 56x56 image is 4 tokens, a
112x84 one 12) and Qwen2.5-VL's chat template (image parts only)."""

import json
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pagedserve import SamplingParams

SHARED = Path(__file__).resolve().parents[3] / "shared"
# PAGEDSERVE_TEST_TOKENIZERS: a copy of ../shared/tokenizers (the GPU machine has no ../shared)
TOKENIZERS = Path(os.environ.get("PAGEDSERVE_TEST_TOKENIZERS", SHARED / "tokenizers"))
TOKENIZER = TOKENIZERS / "qwen3"
VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID, VIDEO_TOKEN_ID = 151652, 151655, 151653, 151656
PATCH_SIZE, MERGE_SIZE = 14, 2
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"<|im_start|>user\n{IMAGE}What is in this picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE}and {IMAGE}How do they differ?<|im_end|>\n<|im_start|>assistant\n"

# Qwen/Qwen2.5-VL-7B-Instruct's template without its video branch and vision ids.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2_5_vl(path: Path) -> None:
    """Save a seeded random Qwen2.5-VL and its processor (with CHAT_TEMPLATE) into `path`.
    Vision: 4 blocks, full attention in 1 and 3, 56-px windows (2x2 merged tokens): a 112x84
    image spans several windows. Text: head_dim 16, mrope_section [2, 3, 3]. The lm_head is
    scaled so that greedy picks are not decided by near-ties, the merger so that the image
    changes the output, and q/k so that attention (hence M-RoPE's positions) does too."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS]
    assert ids == [VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID, VIDEO_TOKEN_ID]
    config = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=4,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=PATCH_SIZE,
            spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1, 3],
        ),
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=151680,  # the tokenizer's 151669, padded
            max_position_embeddings=512,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            rope_theta=10000.0,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
        model.model.visual.merger.mlp[2].weight.mul_(20.0)
        for layer in model.model.language_model.layers:  # sharp attention: positions matter
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.save_pretrained(str(path))
    # Qwen2_5_VLProcessor cannot be built without torchvision (its video processor): the
    # folder gets what it saves for images, the tokenizer with the template and the image
    # processor naming the processor class (as Qwen/Qwen2.5-VL-* folders do).
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        min_pixels=56 * 56,
        max_pixels=112 * 112,
    )
    image_processor.save_pretrained(str(path))
    config_path = path / "preprocessor_config.json"
    processor_config = json.loads(config_path.read_text())
    processor_config["processor_class"] = "Qwen2_5_VLProcessor"
    processor_config["image_processor_type"] = "Qwen2VLImageProcessor"
    config_path.write_text(json.dumps(processor_config))


IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def image(seed: int, width: int = 56, height: int = 56) -> Image.Image:
    """A seeded random RGB image; sizes that are multiples of 28 keep their size through the
    processor (56x56: 4 tokens; 112x84: 4x3 merged, 12 tokens)."""
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def wide_image(seed: int) -> Image.Image:
    """112 wide, 84 high: a grid with h != w, over several attention windows."""
    return image(seed, 112, 84)
