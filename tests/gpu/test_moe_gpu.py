"""MoE models on the GPU (the fused MoE kernel inside the engine, CUDA graphs included):
greedy tokens equal the CPU reference path's, on one GPU and over two (TP=2, EP=2)."""

from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.models.test_moe_models import CONFIGS, save_moe_models

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 5, 7, 9, 11, 3, 2], list(range(3, 40)), [5, 6], [*range(3, 30), 7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: path for name, (_, path) in save_moe_models(tmp_path_factory).items()}


def _generate(path: Path, **options: object) -> list[list[int]]:
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        skip_tokenizer_init=True,
        **options,  # type: ignore[arg-type]
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_moe_greedy_equals_cpu(name: str, model_paths: dict[str, Path]) -> None:
    cpu = _generate(model_paths[name], device="cpu")
    assert _generate(model_paths[name], device="cuda") == cpu  # CUDA graphs
    assert _generate(model_paths[name], device="cuda", enforce_eager=True) == cpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_gpus_moe_equal_one(expert_parallel: bool, model_paths: dict[str, Path]) -> None:
    path = model_paths["qwen3_moe"]
    one = _generate(path, device="cuda")
    two = _generate(
        path, device="cuda", tensor_parallel_size=2, enable_expert_parallel=expert_parallel
    )
    assert two == one
