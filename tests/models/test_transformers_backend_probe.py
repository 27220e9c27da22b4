"""The transformers backend's construction-time probe: what a model's own code does that paged
attention cannot (attention sinks, two attentions per layer, state kept between steps, masks
that are no causal sliding window) is refused at load instead of giving other tokens than
transformers; a window that a model puts only in its mask is applied; causal LMs whose logits
code reaches into the base model (OPT's `model.decoder`, GPT-2's cross attentions) run."""

from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from transformers import masking_utils

from pagedserve import LLM
from pagedserve.attention.torch_backend import TorchAttentionBackend
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.attention import Attention
from pagedserve.models.transformers_backend.model import TransformersForCausalLM
from pagedserve.models.transformers_backend.probe import mask_window

from ._metadata import build_step
from .test_models import _make_hf_model
from .test_transformers_backend import (
    _COMMON,
    LLM_OPTIONS,
    PROMPTS,
    _greedy,
    _hf_greedy,
    _save_tiny,
)

_SMALL = dict(_COMMON, num_key_value_heads=2, head_dim=16)


def _build(config: transformers.PretrainedConfig) -> TransformersForCausalLM:
    config.architectures = [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]
    with torch.device("cpu"):
        return TransformersForCausalLM(config)


def test_attention_sinks_are_refused() -> None:
    """GPT-OSS passes its sinks as `s_aux`; dropping them changed the 8th greedy token of a
    12-token prompt (and the first step crashed on the logits head's `router_logits`)."""
    config = transformers.GptOssConfig(
        **_SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=128
    )
    with pytest.raises(UnsupportedModelError, match="GptOssAttention passes s_aux"):
        _build(config)


def test_a_layer_attending_twice_is_refused() -> None:
    """DiffLlama calls attention twice per layer with two value tensors: the paged cache keeps
    one, so later steps would read the second call's values for both."""
    with pytest.raises(UnsupportedModelError, match="more than once per forward"):
        _build(transformers.DiffLlamaConfig(**_SMALL))


@pytest.mark.parametrize("case", ["falcon_h1", "minimax"])
def test_state_outside_attention_is_refused(case: str) -> None:
    """Falcon-H1's Mamba mixers (beside attention in every layer) and MiniMax's linear-
    attention layers (here after a full-attention layer 0, so that layers 0..N-1 of the
    attention calls look complete) keep a recurrent state that the backend never carries from
    one step to the next: feeding 3 + 3 tokens differs from 6 at once. Both ran before and
    gave other logits than transformers."""
    if case == "falcon_h1":
        config: transformers.PretrainedConfig = transformers.FalconH1Config(**_SMALL)
    else:
        config = transformers.MiniMaxConfig(
            **_SMALL,
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=["full_attention", "linear_attention"],
        )
    with pytest.raises(UnsupportedModelError, match="in two steps than in one"):
        _build(config)


def test_window_only_in_the_mask_is_applied() -> None:
    """PhiMoE puts its sliding window only in the mask transformers builds (no `sliding_window`
    argument to the attention call): the probe reads it there, and the logits of an 11-token
    prompt (window 6) equal transformers' eager attention."""
    config = transformers.PhimoeConfig(
        **_SMALL, num_local_experts=2, num_experts_per_tok=1, sliding_window=6
    )
    model = _build(config).eval()
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [layer.sliding_window for layer in layers] == [6, 6]
    hf_model = _make_hf_model(config)
    model.load_state_dict(hf_model.state_dict(), strict=False)
    for layer in layers:
        layer.kv_cache = torch.zeros(2, 4, 4, layer.num_kv_heads, layer.head_dim)
        layer.backend = TorchAttentionBackend()
    prompt = list(range(7, 18))
    positions, metadata = build_step([0], [11], [[1, 2, 3]], block_size=4)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(prompt), positions, metadata))
        expected = hf_model(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_mask_window_reads_transformers_predicates() -> None:
    assert mask_window(masking_utils.causal_mask_function, "m") is None
    sliding = masking_utils.sliding_window_causal_mask_function(4096)
    assert mask_window(sliding, "m") == 4096
    chunked = masking_utils.chunked_causal_mask_function(8192, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(UnsupportedModelError, match="neither causal nor a causal sliding"):
        mask_window(chunked, "m")
    with pytest.raises(UnsupportedModelError, match="neither causal nor a causal sliding"):
        mask_window(masking_utils.bidirectional_mask_function, "m")


@pytest.mark.parametrize(
    "config",
    [
        # vLLM's quick-start model family: OPTForCausalLM's head calls `self.model.decoder`.
        transformers.OPTConfig(
            vocab_size=256,
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
        ),
        # GPT2LMHeadModel reads the base model's `cross_attentions`.
        transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    ],
    ids=["opt", "gpt2"],
)
def test_heads_that_reach_into_the_base_model_run(
    config: transformers.PretrainedConfig, tmp_path: Path
) -> None:
    """Both crashed the engine on their first step (AttributeError in the logits head)."""
    hf_model = _save_tiny(config, tmp_path)
    llm = LLM(str(tmp_path), model_impl="transformers", **LLM_OPTIONS)
    assert _greedy(llm, PROMPTS[:2]) == [_hf_greedy(hf_model, p) for p in PROMPTS[:2]]


def test_checkpoint_needing_tensor_conversion_says_so(tmp_path: Path) -> None:
    """transformers saves Mixtral's fused experts as per-expert tensors and merges them when it
    loads; the backend does not, and said "does config.json's architecture match the
    weights?", which misleads: the error names the conversion instead."""
    _save_tiny(transformers.MixtralConfig(**_SMALL, num_local_experts=2), tmp_path)
    with pytest.raises(UnsupportedModelError, match="merges or splits this architecture's"):
        LLM(str(tmp_path), model_impl="transformers", **LLM_OPTIONS)


@pytest.mark.parametrize("hidden", ["softcap", "scaling"])
def test_attention_the_call_does_not_show_is_refused(
    hidden: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transformers version whose Gemma 2 eager attention takes its soft cap (or scale) from
    the module rather than from the call's arguments: paged attention built from the call
    would run uncapped (or at 1/sqrt(head_dim) instead of 1/sqrt(24)) and give other tokens
    silently, as the 5.17 SDPA reference differed by 3.56 in the logits. The construction-time
    comparison with the model's eager attention refuses it."""
    from transformers.models.gemma2 import modeling_gemma2

    eager = modeling_gemma2.eager_attention_forward

    def eager_from_module(module: nn.Module, *args: object, **kwargs: object) -> object:
        if hidden == "softcap":
            kwargs["softcap"] = module.config.attn_logit_softcapping
        else:
            kwargs["scaling"] = module.config.query_pre_attn_scalar**-0.5
        return eager(module, *args, **kwargs)

    init = modeling_gemma2.Gemma2Attention.__init__

    def init_without(self: nn.Module, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        if hidden == "softcap":
            self.attn_logit_softcapping = None  # the call passes softcap=None
        else:
            self.scaling = None  # the call passes scaling=None

    monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", eager_from_module)
    monkeypatch.setattr(modeling_gemma2.Gemma2Attention, "__init__", init_without)
    config = transformers.Gemma2Config(
        **_SMALL, sliding_window=6, attn_logit_softcapping=5.0, query_pre_attn_scalar=24
    )
    with pytest.raises(UnsupportedModelError, match="computes something other than paged"):
        _build(config)
