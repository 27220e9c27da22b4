"""Roofline figures of an engine step: the bytes it must read and the FLOPs it must compute,
and the device peaks that turn them into memory-bandwidth utilization (MBU) and model FLOPs
utilization (MFU). A torch-free leaf (it imports `envs` and `model_config` only): the engine
core computes a step's cost (`step_cost`), the metrics divide it by the step's time and the
device's peaks (`device_peaks`).

Per step, with L layers, H query heads, K kv heads, head dim D, and each scheduled sequence
s bringing n_s new tokens to a context of c_s tokens (after the step):

    bytes = weight bytes + sum over layers and sequences of keys(s) x 2 x K x D x kv dtype bytes
    FLOPs = 2 x N x sum_s n_s + 4 x H x D x sum over layers and sequences of n_s x keys(s)

where N is the non-embedding parameter count (a forward pass is 2 FLOPs per parameter per
token, and attention 4 x H x D per query-key pair: QK^T and PV, 2 each; PaLM, Chowdhery et al.
2022, appendix B: "6N + 12LHQT" per token for training is 3x this forward). keys(s) is c_s on
a full-attention layer; on a layer with sliding window W it is min(c_s, W + n_s - 1) for
bytes (the chunk's first token sees W keys, each later one adds one) and min(c_s, W) per new
token for FLOPs. The causal mask is not discounted (a prefill chunk's tokens see fewer keys
than c_s), as in PaLM's definition.

Approximations (documented, not measured): parameters are counted from the model's config
(attention and MLP projections; norms and biases left out); the weights are read once per
step, all of them, also for a mixture of experts (which really reads only the routed
experts); a quantized model's linear layers are read at their packed bits, their scales left
out, its embeddings at the model dtype. The lm head (when not tied) counts in the bytes but
not in N: it runs only on the sampled positions. With tensor parallelism every figure is one
rank's: the model's divided by the TP size (kv heads at least one per rank).
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve import envs
from pagedserve.model_config import get_hf_text_config


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What one rank of a model costs per step, in the terms of `step_cost`."""

    weight_bytes: float  # all parameters' bytes on this rank (packed when quantized)
    num_params: float  # non-embedding parameters on this rank: 2 FLOPs each per token
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # kv heads on this rank
    head_dim: int
    kv_dtype_bytes: float  # bytes of one K or V element in the cache
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: full)
    # layer_windows grouped, (window, number of layers) each: step_cost runs every step
    window_layers: tuple[tuple[int | None, int], ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        counts: dict[int | None, int] = {}
        for window in self.layer_windows:
            counts[window] = counts.get(window, 0) + 1
        object.__setattr__(self, "window_layers", tuple(counts.items()))


def step_cost(model: ModelCost, sequences: Iterable[tuple[int, int]]) -> tuple[float, float]:
    """(bytes read, FLOPs) of a step that runs `sequences`: (new tokens, context length in
    tokens after the step) each. A step with no sequence costs nothing (no forward runs)."""
    kv_bytes_per_key = 2 * model.num_kv_heads * model.head_dim * model.kv_dtype_bytes
    attn_flops_per_key = 4 * model.num_heads * model.head_dim
    num_tokens = num_keys_read = num_pairs = 0
    for num_new, context in sequences:
        num_tokens += num_new
        for window, num_layers in model.window_layers:
            if window is None:
                keys_read, keys_seen = context, context
            else:
                keys_read = min(context, window + num_new - 1)
                keys_seen = min(context, window)
            num_keys_read += num_layers * keys_read
            num_pairs += num_layers * num_new * keys_seen
    if num_tokens == 0:
        return 0.0, 0.0
    step_bytes = model.weight_bytes + num_keys_read * kv_bytes_per_key
    flops = 2 * model.num_params * num_tokens + attn_flops_per_key * num_pairs
    return float(step_bytes), float(flops)


_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2}
_DTYPE_BYTES |= {"bfloat16": 2, "bf16": 2}


def dtype_bytes(dtype: Any) -> int:
    """Bytes of a dtype named as ModelConfig's `dtype` or a checkpoint's (a torch.dtype or its
    str, "torch.bfloat16"); 2 when unknown (the half-precision checkpoints we serve)."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    return _DTYPE_BYTES.get(name, 2)


# Model types whose MLP is two matrices (up, down), not gated (gate, up, down).
_PLAIN_MLP_MODELS = frozenset({
    "gpt2", "gptj", "gpt_neo", "gpt_neox", "gpt_bigcode", "opt", "bloom", "falcon", "phi",
    "starcoder2", "codegen", "mpt",
})  # fmt: skip


def _mlp_width(config: Any, hidden: int) -> int:
    """The MLP's inner width under the names configs give it (intermediate_size; OPT's
    ffn_dim; GPT-2/GPT-J's n_inner, None meaning 4 x hidden)."""
    for name in ("intermediate_size", "ffn_dim", "n_inner"):
        width = getattr(config, name, None)
        if width:
            return int(width)
    return 4 * hidden


def model_cost(
    hf_config: Any,
    dtype: str,
    kv_cache_dtype: str,
    quantization: str | None,
    max_model_len: int,
    tp_size: int = 1,
) -> ModelCost:
    """A model's `ModelCost` from its config (`ModelConfig.hf_config`, `dtype`, `quantization`,
    `max_model_len`; CacheConfig's `kv_cache_dtype`) on one of `tp_size` ranks. The counts
    are the module docstring's approximations; GPT-2 has a 4x non-gated MLP, every other
    model a gated one (3 projections)."""
    config = get_hf_text_config(hf_config)
    hidden = config.hidden_size
    num_layers = config.num_hidden_layers
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or hidden // num_heads
    vocab = config.vocab_size
    attention = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    if getattr(config, "model_type", "") in _PLAIN_MLP_MODELS:
        mlp = 2 * hidden * _mlp_width(config, hidden)
    elif num_experts:
        expert = getattr(config, "moe_intermediate_size", None) or _mlp_width(config, hidden)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        mlp = 3 * hidden * (num_experts * expert + shared) + hidden * num_experts
    else:
        mlp = 3 * hidden * _mlp_width(config, hidden)
    num_params = num_layers * (attention + mlp)
    tied = getattr(config, "tie_word_embeddings", getattr(hf_config, "tie_word_embeddings", True))
    num_embedding = vocab * hidden * (1 if tied else 2)
    # dtype first: transformers 5 warns on reading torch_dtype (as runner_setup reads it)
    checkpoint_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    param_bytes = dtype_bytes(checkpoint_dtype if dtype == "auto" else dtype)
    bits = quant_bits(hf_config, quantization)
    linear_bytes = param_bytes if bits is None else bits / 8
    kv_bytes = 1 if kv_cache_dtype.startswith("fp8") else param_bytes
    return ModelCost(
        weight_bytes=(num_params * linear_bytes + num_embedding * param_bytes) / tp_size,
        num_params=num_params / tp_size,
        num_heads=max(num_heads // tp_size, 1),
        num_kv_heads=max(num_kv_heads // tp_size, 1),
        head_dim=head_dim,
        kv_dtype_bytes=kv_bytes,
        layer_windows=tuple(layer_windows(config, max_model_len)),
    )


def quant_bits(hf_config: Any, quantization: str | None) -> int | None:
    """Bits per weight of a quantized model's linear layers (None: not quantized): fp8 8;
    gptq and awq the quantization_config's `bits` (4 if absent); compressed-tensors its first
    config group's weights' `num_bits` (8 if absent)."""
    if quantization is None:
        return None
    if quantization == "fp8":
        return 8
    quant = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(quant, Mapping):
        quant = vars(quant)
    if quantization in ("gptq", "awq"):
        return int(quant.get("bits", 4))
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if weights and weights.get("num_bits"):
            return int(weights["num_bits"])
    return 8


def layer_windows(config: Any, max_model_len: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers reads the config
    (`models.llama.layer_sliding_windows` is the model code's): `sliding_window` on the layers
    that `layer_types` lists as "sliding_attention" (all layers without `layer_types`), none
    when `use_sliding_window` is false; a window of at least `max_model_len` is full
    attention (the loader drops it so too)."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True) or not window or window >= max_model_len:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * num_layers
    return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as the offline engine records it (`LLMEngine.step_records`).

    seconds: the seconds on the device of the forwards whose outputs it applied
    (`EngineCore.step_seconds`); num_tokens: their tokens (0: none); step_bytes, step_flops:
    their roofline cost (`step_cost`, one rank's; 0 without a model cost).
    """

    seconds: float
    num_tokens: int
    step_bytes: float
    step_flops: float


def utilization(records: Iterable[StepRecord], peaks: "Peaks") -> tuple[float | None, float | None]:
    """(MBU, MFU) of a run's steps: their total bytes (FLOPs) over their total seconds, over
    the peak; steps without a forward are left out; None where the peak is unknown or no step
    ran a forward."""
    forwards = [r for r in records if r.num_tokens > 0 and r.seconds > 0]
    seconds = sum(r.seconds for r in forwards)
    if not seconds:
        return None, None
    mbu = (
        sum(r.step_bytes for r in forwards) / seconds / peaks.bandwidth if peaks.bandwidth else None
    )
    mfu = sum(r.step_flops for r in forwards) / seconds / peaks.flops if peaks.flops else None
    return mbu, mfu


def run_summary(records: Sequence[StepRecord], peaks: "Peaks") -> dict[str, Any]:
    """A run's roofline summary (`bench throughput`'s result fields): num_steps, the steps
    that ran a forward (with a time); step_seconds, their seconds; mbu and mfu as
    `utilization` gives them."""
    forwards = [r for r in records if r.num_tokens > 0 and r.seconds > 0]
    mbu, mfu = utilization(forwards, peaks)
    return {
        "num_steps": len(forwards),
        "step_seconds": sum(r.seconds for r in forwards),
        "mbu": mbu,
        "mfu": mfu,
    }


@dataclass(frozen=True, slots=True)
class Peaks:
    """A device's peak memory bandwidth (bytes/s) and dense bf16 FLOP/s; None: unknown."""

    bandwidth: float | None = None
    flops: float | None = None


# Vendors' datasheets: NVIDIA H200 Tensor Core GPU (4.8 TB/s HBM3e, 1,979 TFLOPS bf16 with
# sparsity = 989 dense); H100 SXM (3.35 TB/s, 989 TFLOPS dense bf16); A100 80GB (2.0 TB/s
# HBM2e, 312 TFLOPS bf16). Matched as substrings of torch.cuda.get_device_name(), in order.
DEVICE_PEAKS: tuple[tuple[str, Peaks], ...] = (
    ("H200", Peaks(4.8e12, 989e12)),
    ("H100 80GB HBM3", Peaks(3.35e12, 989e12)),  # the SXM part's name ("H100 PCIe" differs)
    ("H100 SXM", Peaks(3.35e12, 989e12)),
    ("A100-SXM4-80GB", Peaks(2.0e12, 312e12)),
    ("A100 80GB", Peaks(2.0e12, 312e12)),
)


def device_peaks(device_name: str | None) -> Peaks:
    """The peaks of the device named `device_name` (torch.cuda.get_device_name(); None for
    a CPU) from `DEVICE_PEAKS`, each overridden by PAGEDSERVE_PEAK_BANDWIDTH (bytes/s) or
    PAGEDSERVE_PEAK_FLOPS (FLOP/s) when set. A CPU or an unlisted device has no peaks (no
    guessed CPU figures). Raises ValueError for a set variable that is not a positive number."""
    peaks = Peaks()
    for name, known in DEVICE_PEAKS:
        if device_name is not None and name in device_name:
            peaks = known
            break
    bandwidth, flops = envs.peak_bandwidth(), envs.peak_flops()
    return Peaks(
        bandwidth if bandwidth is not None else peaks.bandwidth,
        flops if flops is not None else peaks.flops,
    )
