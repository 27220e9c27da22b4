"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers: greedy
generation and logits, routing, loading of per-expert and stacked expert tensors, and the
tensor- / expert-parallel split of FusedMoE checked on one process."""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from pagedserve import LLM, SamplingParams
from pagedserve.distributed.parallel_state import set_tensor_parallel_state
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.moe.layer import FusedMoE
from pagedserve.layers.moe.reference import moe_reference
from pagedserve.layers.moe.routing import renormalizes_topk, select_experts
from pagedserve.models.loader import load_model
from pagedserve.models.registry import check_model_impl, get_model_class

from .test_models import _bind_kv_caches, _check_prefill_and_decode, _randomize
from .test_transformers_backend import (
    CACHED_PROMPT,
    LLM_OPTIONS,
    MAX_TOKENS,
    PROMPTS,
    _hf_greedy,
)

CPU = torch.device("cpu")
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
# Each routing rule and layer pattern: Mixtral renormalises always; Qwen2-MoE here does not
# (norm_topk_prob False) and has a dense layer 1 (mlp_only_layers) and its shared expert;
# Qwen3-MoE renormalises (norm_topk_prob True) with sparse layers 1 only (decoder_sparse_step
# 2) and top-3 of 8.
CONFIGS: dict[str, PretrainedConfig] = {
    "mixtral": transformers.MixtralConfig(
        **{**_COMMON, "intermediate_size": 32},
        num_local_experts=4,
        num_experts_per_tok=2,
        architectures=["MixtralForCausalLM"],
    ),
    "qwen2_moe": transformers.Qwen2MoeConfig(
        **_COMMON,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        architectures=["Qwen2MoeForCausalLM"],
    ),
    "qwen3_moe": transformers.Qwen3MoeConfig(
        **_COMMON,
        head_dim=32,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        architectures=["Qwen3MoeForCausalLM"],
    ),
}


def _make_moe_hf_model(config: PretrainedConfig, seed: int = 0) -> nn.Module:
    """A tiny transformers model with O(1) activations (`_randomize`), its stacked expert
    weights scaled by their input width (as the 2-D weights are), eager attention."""
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    _randomize(hf_model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.dim() == 3:  # gate_up_proj [E, 2I, H], down_proj [E, H, I]
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(noise / math.sqrt(param.shape[-1]))
    return hf_model.eval()


def save_moe_models(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[nn.Module, Path]]:
    """Every model of CONFIGS (`_make_moe_hf_model`) saved with save_pretrained: case ->
    (transformers model, folder). Also used by the distributed and GPU MoE tests."""
    models = {}
    for case, config in CONFIGS.items():
        hf_model = _make_moe_hf_model(config)
        path = tmp_path_factory.mktemp(case)
        hf_model.save_pretrained(path)
        models[case] = (hf_model, path)
    return models


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, Path]]:
    return save_moe_models(tmp_path_factory)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_greedy_equals_transformers_generate(
    case: str, saved: dict[str, tuple[nn.Module, Path]]
) -> None:
    """Native model (model_impl auto picks it), continuous batching of 4 prompts, chunked
    prefill (budget 16 < 37 tokens), then a prefix-cache hit: every token equals
    transformers' greedy `generate`."""
    hf_model, path = saved[case]
    assert check_model_impl(hf_model.config, "auto") == "pagedserve"
    llm = LLM(str(path), **LLM_OPTIONS)
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    assert type(model).__name__ == CONFIGS[case].architectures[0]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        _hf_greedy(hf_model, p) for p in PROMPTS
    ]
    again = llm.generate({"prompt_token_ids": CACHED_PROMPT}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 24
    assert list(again.outputs[0].token_ids) == _hf_greedy(hf_model, CACHED_PROMPT)
    llm.llm_engine.shutdown()


def test_transformers_backend_points_to_native_code(
    saved: dict[str, tuple[nn.Module, Path]],
) -> None:
    """model_impl "transformers" still cannot load per-expert tensors; its error now says
    that the default runs the architecture natively."""
    with pytest.raises(
        UnsupportedModelError, match=r"model_impl 'auto' runs native architectures, e\.g\. Mixtral"
    ):
        LLM(str(saved["mixtral"][1]), model_impl="transformers", **LLM_OPTIONS)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_logits_equal_transformers(case: str, saved: dict[str, tuple[nn.Module, Path]]) -> None:
    """A batched paged prefill and decode step: logits within 1e-4 of transformers'."""
    hf_model, path = saved[case]
    model = load_model(str(path), AutoConfig.from_pretrained(path), torch.float32, CPU)
    _check_prefill_and_decode(hf_model, model, hf_model.config.vocab_size)


def test_layer_patterns_follow_the_config(saved: dict[str, tuple[nn.Module, Path]]) -> None:
    """Qwen2-MoE's mlp_only_layers [1] and Qwen3-MoE's decoder_sparse_step 2 give dense MLPs
    exactly where transformers has them; Qwen2-MoE's q/k/v carry biases."""
    for case, dense in (("qwen2_moe", [False, True, False]), ("qwen3_moe", [True, False, True])):
        model = load_model("unused", CONFIGS[case], torch.float32, CPU, load_format="dummy")
        ours = [not hasattr(layer.mlp, "experts") for layer in model.model.layers]
        hf_layers = saved[case][0].model.layers
        assert ours == [not hasattr(layer.mlp, "experts") for layer in hf_layers] == dense
    qwen2 = load_model("unused", CONFIGS["qwen2_moe"], torch.float32, CPU, load_format="dummy")
    assert qwen2.model.layers[0].self_attn.qkv_proj.bias is not None


def test_qwen2_moe_without_shared_expert(tmp_path: Path) -> None:
    """shared_expert_intermediate_size 0 means no shared expert: transformers builds a
    zero-width one (output 0) and save_pretrained writes its empty projections and its gate;
    ours has none, loads that checkpoint, and gives transformers' greedy tokens and logits."""
    from safetensors import safe_open

    config = transformers.Qwen2MoeConfig(
        **{**CONFIGS["qwen2_moe"].to_dict(), "shared_expert_intermediate_size": 0}
    )
    hf_model = _make_moe_hf_model(config)
    hf_model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.shared_expert.gate_proj.weight").numel() == 0
        assert "model.layers.0.mlp.shared_expert_gate.weight" in set(f.keys())

    llm = LLM(str(tmp_path), **LLM_OPTIONS)
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    sparse = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(sparse) == 2
    assert all(b.shared_expert is None and b.shared_expert_gate is None for b in sparse)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        _hf_greedy(hf_model, p) for p in PROMPTS
    ]
    llm.llm_engine.shutdown()
    model = load_model(str(tmp_path), AutoConfig.from_pretrained(tmp_path), torch.float32, CPU)
    _check_prefill_and_decode(hf_model, model, config.vocab_size)


def test_qwen2_moe_shared_expert_weights_without_one_are_refused(
    saved: dict[str, tuple[nn.Module, Path]], tmp_path: Path
) -> None:
    """Only the empty projections (and gate) of an absent shared expert are skipped: a real
    shared expert's weights under a config of size 0 are a mismatch, named; a negative size
    is refused."""
    path = saved["qwen2_moe"][1]
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    config = {**CONFIGS["qwen2_moe"].to_dict(), "shared_expert_intermediate_size": 0}
    with pytest.raises(UnsupportedModelError, match=r"mlp\.shared_expert\..*matches no model"):
        load_model(str(tmp_path), transformers.Qwen2MoeConfig(**config), torch.float32, CPU)
    config["shared_expert_intermediate_size"] = -1
    with pytest.raises(UnsupportedModelError, match="shared_expert_intermediate_size must be"):
        load_model(
            "unused", transformers.Qwen2MoeConfig(**config), torch.float32, CPU, load_format="dummy"
        )


@pytest.mark.parametrize("case", list(CONFIGS))
def test_renormalisation_matters(case: str, saved: dict[str, tuple[nn.Module, Path]]) -> None:
    """Negative control: the logits comparison sees the routing rule (the opposite
    renormalisation moves the logits by far more than the tolerance)."""
    hf_model, path = saved[case]
    model = load_model(str(path), AutoConfig.from_pretrained(path), torch.float32, CPU)
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.renormalize = not module.renormalize
    with pytest.raises(AssertionError):
        _check_prefill_and_decode(hf_model, model, hf_model.config.vocab_size)


def _router(config: PretrainedConfig) -> nn.Module:
    kinds = {
        "mixtral": transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter,
        "qwen2_moe": transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter,
        "qwen3_moe": transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter,
    }
    router: nn.Module = kinds[config.model_type](config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator()))
    return router


@pytest.mark.parametrize(
    ("case", "norm_topk_prob"),
    [("mixtral", None), ("qwen2_moe", False), ("qwen2_moe", True), ("qwen3_moe", False)]
    + [("qwen3_moe", True)],
)
def test_routing_equals_transformers_router(case: str, norm_topk_prob: bool | None) -> None:
    """select_experts(logits, k, renormalizes_topk(config)) gives transformers' router's top-k
    ids and weights: Mixtral renormalised always, Qwen by norm_topk_prob."""
    config = CONFIGS[case]
    if norm_topk_prob is not None:
        config = type(config)(**{**config.to_dict(), "norm_topk_prob": norm_topk_prob})
    torch.manual_seed(0)
    router = _router(config)
    hidden = torch.randn(50, config.hidden_size)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    renormalize = renormalizes_topk(config)
    assert renormalize == (case == "mixtral" or bool(norm_topk_prob))
    weights, ids = select_experts(logits, config.num_experts_per_tok, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (50, config.num_experts_per_tok)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=1e-6, rtol=0)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(50)) == renormalize


def test_routing_refuses_bad_top_k() -> None:
    with pytest.raises(ValueError, match=r"top_k \(5\) must be in \[1, num_experts=4\]"):
        select_experts(torch.zeros(2, 4), 5, True)


def test_stacked_expert_tensors_load(
    saved: dict[str, tuple[nn.Module, Path]], tmp_path: Path
) -> None:
    """A state dict saved as transformers 5 holds it in memory (`mlp.experts.gate_up_proj`
    [E, 2I, H] / `down_proj` [E, H, I], Mixtral's under `mlp.` too) loads as well as the
    per-expert tensors save_pretrained writes."""
    for case in ("mixtral", "qwen2_moe"):
        hf_model, path = saved[case]
        state = hf_model.state_dict()
        assert "model.layers.0.mlp.experts.gate_up_proj" in state
        folder = tmp_path / case
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
        (folder / "config.json").write_text((path / "config.json").read_text())
        model = load_model(str(folder), AutoConfig.from_pretrained(folder), torch.float32, CPU)
        _check_prefill_and_decode(hf_model, model, hf_model.config.vocab_size)


def test_save_pretrained_writes_per_expert_tensors(
    saved: dict[str, tuple[nn.Module, Path]],
) -> None:
    """What the loader must read: transformers' save_pretrained writes real checkpoints'
    names (Mixtral `block_sparse_moe.experts.{e}.w1`, Qwen `mlp.experts.{e}.gate_proj`)."""
    from safetensors import safe_open

    expected = {
        "mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "qwen2_moe": "model.layers.0.mlp.experts.5.gate_proj.weight",
        "qwen3_moe": "model.layers.1.mlp.experts.7.up_proj.weight",
    }
    for case, name in expected.items():
        with safe_open(str(saved[case][1] / "model.safetensors"), "pt") as f:
            assert name in set(f.keys())


def test_missing_expert_tensor_is_named(
    saved: dict[str, tuple[nn.Module, Path]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    path = saved["mixtral"][1]
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.experts: expert 2 w3"):
        load_model(str(tmp_path), CONFIGS["mixtral"], torch.float32, CPU)


def test_quantized_moe_is_refused() -> None:
    """No quantized experts yet: the config check names the method and the architecture."""
    for case, config in CONFIGS.items():
        with pytest.raises(NotImplementedError, match=f"{config.architectures[0]} with "
                           r"quantization 'gptq' is not supported yet"):  # fmt: skip
            check_model_impl(config, "auto", 1, "gptq")
        assert check_model_impl(config, "auto") == "pagedserve", case


@pytest.mark.parametrize("case", list(CONFIGS))
def test_dummy_weights_give_finite_logits(case: str) -> None:
    model = load_model("unused", CONFIGS[case], torch.bfloat16, CPU, load_format="dummy")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _bind_kv_caches(model, num_blocks=4)
    for module in model.modules():
        if hasattr(module, "kv_cache"):
            module.kv_cache = module.kv_cache.to(torch.bfloat16)
    from ._metadata import build_step

    positions, metadata = build_step([0, 0], [3, 5], [[1], [3, 2]], 4)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.arange(8), positions, metadata))
    assert logits.shape == (8, 256) and torch.isfinite(logits).all()
    assert get_model_class(CONFIGS[case].architectures) is type(model)


# FusedMoE's tensor- and expert-parallel split, checked on one process: each rank's layer is
# built and loaded in turn and the all-reduce replaced by the identity, so that the ranks'
# partial outputs can be summed by hand.


@contextmanager
def _as_rank(tp_rank: int, tp_size: int, expert_parallel: bool) -> Iterator[None]:
    set_tensor_parallel_state(tp_rank, tp_size, expert_parallel)
    try:
        yield
    finally:
        set_tensor_parallel_state(0, 1)


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize(("tp_size", "expert_parallel"), [(2, False), (4, False), (2, True)])
def test_fused_moe_split_sums_to_one_rank(
    tp_size: int,
    expert_parallel: bool,
    layout: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Each rank loads its part (per-expert tensors, or lazy `SafetensorsSlice` views of the
    stacked ones, as a tensor-parallel load reads them) and the ranks' outputs sum to the
    reference over all experts."""
    from safetensors import safe_open

    from pagedserve.models.loader import SafetensorsSlice

    monkeypatch.setattr("pagedserve.layers.moe.layer.tensor_model_parallel_all_reduce", lambda x: x)
    num_experts, top_k, hidden, inter = 4, 2, 16, 24
    generator = torch.Generator().manual_seed(0)
    gate, up = torch.randn(2, num_experts, inter, hidden, generator=generator)
    down = torch.randn(num_experts, hidden, inter, generator=generator)
    x = torch.randn(7, hidden, generator=generator)
    logits = torch.randn(7, num_experts, generator=generator)
    weights, ids = select_experts(logits, top_k, True)
    expected = moe_reference(x, torch.cat([gate, up], 1), down, weights, ids)
    save_file({"gate_up": torch.cat([gate, up], 1), "down": down}, tmp_path / "e.safetensors")
    total = torch.zeros_like(expected)
    starts = []
    for rank in range(tp_size):
        with _as_rank(rank, tp_size, expert_parallel):
            layer = FusedMoE(num_experts, top_k, hidden, inter, renormalize=True)
        if layout == "stacked":
            with safe_open(str(tmp_path / "e.safetensors"), "pt") as f:
                for name, which in (("gate_up", "w13"), ("down", "w2")):
                    view = SafetensorsSlice(f.get_slice(name))
                    layer.load_fused_weight(view, which)  # type: ignore[arg-type]
        else:
            for e in range(num_experts):
                for shard, tensor in (("w1", gate[e]), ("w3", up[e]), ("w2", down[e])):
                    assert layer.load_expert_weight(tensor, e, shard) == layer.is_local(e)
        assert layer.missing_weights() == []
        starts.append(layer.expert_start)
        total += layer(x, logits)
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)
    if expert_parallel:  # whole experts, two per rank
        assert starts == [0, 2] and layer.w13_weight.shape == (2, 2 * inter, hidden)
    else:
        assert starts == [0] * tp_size
        assert layer.w2_weight.shape == (num_experts, hidden, inter // tp_size)


def test_expert_parallel_needs_divisible_experts() -> None:
    with _as_rank(0, 4, True), pytest.raises(ValueError, match=r"num_experts \(6\).*\(.*4\)"):
        FusedMoE(6, 2, 16, 24, renormalize=True)
    with _as_rank(0, 4, False), pytest.raises(ValueError, match=r"intermediate size \(6\)"):
        FusedMoE(4, 2, 16, 6, renormalize=True)
