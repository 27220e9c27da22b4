"""Vision-language models on a GPU: tiny random LLaVA-1.5 and Qwen2.5-VL (the CPU tests'
models) on CUDA in float32, with CUDA graphs for decode and async scheduling (the CUDA
defaults), give transformers' greedy tokens (transformers on the CPU, float32); in bfloat16
they run end to end. Qwen2.5-VL's decode graphs take [3, batch] M-RoPE positions."""

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve import LLM
from tests.models import tiny_llava, tiny_qwen2_5_vl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def engine(model: Path, dtype: str) -> LLM:
    return LLM(str(model), dtype=dtype, device="cuda", max_model_len=256,
               num_gpu_blocks_override=64)  # fmt: skip


def greedy(llm: LLM, prompt: str, images: list[Any], params: Any) -> list[int]:
    data = {"image": images[0] if len(images) == 1 else images}
    [output] = llm.generate({"prompt": prompt, "multi_modal_data": data}, params)
    return list(output.outputs[0].token_ids)


def test_qwen2_5_vl_on_cuda(tmp_path: Path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.models.test_qwen2_5_vl import hf_greedy

    tiny = tiny_qwen2_5_vl
    tiny.build_tiny_qwen2_5_vl(tmp_path)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    cases = [(tiny.ONE, [tiny.image(1)]), (tiny.TWO, [tiny.image(1), tiny.wide_image(2)])]
    llm = engine(tmp_path, "float32")
    assert llm.llm_engine.engine_core.executor.worker.runner.cuda_graphs is not None
    for prompt, images in cases:
        assert greedy(llm, prompt, images, tiny.GREEDY) == hf_greedy(hf, tmp_path, prompt, images)
    llm.llm_engine.shutdown()
    llm = engine(tmp_path, "bfloat16")
    assert len(greedy(llm, *cases[1], tiny.GREEDY)) == tiny.MAX_TOKENS


def test_llava_on_cuda(tmp_path: Path) -> None:
    from tests.models.test_llava import hf_greedy

    tiny = tiny_llava
    tiny.build_tiny_llava(tmp_path)
    cases = [(tiny.ONE, [tiny.image(1)]), (tiny.TWO, [tiny.image(1), tiny.image(2)])]
    llm = engine(tmp_path, "float32")
    for prompt, images in cases:
        assert greedy(llm, prompt, images, tiny.GREEDY) == hf_greedy(tmp_path, prompt, images)
    llm.llm_engine.shutdown()
    llm = engine(tmp_path, "bfloat16")
    assert len(greedy(llm, *cases[1], tiny.GREEDY)) == tiny.MAX_TOKENS
