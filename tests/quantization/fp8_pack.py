"""A test-side writer of `quant_method: fp8` checkpoints, from the format as AutoFP8 /
llm-compressor's older FP8 export and vLLM's `Fp8LinearMethod` define it (not from our
loader): each Linear's weight as float8_e4m3fn [N, K] with `weight_scale` (one float32 per
tensor, or [N, 1] per channel), and with the static activation scheme an `input_scale` (one
per tensor, from calibration: the largest |input| / 448). No CPU tool writes this format
(AutoFP8 needs a GPU; llm-compressor now writes compressed-tensors), so it is written here.

Also the reference side: the float weights our engine must end up with (per-tensor q/k/v
and gate/up shards requantized to their largest scale, vLLM's rule) and transformers hooks
that quantize each Linear's input as W8A8 does, so greedy output can be compared with
transformers running the same arithmetic.
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Round x / scale to the nearest e4m3 value, saturating at +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fake_quant_input(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return to_fp8(x, scale).float() * scale


def dynamic_scale(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax()
    return (amax.float() / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512))


def calibrate(model_path: Path, prompts: list[list[int]]) -> dict[str, float]:
    """The largest |input| of every decoder Linear over `prompts` (HF names, no .weight)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    amax: dict[str, float] = {}

    def hook(name: str):  # type: ignore[no-untyped-def]
        def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

        return record

    handles = [
        module.register_forward_pre_hook(hook(name))
        for name, module in model.named_modules()
        if name.split(".")[-1] in LINEARS
    ]
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    for handle in handles:
        handle.remove()
    return amax


def write_fp8_checkpoint(
    float_path: Path,
    out: Path,
    dequantized: Path,
    per_channel: bool,
    static_amax: dict[str, float] | None = None,  # calibration: static activation scheme
    scale_shape: tuple[int, ...] = (),  # per-tensor weight_scale as [] or [1]
) -> None:
    """Quantize the float checkpoint at `float_path` into an fp8 checkpoint at `out`, and save
    at `dequantized` the float model whose Linear weights are what the engine must use."""
    tensors = load_file(str(float_path / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = dict(tensors)
    scales: dict[str, float] = {}
    for name, weight in tensors.items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] not in LINEARS:
            quantized[name] = weight
            continue
        w = weight.float()
        if per_channel:
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            quantized[f"{module}.weight_scale"] = scale
        else:
            scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
            scales[module] = float(scale)
            quantized[f"{module}.weight_scale"] = scale.reshape(scale_shape)
        quantized[name] = to_fp8(w, scale)
        dense[name] = quantized[name].float() * scale
        if static_amax is not None:
            input_scale = torch.tensor(static_amax[module] / FP8_MAX, dtype=torch.float32)
            quantized[f"{module}.input_scale"] = input_scale.reshape(scale_shape)
    if not per_channel:  # vLLM's rule: fused per-tensor shards requantized to the max scale
        for prefix in {name.rsplit(".", 1)[0] for name in scales}:
            for group in FUSED:
                members = [f"{prefix}.{part}" for part in group if f"{prefix}.{part}" in scales]
                if not members:
                    continue
                top = max(scales[m] for m in members)
                for m in members:
                    dense[f"{m}.weight"] = to_fp8(dense[f"{m}.weight"], top).float() * top
    config = json.loads((float_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "static" if static_amax is not None else "dynamic",
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(quantized, str(out / "model.safetensors"))
    dequantized.mkdir(parents=True, exist_ok=True)
    (dequantized / "config.json").write_text((float_path / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in dense.items()}, str(dequantized / "model.safetensors"))


@contextmanager
def w8a8_inputs(
    model: torch.nn.Module,
    per_token: bool = False,
    static_amax: dict[str, float] | None = None,
) -> Iterator[None]:
    """Within the block, every decoder Linear of the transformers `model` sees its input
    quantized to e4m3 and back (static: the calibrated scale; dynamic: per tensor or per
    token), as a W8A8 engine computes it."""

    def hook(name: str):  # type: ignore[no-untyped-def]
        def quantize(
            module: torch.nn.Module, args: tuple[torch.Tensor, ...]
        ) -> tuple[torch.Tensor]:
            x = args[0]
            if static_amax is not None:
                scale = torch.tensor(static_amax[name] / FP8_MAX)
            else:
                scale = (
                    dynamic_scale(x.reshape(-1, x.size(-1)), per_token).reshape(*x.shape[:-1], 1)
                    if per_token
                    else dynamic_scale(x, False)
                )
            return (fake_quant_input(x, scale).to(x.dtype),)

        return quantize

    handles = [
        module.register_forward_pre_hook(hook(name))
        for name, module in model.named_modules()
        if name.split(".")[-1] in LINEARS
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def hf_w8a8_greedy(
    model_path: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    per_token: bool = False,
    static_amax: dict[str, float] | None = None,
) -> list[list[int]]:
    """Greedy tokens of transformers on `model_path` with W8A8 input quantization."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad(), w8a8_inputs(model, per_token, static_amax):
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
