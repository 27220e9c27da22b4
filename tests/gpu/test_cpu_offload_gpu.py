"""CPU weight offload on a GPU (`cpu_offload_gb`): the offloaded layers' weights sit in pinned
CPU memory between forwards, the device holds less, and greedy output (async scheduling, the
CUDA default) equals the run without offload."""

import os
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MODELS = Path(
    os.environ.get(
        "PAGEDSERVE_TEST_MODELS", Path(__file__).resolve().parents[3] / "shared" / "models"
    )
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offloaded_layers_live_in_pinned_memory() -> None:
    model = str(MODELS / "stories260k")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "The little dog", "Lily wanted to"] * 4
    llm = LLM(model, max_model_len=256, num_gpu_blocks_override=64, dtype="bfloat16")
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm

    llm = LLM(
        model,
        max_model_len=256,
        num_gpu_blocks_override=64,
        dtype="bfloat16",
        cpu_offload_gb=3e-4,  # 322 KB: 4 of stories260k's 5 layers (90,880 bytes each in bf16)
    )
    runner = llm.llm_engine.engine_core.executor.worker.runner
    offload = runner.model.cpu_offloader
    assert runner.cuda_graphs is None  # hooks around each layer: eager
    assert len(offload.modules) == 4
    for module in offload.modules:
        for param in module.parameters():
            assert param.device.type == "cpu" and param.is_pinned()
    on_device = [p for p in runner.model.parameters() if p.device.type == "cuda"]
    assert on_device and runner.model.model.layers[4].self_attn.qkv_proj.weight.is_cuda
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs == expected
