"""Builds a model from an HF config and fills its weights from safetensors files or at random."""

import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.norm import RMSNorm
from pagedserve.models.registry import get_model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


class _LoadsWeights(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


def load_model(
    model_path: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
) -> nn.Module:
    """Build the model class named by `hf_config.architectures` on `device` in `dtype`, load
    its weights, and return it in eval mode with gradients off.

    load_format "auto"/"safetensors" reads `model.safetensors`, or the shards listed in
    `model.safetensors.index.json`, one tensor at a time; "dummy" draws U(-1e-3, 1e-3) weights
    (norm weights 1) so that benchmarks can run architectures whose weights we do not have.
    Raises UnsupportedModelError for an unknown architecture, a folder without safetensors
    weights, or a checkpoint that leaves parameters unloaded.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model_cls = get_model_class(list(getattr(hf_config, "architectures", None) or []))
    files = [] if load_format == "dummy" else find_safetensors_files(model_path)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config)
    model.requires_grad_(False)
    with torch.no_grad():
        if load_format == "dummy":
            initialize_dummy_weights(model)
        else:
            loaded = cast(_LoadsWeights, model).load_weights(iterate_safetensors(files))
            _check_all_loaded(model, loaded, model_path)
    return model.eval()


def find_safetensors_files(model_path: str) -> list[Path]:
    """The safetensors files of an HF model folder: the shards its index lists, else
    `model.safetensors`. Raises UnsupportedModelError naming what the folder holds instead."""
    folder = Path(model_path)
    if not folder.is_dir():
        raise UnsupportedModelError(f"model folder {model_path!r} does not exist")
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        return [folder / file_name for file_name in sorted(set(weight_map.values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    found = sorted(p.name for p in folder.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))
    hint = (
        f"found only {', '.join(found)}: PyTorch pickle and other formats are not supported; "
        "convert with transformers (`save_pretrained(..., safe_serialization=True)`)"
        if found
        else "found no weight files at all"
    )
    raise UnsupportedModelError(
        f"no safetensors weights in {model_path!r} (looked for model.safetensors and "
        f"model.safetensors.index.json); {hint}"
    )


def iterate_safetensors(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, CPU tensor) one at a time, so only one tensor is in memory."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every parameter from U(low, high) (seeded), then norm weights with 1, biases 0."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(0)
        param.data.uniform_(low, high, generator=generators[param.device])
    for module in model.modules():
        if isinstance(module, RMSNorm | nn.LayerNorm):
            for name, param in module.named_parameters(recurse=False):
                param.data.fill_(1.0 if name == "weight" else 0.0)


def _check_all_loaded(model: nn.Module, loaded: set[str], model_path: str) -> None:
    """Raise if the checkpoint left a parameter (tied LM heads are not listed) uninitialized."""
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise UnsupportedModelError(
            f"checkpoint {model_path!r} has no weights for {len(missing)} parameters: {shown}"
        )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create floating-point tensors in `dtype` inside the block (parameters of the model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
