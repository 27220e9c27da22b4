"""The transformers backend (`model_impl="transformers"`): transformers' own modeling code on
paged attention, against transformers' `generate` and logits, and the choice of backend."""

import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from pagedserve import LLM, SamplingParams
from pagedserve.attention.torch_backend import TorchAttentionBackend
from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.attention import Attention
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.loader import load_model
from pagedserve.models.registry import SUPPORTED_ARCHITECTURES, check_model_impl
from pagedserve.models.transformers_backend.model import TransformersForCausalLM
from pagedserve.models.transformers_backend.support import uses_attention_interface

from ._metadata import build_step
from .test_models import _make_hf_model

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
)
# Architectures run through the backend (GPT-J, OLMo and Gemma 2 beyond the eight asked for;
# Gemma 2 and Mistral exercise per-layer sliding windows and soft-capping).
CONFIGS: dict[str, PretrainedConfig] = {
    "gemma": transformers.GemmaConfig(**_COMMON, num_key_value_heads=2, head_dim=16),
    "phi": transformers.PhiConfig(**_COMMON, partial_rotary_factor=0.5),
    "olmo2": transformers.Olmo2Config(**_COMMON, num_key_value_heads=2),
    "granite": transformers.GraniteConfig(
        **_COMMON,
        num_key_value_heads=2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=4.0,
    ),
    "stablelm": transformers.StableLmConfig(
        **_COMMON, num_key_value_heads=2, partial_rotary_factor=0.25
    ),
    "gpt_neox": transformers.GPTNeoXConfig(**_COMMON, rotary_pct=0.5),
    "starcoder2": transformers.Starcoder2Config(**_COMMON, num_key_value_heads=2),
    "cohere": transformers.CohereConfig(**_COMMON, num_key_value_heads=2, logit_scale=0.5),
    "gptj": transformers.GPTJConfig(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=128
    ),
    "olmo": transformers.OlmoConfig(**_COMMON, num_key_value_heads=2),
    "gemma2": transformers.Gemma2Config(
        **_COMMON,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=24,
    ),
    "mistral_sliding": transformers.MistralConfig(
        **_COMMON, num_key_value_heads=2, sliding_window=5
    ),
}
# Different lengths in one batch; 37 and 31 tokens exceed the step budget of 16 (chunked).
PROMPTS = [[1, 5, 7, 9, 11, 3, 2], list(range(3, 40)), [5, 6], [*range(3, 30), 7, 7]]
# Shares the first 24 tokens (6 full blocks of 4) of PROMPTS[1]: a prefix-cache hit later.
CACHED_PROMPT = [*range(3, 27), 200, 100, 50]
MAX_TOKENS = 8
LLM_OPTIONS = dict(
    skip_tokenizer_init=True,
    device="cpu",
    block_size=4,
    max_num_batched_tokens=16,
    max_num_seqs=4,
)


def _save_tiny(config: PretrainedConfig, path: Path) -> nn.Module:
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    hf_model = _make_hf_model(config)  # O(1) weights: greedy choices far from ties
    hf_model.save_pretrained(path)
    return hf_model


def _skip_unless_the_backend_runs(config: PretrainedConfig) -> None:
    """Skip an architecture that the installed transformers computes outside its attention
    interface (GPT-J in transformers 5.17; 5.24's goes through it), after checking that the
    backend refuses it at config time. Only that refusal skips; an architecture the backend
    accepts must match transformers."""
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    if not uses_attention_interface(model_class):
        with pytest.raises(UnsupportedModelError, match="computes attention in its own code"):
            check_model_impl(config, "transformers")
        pytest.skip(
            f"{model_class.__name__} of transformers {transformers.__version__} computes "
            f"attention in its own code, not through the attention interface: the backend "
            f"refuses it (support.check_transformers_can_run)"
        )


def _hf_greedy(hf_model: nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(  # type: ignore[operator]
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _built_model(llm: LLM) -> nn.Module:
    model: nn.Module = llm.llm_engine.engine_core.executor.worker.runner.model
    return model


@pytest.mark.parametrize("case", list(CONFIGS))
def test_greedy_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    """Continuous batching of 4 prompts, chunked prefill (budget 16 < 37 tokens), then a
    prefix-cache hit: every token equals transformers' greedy `generate`."""
    _skip_unless_the_backend_runs(CONFIGS[case])
    hf_model = _save_tiny(CONFIGS[case], tmp_path)
    llm = LLM(str(tmp_path), model_impl="transformers", **LLM_OPTIONS)
    assert isinstance(_built_model(llm), TransformersForCausalLM)
    assert _greedy(llm, PROMPTS) == [_hf_greedy(hf_model, p) for p in PROMPTS]

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = llm.generate({"prompt_token_ids": CACHED_PROMPT}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 24
    assert list(again.outputs[0].token_ids) == _hf_greedy(hf_model, CACHED_PROMPT)


@pytest.mark.parametrize("case", ["granite", "cohere", "gemma2"])
def test_logits_equal_transformers(case: str, tmp_path: Path) -> None:
    """Logits, not only their argmax: Granite's logits_scaling, Cohere's logit_scale and
    Gemma 2's final soft-capping come from the model's own causal-LM code; Gemma 2's
    attention soft-capping and sliding window (6 < the 11-token prompt) from its layers."""
    hf_model = _save_tiny(CONFIGS[case], tmp_path)
    model = load_model(str(tmp_path), hf_model.config, torch.float32, torch.device("cpu"), "auto")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if case == "gemma2":  # layer 0 slides, layer 1 is global; both soft-cap at 5
        assert [(a.sliding_window, a.logits_soft_cap) for a in layers] == [(6, 5.0), (None, 5.0)]
        assert layers[0].scale == pytest.approx(24**-0.5)
    for layer in layers:
        layer.kv_cache = torch.zeros(2, 8, 4, layer.num_kv_heads, layer.head_dim)
        layer.backend = TorchAttentionBackend()
    prompts = [list(range(7, 18)), [3, 1, 4, 1, 5]]
    positions, metadata = build_step([0, 0], [11, 5], [[1, 2, 3], [5, 6]], block_size=4)
    input_ids = torch.tensor([t for p in prompts for t in p])
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, metadata))
        expected = [hf_model(input_ids=torch.tensor([p])).logits[0] for p in prompts]
    assert logits.dtype == torch.float32 and logits.shape == (16, 256)
    torch.testing.assert_close(logits, torch.cat(expected), atol=1e-4, rtol=0)


def test_llama_through_transformers_equals_native() -> None:
    """The bundled Llama checkpoint (real safetensors names, tied embeddings) gives the same
    tokens on transformers' LlamaForCausalLM as on our native one; `auto` picks native."""
    prompts = [[1, 400, 32, 90, 17], [1, *range(100, 137)]]
    native = LLM(DEFAULT_MODEL, model_impl="auto", **LLM_OPTIONS)
    assert type(_built_model(native)) is LlamaForCausalLM
    through_transformers = LLM(DEFAULT_MODEL, model_impl="transformers", **LLM_OPTIONS)
    assert isinstance(_built_model(through_transformers), TransformersForCausalLM)
    assert _greedy(through_transformers, prompts) == _greedy(native, prompts)


def test_auto_picks_native_when_there_is_one(tmp_path: Path) -> None:
    gemma = _save_tiny(CONFIGS["gemma"], tmp_path).config
    llama = transformers.LlamaConfig(**_COMMON, architectures=["LlamaForCausalLM"])
    assert check_model_impl(llama, "auto") == "pagedserve"
    assert check_model_impl(llama, "vllm") == "pagedserve"  # vLLM's name of native
    assert check_model_impl(llama, "transformers") == "transformers"
    assert check_model_impl(gemma, "auto") == "transformers"
    llm = LLM(str(tmp_path), **LLM_OPTIONS)  # model_impl defaults to auto
    assert isinstance(_built_model(llm), TransformersForCausalLM)


def test_dummy_weights_run(tmp_path: Path) -> None:
    """--load-format dummy (the benchmarks' way) builds and runs without a checkpoint."""
    _save_tiny(CONFIGS["gemma"], tmp_path)
    llm = LLM(str(tmp_path), model_impl="transformers", load_format="dummy", **LLM_OPTIONS)
    assert [len(t) for t in _greedy(llm, PROMPTS[:2])] == [MAX_TOKENS, MAX_TOKENS]


def test_pagedserve_impl_without_native_code_lists_native_architectures(tmp_path: Path) -> None:
    _save_tiny(CONFIGS["phi"], tmp_path)
    with pytest.raises(UnsupportedModelError, match="no native pagedserve implementation") as e:
        LLM(str(tmp_path), model_impl="pagedserve", **LLM_OPTIONS)
    assert all(name in str(e.value) for name in SUPPORTED_ARCHITECTURES)
    assert "PhiForCausalLM" in str(e.value) and "'transformers'" in str(e.value)


def test_architecture_neither_backend_runs_lists_what_is_supported() -> None:
    encoder = transformers.BertConfig(architectures=["BertModel"])
    with pytest.raises(UnsupportedModelError, match="can be run by neither") as e:
        check_model_impl(encoder, "auto")
    message = str(e.value)
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)
    assert "GemmaForCausalLM" in message and "Starcoder2ForCausalLM" in message
    # A causal LM whose attention is its own code (no attention interface): named as such.
    # (Bloom, with its ALiBi attention; Falcon was the example until transformers 5.25 moved
    # it onto the interface.)
    bloom = transformers.BloomConfig(architectures=["BloomForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="BloomForCausalLM computes attention"):
        check_model_impl(bloom, "transformers")


@pytest.mark.parametrize("model_impl", ["auto", "transformers", "pagedserve"])
def test_multimodal_config_is_refused_in_one_line(model_impl: str) -> None:
    """Gemma3ForConditionalGeneration (how google/gemma-3-4b-it is saved) is mapped into
    AutoModelForCausalLM by transformers, but its config keeps the language model in
    text_config: it crashed the worker with "no attribute 'vocab_size'"; now one error, for
    every model_impl, before any worker starts."""
    config = transformers.Gemma3Config(architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(UnsupportedModelError, match="multimodal model .* text_config"):
        check_model_impl(config, model_impl)


def test_options_the_backend_does_not_support(tmp_path: Path) -> None:
    _save_tiny(CONFIGS["gemma"], tmp_path)
    args = dict(model=str(tmp_path), model_impl="transformers", device="cpu")
    # Tensor parallelism needs a TP plan: Gemma has one (tests/distributed/
    # test_transformers_tensor_parallel.py), StableLM none.
    EngineArgs(**args, tensor_parallel_size=2).create_engine_config()
    _save_tiny(CONFIGS["stablelm"], tmp_path / "stablelm")
    no_plan = args | {"model": str(tmp_path / "stablelm")}
    with pytest.raises(ValueError, match="has none: tensor_parallel_size must be 1, got 2"):
        EngineArgs(**no_plan, tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="quantization 'fp8' is not supported"):
        EngineArgs(**args, quantization="fp8").create_engine_config()
    with pytest.raises(ValueError, match="model_impl must be one of"):
        EngineArgs(**(args | {"model_impl": "hf"})).create_engine_config()


def test_transformers_too_old_for_the_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyproject allows transformers 4.x (enough for native models' configs and tokenizers);
    the backend relies on 5.x's attention and mask interfaces: one line naming both versions
    instead of a crash deep in transformers. Native models still resolve."""
    # The module `import transformers` gives now: in 5.17, importing processing_utils re-runs
    # transformers' __init__ and replaces sys.modules["transformers"] with a new module.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    gemma = transformers.GemmaConfig(**_COMMON, architectures=["GemmaForCausalLM"])
    message = r"needs transformers >= 5\.0, installed: 4\.46\.0"
    with pytest.raises(UnsupportedModelError, match=message) as e:
        check_model_impl(gemma, "auto")
    assert "['GemmaForCausalLM']" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UnsupportedModelError, match=message):
        TransformersForCausalLM(gemma)
    llama = transformers.LlamaConfig(**_COMMON, architectures=["LlamaForCausalLM"])
    assert check_model_impl(llama, "auto") == "pagedserve"
