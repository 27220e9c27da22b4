"""`--kv-cache-dtype fp8` end to end on the CPU: the option, the cache's dtype and capacity,
the per-layer scales read from a checkpoint, and greedy output equal to the 16/32-bit cache's."""

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.attention.kv_quant import dequantize_kv, quantize_kv
from pagedserve.config import CacheConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.entrypoints.cli import build_parser
from pagedserve.layers.attention import Attention
from pagedserve.models.loader import iterate_safetensor_slices, load_model
from tests.entrypoints.test_llm_greedy import CONFIGS, save_tiny_model

SUPPORTED = "('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2')"


def runner_of(llm: LLM):  # type: ignore[no-untyped-def]
    return llm.llm_engine.engine_core.executor.worker.runner


@pytest.mark.parametrize("value", ["int8", "fp8_e4m3fn", "bfloat16", "FP8", ""])
def test_unsupported_kv_cache_dtype_is_a_value_error_naming_the_choices(value: str) -> None:
    message = f"kv_cache_dtype must be one of {SUPPORTED}, got {value!r}"
    with pytest.raises(ValueError) as error:
        EngineArgs(kv_cache_dtype=value).create_engine_config()
    assert str(error.value) == message
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype=value)


def test_kv_cache_dtype_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["serve"]).kv_cache_dtype == "auto"
    for value in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert parse(["serve", "--kv-cache-dtype", value]).kv_cache_dtype == value
    with pytest.raises(SystemExit):
        parse(["serve", "--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kv_cache_dtype,torch_dtype",
    [
        ("fp8", torch.float8_e4m3fn),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
    ],
)
def test_fp8_cache_holds_twice_the_blocks_of_bf16(
    kv_cache_dtype: str, torch_dtype: torch.dtype
) -> None:
    """The same kv_cache_memory_bytes buys twice the blocks: block sizing counts the cache's
    element size, not the model's."""
    budget = 3 << 20
    common = dict(device="cpu", dtype="bfloat16", kv_cache_memory_bytes=budget)
    bf16 = LLM(**common)  # type: ignore[arg-type]
    fp8 = LLM(kv_cache_dtype=kv_cache_dtype, **common)  # type: ignore[arg-type]
    bf16_blocks = bf16.llm_engine.engine_core.num_blocks
    assert fp8.llm_engine.engine_core.num_blocks == 2 * bf16_blocks
    assert {c.dtype for c in runner_of(bf16).kv_caches} == {torch.bfloat16}
    assert {c.dtype for c in runner_of(fp8).kv_caches} == {torch_dtype}
    assert sum(c.numel() for c in runner_of(fp8).kv_caches) <= budget
    assert sum(c.numel() * 2 for c in runner_of(bf16).kv_caches) <= budget


def save_tiny_llama(path: Path, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """test_llm_greedy's tiny GQA Llama (random, 2 layers, stories260k's tokenizer) with
    `extra` checkpoint tensors added to its safetensors file."""
    save_tiny_model(CONFIGS["llama_gqa_untied"], path)
    if extra:
        weights = load_file(path / "model.safetensors")
        save_file(weights | extra, path / "model.safetensors", metadata={"format": "pt"})
    return path


CHECKPOINT_SCALES = {
    "model.layers.0.self_attn.k_scale": torch.tensor(0.5),  # AutoFP8 / vLLM names, 0-dim
    "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
    "model.layers.0.self_attn.q_scale": torch.tensor(3.0),  # read and ignored
    "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.125]),  # compressed-tensors
    "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([2.0], dtype=torch.bfloat16),
}


def _scales(model: torch.nn.Module) -> list[tuple[float, float]]:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return [(layer.k_scale.item(), layer.v_scale.item()) for layer in layers]


def test_scales_load_from_checkpoint_names(tmp_path: Path) -> None:
    path = save_tiny_llama(tmp_path / "m", CHECKPOINT_SCALES)
    config = transformers.AutoConfig.from_pretrained(path)
    model = load_model(str(path), config, torch.float32, torch.device("cpu"))
    assert _scales(model) == [(0.5, 0.25), (0.125, 2.0)]
    # Tensor-parallel loading reads lazy slices of the file; the scales are replicated.
    fresh = load_model(str(path), config, torch.float32, torch.device("cpu"), "dummy")
    assert _scales(fresh) == [(1.0, 1.0), (1.0, 1.0)]  # the default
    fresh.load_weights(iterate_safetensor_slices([path / "model.safetensors"]))  # type: ignore[operator]
    assert _scales(fresh) == [(0.5, 0.25), (0.125, 2.0)]


def test_deprecated_kv_scale_sets_both(tmp_path: Path) -> None:
    path = save_tiny_llama(tmp_path / "m", {"model.layers.1.self_attn.kv_scale": torch.tensor(4.0)})
    config = transformers.AutoConfig.from_pretrained(path)
    model = load_model(str(path), config, torch.float32, torch.device("cpu"))
    assert _scales(model) == [(1.0, 1.0), (4.0, 4.0)]


@pytest.mark.parametrize(
    "tensor,message",
    [
        (torch.full((2,), 0.5), r"has shape \(2,\): the fp8 KV cache supports only per-tensor"),
        (torch.tensor(0.0), "is 0.0: a KV cache scale must be finite and positive"),
        (torch.tensor(float("inf")), "is inf: a KV cache scale must be finite and positive"),
    ],
)
def test_bad_checkpoint_scale_is_a_value_error(
    tmp_path: Path, tensor: torch.Tensor, message: str
) -> None:
    name = "model.layers.0.self_attn.k_scale"
    path = save_tiny_llama(tmp_path / "m", {name: tensor})
    config = transformers.AutoConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}' {message}"):
        load_model(str(path), config, torch.float32, torch.device("cpu"))


PROMPTS = [
    [1, *range(40, 100)],  # 60 tokens: chunked by the 32-token budget
    [1, *range(40, 80), 7, 8, 9],  # shares 2 full blocks with the first: prefix-cache hits
    [1, 300, 301],
    [1, *range(200, 237)],
]
# Scales that are not powers of two (those would leave fp8's relative rounding unchanged).
ODD_SCALES = {name: scale * 1.37 for name, scale in CHECKPOINT_SCALES.items()}


def fake_quantize_kv(llm: LLM, dtype: torch.dtype) -> None:
    """Make a float32-cache engine see K and V rounded through fp8 with its layers' scales
    (what an fp8 cache gives back), by a hook on every attention layer."""

    def round_trip(layer: torch.nn.Module, args: tuple) -> tuple:  # type: ignore[type-arg]
        query, key, value, metadata = args
        key = dequantize_kv(quantize_kv(key, layer.k_scale, dtype), layer.k_scale, key.dtype)
        value = dequantize_kv(quantize_kv(value, layer.v_scale, dtype), layer.v_scale, key.dtype)
        return query, key, value, metadata

    for module in runner_of(llm).model.modules():
        if isinstance(module, Attention):
            module.register_forward_pre_hook(round_trip)


def greedy(model: Path, fake_quantize: torch.dtype | None = None, **kwargs: object):  # type: ignore[no-untyped-def]
    """Greedy tokens and their logprobs: the first prompt alone, then the rest together."""
    llm = LLM(
        str(model),
        device="cpu",
        max_model_len=128,
        max_num_batched_tokens=32,  # chunked prefill
        num_gpu_blocks_override=128,
        **kwargs,  # type: ignore[arg-type]
    )
    if fake_quantize is not None:
        fake_quantize_kv(llm, fake_quantize)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.stats().prefix_cache_hits >= 32
    outputs = [o.outputs[0] for o in first + rest]
    tokens = [list(o.token_ids) for o in outputs]
    logprobs = [
        [lp[t].logprob for lp, t in zip(o.logprobs or [], o.token_ids, strict=True)]
        for o in outputs
    ]
    return tokens, logprobs


def test_fp8_cache_greedy_equals_float32_cache_of_the_rounded_kv(tmp_path: Path) -> None:
    """Prefill, chunked prefill, prefix-cache hits and decode over an fp8 cache with the
    checkpoint's scales give the greedy tokens of a float32 cache holding the same K/V rounded
    through e4m3 (the scales applied exactly once on each side), and logprobs within float32
    rounding. (Against the unrounded float32 cache, tiny models diverge within a few dozen
    tokens: their attention scores are large, and e4m3 keeps 3 mantissa bits. fp8_e5m2 runs
    the same code with another dtype; its kernels are tested in tests/attention.)"""
    path = save_tiny_llama(tmp_path / "m", ODD_SCALES)
    expected_tokens, expected_logprobs = greedy(path, fake_quantize=torch.float8_e4m3fn)
    tokens, logprobs = greedy(path, kv_cache_dtype="fp8")
    assert tokens == expected_tokens
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-3)
