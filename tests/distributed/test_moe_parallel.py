"""Mixture-of-experts models over two ranks (worker processes, gloo): tensor parallelism
(each expert split) and expert parallelism (whole experts per rank) give one rank's greedy
tokens and logprobs, for the tiny models of tests/models/test_moe_models.py (Qwen2-MoE's
shared expert and dense layer stay tensor-parallel under expert parallelism)."""

import json
from pathlib import Path

import pytest
import transformers

from pagedserve import LLM
from tests.models.test_moe_models import save_moe_models

from ._helpers import _COMMON, assert_same_outputs, greedy_outputs

CASES = [("mixtral", False), ("mixtral", True), ("qwen2_moe", True), ("qwen3_moe", False)]
CASES += [("qwen3_moe", True)]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: path for name, (_, path) in save_moe_models(tmp_path_factory).items()}


@pytest.fixture(scope="module")
def single_rank(model_paths: dict[str, Path]) -> dict[str, list[tuple[list[int], float]]]:
    return {name: greedy_outputs(path) for name, path in model_paths.items()}


@pytest.mark.parametrize(("name", "expert_parallel"), CASES)
def test_two_ranks_match_one(
    name: str,
    expert_parallel: bool,
    model_paths: dict[str, Path],
    single_rank: dict[str, list[tuple[list[int], float]]],
) -> None:
    got = greedy_outputs(
        model_paths[name], tensor_parallel_size=2, enable_expert_parallel=expert_parallel
    )
    assert_same_outputs(got, single_rank[name])


def test_experts_not_divisible_by_ranks_are_refused(tmp_path: Path) -> None:
    """3 experts over 2 expert-parallel ranks: refused before any worker starts, naming the
    counts and the option; without expert parallelism an expert intermediate size of 33 is."""
    moe = dict(_COMMON, num_key_value_heads=2)
    config = transformers.MixtralConfig(**moe, num_local_experts=3, num_experts_per_tok=2)
    config.architectures = ["MixtralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    options = dict(
        load_format="dummy", device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2
    )
    with pytest.raises(ValueError, match=r"num_experts \(3\) is not divisible by "
                       r"tensor_parallel_size \(2\): expert parallelism"):  # fmt: skip
        LLM(str(tmp_path), enable_expert_parallel=True, **options)
    uneven = transformers.Qwen3MoeConfig(**moe, moe_intermediate_size=33, num_experts=4)
    uneven.architectures = ["Qwen3MoeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(uneven.to_dict()))
    with pytest.raises(ValueError, match=r"intermediate size \(33\).*enable_expert_parallel"):
        LLM(str(tmp_path), **options)
