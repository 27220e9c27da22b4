"""A test-side GPTQ packer written from the format (not from our loader): round-to-nearest
quantization of float weights, packed as AutoGPTQ's `QuantLinear.pack` lays them out
(auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py), with the quantizer's min/max rules of
AutoGPTQ's `Quantizer.find_params` (zero-including range; sym: symmetric range, zero
2**(bits-1)). Also writes whole checkpoints: config.json with `quantization_config` and
model.safetensors, plus the dequantized float model for transformers to compare against.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Projections fed the same input get the same act-order permutation (GPTQ orders rows by
# the diagonal of the Hessian of the layer's input).
SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


@dataclass
class Packed:
    qweight: torch.Tensor  # [K / pack, N] int32
    qzeros: torch.Tensor  # [G, N / pack] int32
    scales: torch.Tensor  # [G, N] float16
    g_idx: torch.Tensor  # [K] int32
    dequantized: torch.Tensor  # [N, K] float32: the quantized grid, as the float weight W


def pack_int32(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Pack unsigned `values` (< 2**bits) along `axis`, 32 // bits per word, value j of a run
    in bits [j*bits, (j+1)*bits); int32 result (the words' bit patterns)."""
    pack = 32 // bits
    moved = np.moveaxis(values.astype(np.uint64), axis, -1)
    runs = moved.reshape(*moved.shape[:-1], moved.shape[-1] // pack, pack)
    shifts = np.arange(pack, dtype=np.uint64) * np.uint64(bits)
    words = (runs << shifts).sum(axis=-1).astype(np.uint32)
    return np.moveaxis(words.view(np.int32), -1, axis)


def quantize(
    weight: torch.Tensor,  # [N, K] float
    bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
    perm: torch.Tensor | None = None,  # [K]: act-order of the rows (desc_act only)
    zero_offset: int = 1,  # v1 ("gptq") stores zero - 1; gptq_v2 stores zero
) -> Packed:
    """Quantize W with round-to-nearest per (group, output column) and pack it."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    g = group_size if group_size != -1 else k
    maxq = 2**bits - 1
    order = perm if desc_act and perm is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    num_groups = k // g
    scales = torch.empty(num_groups, n, dtype=torch.float16)
    zeros = torch.empty(num_groups, n, dtype=torch.int64)
    for group in range(num_groups):
        rows = w[:, g_idx == group]  # [N, g]
        xmin = rows.min(dim=1).values.clamp(max=0)
        xmax = rows.max(dim=1).values.clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        empty = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(empty, -1.0, xmin), torch.where(empty, 1.0, xmax)
        scale = ((xmax - xmin) / maxq).to(torch.float16)
        if sym:
            zero = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            zero = torch.round(-xmin / scale.float()).to(torch.int64)
        # v1 stores zero - 1, so it cannot hold a zero point of 0 (AutoGPTQ's known limit).
        zeros[group] = zero.clamp(zero_offset, maxq)
        scales[group] = scale
    s = scales.float()[g_idx.long()].T  # [N, K]
    z = zeros[g_idx.long()].T
    q = torch.clamp(torch.round(w / s) + z, 0, maxq).to(torch.int64)
    dequantized = (q - z).to(torch.float32) * s
    qweight = pack_int32(q.T.numpy(), bits, axis=0)  # W^T [K, N] packed along K
    qzeros = pack_int32((zeros - zero_offset).numpy(), bits, axis=1)
    return Packed(torch.from_numpy(qweight), torch.from_numpy(qzeros), scales, g_idx, dequantized)


def quantization_config(bits: int, group_size: int, desc_act: bool, sym: bool) -> dict:
    """config.json's quantization_config as AutoGPTQ / GPTQModel write it (v1 format)."""
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "checkpoint_format": "gptq",
    }


# Quantizes one linear: (checkpoint name prefix, float weight [N, K]) -> its packed tensors
# (attributes named as the checkpoint's fields) and `dequantized` [N, K].
QuantizeLinear = Callable[[str, torch.Tensor], Any]


def write_quantized_checkpoint(
    float_model_path: Path,
    out: Path,
    dequantized_out: Path,
    quantize_linear: QuantizeLinear,
    fields: tuple[str, ...],
    quant_config: dict,
) -> None:
    """Quantize every decoder linear of the HF float model in `float_model_path` with
    `quantize_linear` into a folder `out` (config.json with `quant_config` as its
    quantization_config, model.safetensors with each linear's `fields`) and save the
    dequantized float model (same grid) to `dequantized_out`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(float_model_path, dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    for name, tensor in state.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in LINEARS or parts[-1] != "weight":
            tensors[name] = tensor.contiguous()
            continue
        prefix = name[: -len(".weight")]
        packed = quantize_linear(prefix, tensor)
        for field in fields:
            tensors[f"{prefix}.{field}"] = getattr(packed, field).contiguous()
        state[name].copy_(packed.dequantized)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.save_pretrained(dequantized_out)


def write_gptq_checkpoint(
    float_model_path: Path,
    out: Path,
    dequantized_out: Path,
    bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
    seed: int = 0,
) -> None:
    """A GPTQ checkpoint of the float model (`write_quantized_checkpoint`); projections fed
    the same input share one random act-order."""
    generator = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}

    def quantize_linear(prefix: str, weight: torch.Tensor) -> Packed:
        module = prefix.split(".")[-1]
        group_key = prefix.replace(module, SAME_INPUT.get(module, module))
        if group_key not in perms:
            perms[group_key] = torch.randperm(weight.shape[1], generator=generator)
        return quantize(weight, bits, group_size, desc_act, sym, perms[group_key])

    write_quantized_checkpoint(
        float_model_path,
        out,
        dequantized_out,
        quantize_linear,
        ("qweight", "qzeros", "scales", "g_idx"),
        quantization_config(bits, group_size, desc_act, sym),
    )
