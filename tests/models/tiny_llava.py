"""A tiny random LLaVA-1.5 model folder with its real processor, for the model's offline tests
and the server's: sentencepiece-32k with "<image>" added, CLIPImageProcessorPil on 28-px images
(2x2 patches of 14 px: 4 tokens per image) and llava-hf's chat template."""

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pagedserve import SamplingParams

SHARED = Path(__file__).resolve().parents[3] / "shared"
# PAGEDSERVE_TEST_TOKENIZERS: a copy of ../shared/tokenizers (the GPU machine has no ../shared)
TOKENIZERS = Path(os.environ.get("PAGEDSERVE_TEST_TOKENIZERS", SHARED / "tokenizers"))
TOKENIZER = TOKENIZERS / "sentencepiece-32k"
TEXT_MODEL = SHARED / "models" / "tinystories-656k"
IMAGE_TOKEN_ID = 32000  # "<image>" added to the 32000-token tokenizer
IMAGE_SIZE, PATCH_SIZE = 28, 14  # 2x2 patches: 4 tokens per image ("default" drops CLS)
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ONE = "USER: <image>\nWhat is in this picture? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nHow do they differ? ASSISTANT:"

# llava-hf/llava-1.5-7b-hf's processor template (its {% generation %} markers left out): per
# message, "ROLE: ", an "<image>\n" for each image part, then each text part and a space.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build_tiny_llava(path: Path) -> None:
    """Save a seeded random LLaVA and its processor (with CHAT_TEMPLATE) into `path`. The
    lm_head is scaled so that greedy picks are not decided by near-ties, and the projector
    so that the image changes the output."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    assert image_token_id == IMAGE_TOKEN_ID
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    text = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32064,  # as llava-1.5: the tokenizer's 32001 padded
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
        model.model.multi_modal_projector.linear_2.weight.mul_(20.0)
    model.save_pretrained(str(path))
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(path))


def image(seed: int) -> Image.Image:
    """A seeded random 50x40 RGB image (the processor resizes and crops it to 28x28)."""
    pixels = np.random.RandomState(seed).randint(0, 256, (40, 50, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
