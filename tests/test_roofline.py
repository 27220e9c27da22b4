"""Roofline cost of a step (`roofline.step_cost`, `model_cost`) on hand-computed numbers, and
the device peaks with their environment overrides."""

from types import SimpleNamespace

import pytest

from pagedserve.roofline import (
    ModelCost,
    Peaks,
    StepRecord,
    device_peaks,
    model_cost,
    step_cost,
    utilization,
)

# 2 layers, 4 query heads, 2 kv heads of dim 8, 2-byte KV: a key costs 2 (K, V) x 2 x 8 x 2
# = 64 bytes per layer; a query-key pair 4 x 4 x 8 = 128 FLOPs per layer.
TINY = ModelCost(
    weight_bytes=1000,
    num_params=100,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    kv_dtype_bytes=2,
    layer_windows=(None, None),
)


def test_decode_step_of_two_sequences() -> None:
    """Contexts 10 and 30 after the step: 2 x 40 keys x 64 B; 2 x 100 x 2 tokens + 128 x 2
    layers x (1 x 10 + 1 x 30)."""
    assert step_cost(TINY, [(1, 10), (1, 30)]) == (1000 + 5120, 400 + 10240)


def test_prefill_chunk() -> None:
    """16 new tokens after 32 computed: 2 x 48 keys x 64 B; 2 x 100 x 16 + 128 x 2 x 16 x 48."""
    assert step_cost(TINY, [(16, 48)]) == (1000 + 6144, 3200 + 196608)


def test_sliding_window_layer_reads_at_most_its_window() -> None:
    """Layer 2 has window 8. Decode at context 30: 30 + 8 keys read, 30 + 8 seen. A chunk of
    4 at context 30: 30 + 11 keys read (the first token's 8, one more for each later one),
    4 x 30 + 4 x 8 pairs. A context shorter than the window: all of it."""
    model = ModelCost(1000, 100, 4, 2, 8, 2, layer_windows=(None, 8))
    assert step_cost(model, [(1, 30)]) == (1000 + 38 * 64, 200 + 38 * 128)
    assert step_cost(model, [(4, 30)]) == (1000 + 41 * 64, 800 + 152 * 128)
    assert step_cost(model, [(1, 5)]) == (1000 + 10 * 64, 200 + 10 * 128)


def test_a_step_without_sequences_costs_nothing() -> None:
    assert step_cost(TINY, []) == (0.0, 0.0)


def tiny_config(**changes: object) -> SimpleNamespace:
    config = dict(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=None,  # 16 / 4
        vocab_size=32,
        intermediate_size=24,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention"],
        model_type="llama",
    )
    config.update(changes)
    return SimpleNamespace(**config)


def test_model_cost_from_config() -> None:
    """Per layer: attention 16 x 4 x (2 x 4 + 2 x 2) = 768, gated MLP 3 x 16 x 24 = 1152;
    2 layers = 3840 parameters. Embedding and untied lm head 2 x 32 x 16 = 1024. bf16: 2 B
    each; on 2 ranks half of everything, 1 kv head each."""
    cost = model_cost(tiny_config(), "auto", "auto", None, max_model_len=64)
    assert cost == ModelCost(9728, 3840, 4, 2, 4, 2, (None, 8))
    split = model_cost(tiny_config(), "auto", "fp8", None, max_model_len=64, tp_size=2)
    assert split == ModelCost(4864, 1920, 2, 1, 4, 1, (None, 8))


def test_quantized_weights_are_read_packed() -> None:
    """GPTQ 4-bit layers (3840 x 0.5 B), bf16 embeddings (1024 x 2 B)."""
    config = tiny_config(quantization_config={"quant_method": "gptq", "bits": 4})
    assert model_cost(config, "auto", "auto", "gptq", 64).weight_bytes == 1920 + 2048
    assert model_cost(tiny_config(), "float16", "auto", "fp8", 64).weight_bytes == 3840 + 2048


def test_window_as_wide_as_the_context_is_full_attention() -> None:
    assert model_cost(tiny_config(), "auto", "auto", None, 8).layer_windows == (None, None)
    no_types = tiny_config(layer_types=None)
    assert model_cost(no_types, "auto", "auto", None, 64).layer_windows == (8, 8)
    off = tiny_config(use_sliding_window=False)
    assert model_cost(off, "auto", "auto", None, 64).layer_windows == (None, None)


def test_peaks_of_known_devices_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_PEAK_BANDWIDTH", raising=False)
    monkeypatch.delenv("PAGEDSERVE_PEAK_FLOPS", raising=False)
    assert device_peaks("NVIDIA H200") == Peaks(4.8e12, 989e12)
    assert device_peaks("NVIDIA H100 80GB HBM3") == Peaks(3.35e12, 989e12)
    assert device_peaks("NVIDIA A100-SXM4-80GB") == Peaks(2.0e12, 312e12)
    assert device_peaks(None) == Peaks(None, None)  # a CPU: no guessed peaks
    assert device_peaks("NVIDIA GeForce RTX 3090") == Peaks(None, None)
    monkeypatch.setenv("PAGEDSERVE_PEAK_BANDWIDTH", "1e9")
    assert device_peaks(None) == Peaks(1e9, None)
    assert device_peaks("NVIDIA H200") == Peaks(1e9, 989e12)
    monkeypatch.setenv("PAGEDSERVE_PEAK_FLOPS", "-3")
    with pytest.raises(ValueError, match="PAGEDSERVE_PEAK_FLOPS"):
        device_peaks(None)


def test_configs_without_intermediate_size() -> None:
    """The transformers backend's models name their MLP width otherwise (OPT's ffn_dim, GPT-J's
    n_inner, None = 4 x hidden); model_cost once raised AttributeError for them, at engine
    start. Both have a two-matrix MLP."""
    import transformers

    opt = transformers.OPTConfig(hidden_size=32, ffn_dim=96, num_hidden_layers=2,
                                 num_attention_heads=4, vocab_size=100)  # fmt: skip
    gptj = transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_inner=None)
    for config, width in ((opt, 96), (gptj, 128)):
        cost = model_cost(config, "float32", "auto", None, 64)
        attention = 32 * 8 * (2 * 4 + 2 * 4)
        assert cost.num_params == 2 * (attention + 2 * 32 * width)


def test_utilization_of_a_run_weights_steps_by_their_time() -> None:
    """Two forwards: 3e9 B and 1e12 FLOPs in 1 s, 1e9 B and 3e12 FLOPs in 3 s; an idle step
    (no tokens) and a zero-time one are left out: 4e9 B / 4 s over 2e9 B/s = 50%, 4e12 / 4 s
    over 1e13 = 10%. An unknown peak gives None, and so does a run without a forward."""
    records = [
        StepRecord(1.0, 16, 3e9, 1e12),
        StepRecord(5.0, 0, 0.0, 0.0),
        StepRecord(3.0, 4, 1e9, 3e12),
        StepRecord(0.0, 4, 1e9, 1e12),
    ]
    assert utilization(records, Peaks(2e9, 1e13)) == (pytest.approx(0.5), pytest.approx(0.1))
    assert utilization(records, Peaks(2e9, None)) == (pytest.approx(0.5), None)
    assert utilization(records[1:2], Peaks(2e9, 1e13)) == (None, None)
