"""Qwen2.5-VL through a real server process (tests/models/tiny_qwen2_5_vl.py): a chat with two
data-URL images of different sizes gives the offline LLM.generate's greedy text for the same
rendered prompt and images."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve import LLM
from tests.models.tiny_qwen2_5_vl import (
    GREEDY,
    MAX_TOKENS,
    build_tiny_qwen2_5_vl,
    image,
    wide_image,
)

from .conftest import Server
from .test_llava_server import CHAT_PARAMS, IGNORE_EOS, data_url, image_part, text_part, user

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
RENDERED = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    f"<|im_start|>user\n{IMAGE}How do they differ?{IMAGE}<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2_5_vl")
    build_tiny_qwen2_5_vl(path)
    return path


@pytest.fixture(scope="module")
def server(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--dtype", "float32", "--max-model-len", "256"]
    log = tmp_path_factory.mktemp("qwen2_5_vl-server") / "server.log"
    running = Server(qwen_dir, log, None, args)
    try:
        yield running
    finally:
        running.stop()


def test_chat_with_data_url_images_equals_offline_generate(server: Server, qwen_dir: Path) -> None:
    """usage's prompt_tokens counts each image's own number of tokens (4 and 12)."""
    images = [wide_image(2), image(3)]
    llm = LLM(str(qwen_dir), dtype="float32", device="cpu", max_model_len=256,
              num_gpu_blocks_override=64)  # fmt: skip
    [expected] = llm.generate(
        {"prompt": RENDERED, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False
    )
    messages = user(
        image_part(data_url(images[0])),
        text_part("How do they differ?"),
        image_part(data_url(images[1])),
    )
    response = server.client().chat.completions.create(
        model=server.model, messages=messages, extra_body=IGNORE_EOS, **CHAT_PARAMS
    )
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.completion_tokens == MAX_TOKENS
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert len(expected.prompt_token_ids) == len(llm.get_tokenizer().encode(RENDERED)) + 3 + 11
