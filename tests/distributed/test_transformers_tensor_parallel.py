"""The transformers backend under tensor parallelism (issue 16): linears split by the model's
TP plan (`transformers_backend.tensor_parallel`), TP=2 equal to TP=1, and what is refused."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from pagedserve import LLM, SamplingParams
from pagedserve.distributed.parallel_state import set_tensor_parallel_state
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.models.transformers_backend.tensor_parallel import (
    HFColumnParallelLinear,
    HFRowParallelLinear,
    shard_model,
)

from ._helpers import _COMMON as TINY_SIZES
from ._helpers import CONFIGS, assert_same_outputs, greedy_outputs, save_tiny_model

_COMMON = {**TINY_SIZES, "vocab_size": 512}
# Architectures we have no native code for, each with a TP plan in transformers 5.17 and 5.24:
# Gemma's one KV head is replicated over the 2 ranks; Starcoder2 and GPT-NeoX have biases
# (the row-parallel bias added once); GPT-NeoX's fused per-head query_key_value is "colwise";
# OLMo 2's attention styles (colwise_gather_output / rowwise_split_input) stay replicated
# while its MLP is split.
TP_CONFIGS: dict[str, transformers.PretrainedConfig] = {
    "gemma": transformers.GemmaConfig(**_COMMON, num_key_value_heads=1, head_dim=16),
    "granite": transformers.GraniteConfig(
        **_COMMON,
        num_key_value_heads=2,
        embedding_multiplier=2.0,
        logits_scaling=4.0,
    ),
    "starcoder2": transformers.Starcoder2Config(**_COMMON, num_key_value_heads=2),
    "gpt_neox": transformers.GPTNeoXConfig(**_COMMON, rotary_pct=0.5),
    "olmo2": transformers.Olmo2Config(**_COMMON, num_key_value_heads=2),
}


@pytest.mark.parametrize("name", list(TP_CONFIGS))
def test_tp2_equals_tp1(name: str, tmp_path: Path) -> None:
    """Greedy tokens and their cumulative logprobs at TP=2 equal TP=1's (chunked prefill,
    preemption: `engine_options`)."""
    path = save_tiny_model(TP_CONFIGS[name], tmp_path)
    expected = greedy_outputs(path, model_impl="transformers")
    got = greedy_outputs(path, model_impl="transformers", tensor_parallel_size=2)
    assert_same_outputs(got, expected)


def test_llama_through_transformers_equals_native_at_tp2(tmp_path: Path) -> None:
    path = save_tiny_model("llama_gqa", tmp_path)
    native = greedy_outputs(path, model_impl="pagedserve", tensor_parallel_size=2)
    got = greedy_outputs(path, model_impl="transformers", tensor_parallel_size=2)
    assert_same_outputs(got, native)


def test_dummy_weights_at_tp2(tmp_path: Path) -> None:
    """load_format "dummy": each rank draws its own shards; generation runs to max_tokens."""
    path = save_tiny_model(transformers.PhiConfig(**_COMMON, partial_rotary_factor=0.5), tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with LLM(
        str(path),
        model_impl="transformers",
        load_format="dummy",
        tensor_parallel_size=2,
        device="cpu",
        skip_tokenizer_init=True,
        num_gpu_blocks_override=16,
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 5


def test_model_without_tp_plan_is_refused_before_workers_start(tmp_path: Path) -> None:
    config = transformers.StableLmConfig(**_COMMON, num_key_value_heads=2)
    assert not getattr(config, "base_model_tp_plan", None)
    path = save_tiny_model(config, tmp_path)
    args = EngineArgs(
        model=str(path), model_impl="transformers", device="cpu", tensor_parallel_size=2
    )
    with pytest.raises(ValueError, match="StableLmForCausalLM.*has none.*must be 1, got 2"):
        args.create_engine_config()


@pytest.fixture
def rank_1_of_2() -> Iterator[None]:
    """Layers built in the test are rank 1's of 2 (no process group: nothing runs forward)."""
    set_tensor_parallel_state(1, 2)
    try:
        yield
    finally:
        set_tensor_parallel_state(0, 1)


def _tiny_hf(config: transformers.PretrainedConfig) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
    return model


@pytest.mark.usefixtures("rank_1_of_2")
def test_plan_linears_hold_this_ranks_shard() -> None:
    """colwise -> this rank's output rows, rowwise -> its input columns, a single KV head
    replicated whole; embeddings, norms and the LM head untouched; the initial weights are
    the rank's shard of the original ones (the construction-time probe runs on them)."""
    hf_model = _tiny_hf(TP_CONFIGS["gemma"])
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    embedding, lm_head = hf_model.model.embed_tokens, hf_model.lm_head
    shard_model(hf_model, "model")
    attn, mlp = hf_model.model.layers[0].self_attn, hf_model.model.layers[0].mlp
    assert isinstance(attn.q_proj, HFColumnParallelLinear)
    assert isinstance(attn.o_proj, HFRowParallelLinear)
    assert isinstance(mlp.gate_proj, HFColumnParallelLinear)
    assert isinstance(mlp.down_proj, HFRowParallelLinear)
    assert hf_model.lm_head is lm_head and hf_model.model.embed_tokens is embedding
    prefix = "model.layers.0."
    q = original[prefix + "self_attn.q_proj.weight"]  # [4 heads * 16, 64]
    assert torch.equal(attn.q_proj.weight, q[32:])
    assert torch.equal(attn.k_proj.weight, original[prefix + "self_attn.k_proj.weight"])
    assert attn.k_proj.out_features == 16  # the one KV head, whole
    assert torch.equal(attn.o_proj.weight, original[prefix + "self_attn.o_proj.weight"][:, 32:])
    assert torch.equal(mlp.up_proj.weight, original[prefix + "mlp.up_proj.weight"][64:])
    assert (attn.q_proj.in_features, attn.q_proj.out_features) == (64, 32)


@pytest.mark.usefixtures("rank_1_of_2")
def test_replicating_styles_keep_modules_whole() -> None:
    """OLMo 2's q/k/v are colwise_gather_output and o_proj rowwise_split_input (the same
    result as unsplit layers): they stay nn.Linear; its MLP is split."""
    hf_model = _tiny_hf(TP_CONFIGS["olmo2"])
    shard_model(hf_model, "model")
    layer = hf_model.model.layers[1]
    assert type(layer.self_attn.q_proj) is nn.Linear
    assert type(layer.self_attn.o_proj) is nn.Linear
    assert isinstance(layer.mlp.gate_proj, HFColumnParallelLinear)
    assert isinstance(layer.mlp.down_proj, HFRowParallelLinear)


@pytest.mark.usefixtures("rank_1_of_2")
def test_unsupported_styles_and_no_plan_are_refused() -> None:
    mixtral = transformers.MixtralConfig(
        **_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    )
    moe = _tiny_hf(mixtral)
    # Up to transformers 5.24 Mixtral's own plan split its fused experts with this style; 5.25
    # leaves them out of the TP plan (replicated), so the style is set here.
    moe.config.base_model_tp_plan = {
        **(mixtral.base_model_tp_plan or {}),
        "layers.*.mlp.experts": "moe_tp_experts",
    }
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts .*'moe_tp_experts'"):
        shard_model(moe, "model")
    with pytest.raises(ValueError, match="StableLmForCausalLM has no tensor-parallel plan"):
        shard_model(_tiny_hf(transformers.StableLmConfig(**_COMMON)), "model")
    uneven = transformers.LlamaConfig(**{**_COMMON, "intermediate_size": 99})
    with pytest.raises(ValueError, match=r"mlp\.gate_proj \(colwise\).*not divisible"):
        shard_model(_tiny_hf(uneven), "model")


def test_native_configs_shared_with_native_tests_have_plans() -> None:
    assert transformers.LlamaConfig.base_model_tp_plan  # the Llama comparison above needs it
    assert "llama_gqa" in CONFIGS
