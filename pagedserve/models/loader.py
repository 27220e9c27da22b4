"""Builds a model from an HF config and fills its weights from safetensors files or at random."""

import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.distributed.parallel_state import (
    get_pp_rank,
    get_pp_size,
    get_tp_rank,
    get_tp_size,
)
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.attention import Attention
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.quantization.base import LinearMethodBase
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.model_config import LOAD_FORMATS
from pagedserve.models.cpu_offload import CpuOffloader
from pagedserve.models.registry import get_model_class
from pagedserve.quant_config import get_quantization_config

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


class _LoadsWeights(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


def load_model(
    model_path: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    quantization: str | None = None,
    model_impl: str = "auto",
    max_model_len: int | None = None,
    cpu_offload_bytes: int = 0,
) -> nn.Module:
    """Build the model class named by `hf_config.architectures` on `device` in `dtype`, load
    its weights, and return it in eval mode with gradients off.

    load_format "auto"/"safetensors" reads `model.safetensors`, or the shards listed in
    `model.safetensors.index.json`, one tensor at a time; with tensor parallelism each rank
    reads only its own shard of each tensor (`SafetensorsSlice`). "dummy" draws
    U(-1e-3, 1e-3) weights (norm weights 1) so that benchmarks can run architectures whose
    weights we do not have (each rank draws its shards alone, so they differ with tp_size).
    `quantization` (ModelConfig's resolved method, e.g. "gptq") builds the linear layers with
    that method's parameters (`pagedserve.layers.quantization`), parsed from the checkpoint's
    quantization_config; dummy weights leave its integer tensors 0.
    `max_model_len` (the served context) adapts the layers to it (`fit_to_max_model_len`);
    None assumes the model's max_position_embeddings.
    Raises UnsupportedModelError for an unknown architecture, a folder without safetensors
    weights, or a checkpoint that leaves parameters unloaded; NotImplementedError for a
    quantized checkpoint of an architecture that does not support quantization.
    `model_impl` picks native code or the transformers backend (`registry.resolve_model_impl`).
    Under pipeline parallelism (`get_pp_size() > 1`) the model builds and loads only this
    stage's layers; NotImplementedError for a class without `supports_pp`.
    `cpu_offload_bytes` > 0 keeps that many bytes of layer weights in CPU memory
    (`models/cpu_offload.py`; the model's `cpu_offloader` attribute is the CpuOffloader);
    NotImplementedError with a quantization (its weight processing runs on the device).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model_cls = get_model_class(
        list(getattr(hf_config, "architectures", None) or []), model_impl, hf_config
    )
    if get_pp_size() > 1 and not getattr(model_cls, "supports_pp", False):
        raise NotImplementedError(
            f"pipeline parallelism (pipeline_parallel_size={get_pp_size()}) is not supported "
            f"for {model_cls.__name__} yet; it runs the Llama family (Llama, Mistral), Qwen2 "
            f"and Qwen3 natively"
        )
    quant_config = None
    if quantization is not None:
        if not getattr(model_cls, "supports_quantization", False):
            raise NotImplementedError(
                f"{model_cls.__name__} does not support quantized checkpoints "
                f"(quantization={quantization!r}) yet"
            )
        quant_config = get_quantization_config(quantization, hf_config)
    files = [] if load_format == "dummy" else find_safetensors_files(model_path)
    offloader = None
    if cpu_offload_bytes > 0:
        if quant_config is not None:
            raise NotImplementedError(
                f"cpu_offload_gb with quantization={quantization!r} is not supported yet (the "
                f"quantized layers process their weights on the device after loading)"
            )
        offloader = CpuOffloader(cpu_offload_bytes, device)
    with _default_dtype(dtype), torch.device(device), offloader_building(offloader):
        model = model_cls(hf_config) if quant_config is None else model_cls(hf_config, quant_config)
    if max_model_len is not None:
        fit_to_max_model_len(model, max_model_len)
    model.requires_grad_(False)
    with torch.no_grad():
        if load_format == "dummy":
            initialize_dummy_weights(model)
        else:
            # A rank reads only its shard (tensor parallelism) and skips other stages'
            # tensors unread (pipeline parallelism): lazy slices.
            sharded = get_tp_size() > 1 or get_pp_size() > 1
            weights = iterate_safetensor_slices(files) if sharded else iterate_safetensors(files)
            loaded = _load_naming_tensor(cast(_LoadsWeights, model), weights, model_path)
            _check_all_loaded(model, loaded, model_path)
        process_weights_after_loading(model)
    if offloader is not None:
        offloader.attach()
        setattr(model, "cpu_offloader", offloader)  # noqa: B010 (not an nn attribute)
    return model.eval()


def offloader_building(offloader: CpuOffloader | None) -> AbstractContextManager[None]:
    """`offloader.building()`, or nothing without offload."""
    return nullcontext() if offloader is None else offloader.building()


def fit_to_max_model_len(model: nn.Module, max_model_len: int) -> None:
    """Adapt the layers to a served context of `max_model_len` tokens: LongRoPE picks its
    factor set (`RotaryEmbedding.fit_to_max_model_len`), and a sliding window at least
    max_model_len wide is dropped (a query at position p < max_model_len would see every key
    anyway), so that such layers run as full attention (e.g. Phi-3-mini's window of 2047, or
    Gemma 3's 1024, served with max_model_len <= the window)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.fit_to_max_model_len(max_model_len)
        elif isinstance(module, Attention) and (module.sliding_window or 0) >= max_model_len:
            module.sliding_window = None


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each layer's linear method convert its loaded tensors (vLLM's hook of the same
    name: repacking for a kernel, online quantization)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethodBase):
            method.process_weights_after_loading(module)


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


def _shards(files: Sequence[Path]) -> Iterator[Path]:
    """The checkpoint files with vLLM's progress bar ("Loading safetensors checkpoint shards"),
    on the first rank only (every rank reads the files)."""
    from tqdm.auto import tqdm

    first = get_tp_rank() == 0 and get_pp_rank() == 0
    yield from tqdm(files, desc="Loading safetensors checkpoint shards", disable=not first)


def iterate_safetensors(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, CPU tensor) one at a time, so only one tensor is in memory."""
    for file in _shards(files):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def iterate_safetensor_slices(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, lazy view) one at a time: each weight loader narrows the view to
    its rank's shard, and only that shard is read from the file."""
    for file in _shards(files):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, cast(torch.Tensor, SafetensorsSlice(f.get_slice(name)))


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
}


class SafetensorsSlice:
    """A view of one checkpoint tensor that reads nothing until its values are needed.

    The weight loaders treat it as the full tensor: `shape`, `narrow`, `chunk` and (2-D) `t`
    only move the view's window, and the first torch function that receives it (the loader's
    `param.copy_(view)`) reads exactly that window from the file. So a rank of a
    tensor-parallel model reads its shard, never the whole tensor.

        stored tensor [rows, cols]          view after .narrow(0, r0, n)
        +-----------------------+           rows [r0, r0 + n) x cols [0, cols):
        |                       |           read = handle[r0:r0 + n, 0:cols]
        |///////////////////////|  <- r0
        |///////////////////////|
        +-----------------------+
    """

    def __init__(
        self,
        handle: Any,  # safetensors' PySafeSlice of the stored tensor
        window: tuple[tuple[int, int], ...] | None = None,  # [start, stop) per stored dim
        transposed: bool = False,  # the view is the transpose of the window (2-D only)
    ) -> None:
        self._handle = handle
        self._window = window or tuple((0, size) for size in handle.get_shape())
        self._transposed = transposed

    @property
    def shape(self) -> torch.Size:
        sizes = [stop - start for start, stop in self._window]
        return torch.Size(sizes[::-1] if self._transposed else sizes)

    @property
    def dtype(self) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._handle.get_dtype()]

    def dim(self) -> int:
        return len(self._window)

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def narrow(self, dim: int, start: int, length: int) -> "SafetensorsSlice":
        dim = dim % self.dim()
        if not (start >= 0 and length >= 0 and start + length <= self.shape[dim]):
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for {self.shape}")
        stored_dim = self.dim() - 1 - dim if self._transposed else dim
        window = list(self._window)
        offset = window[stored_dim][0]
        window[stored_dim] = (offset + start, offset + start + length)
        return SafetensorsSlice(self._handle, tuple(window), self._transposed)

    def chunk(self, chunks: int, dim: int = 0) -> list["SafetensorsSlice"]:
        size = self.shape[dim]
        step = -(-size // chunks)
        return [self.narrow(dim, start, min(step, size - start)) for start in range(0, size, step)]

    def t(self) -> "SafetensorsSlice":
        if self.dim() > 2:
            raise ValueError(f"t() expects a tensor of at most 2 dims, got {self.dim()}")
        return SafetensorsSlice(self._handle, self._window, not self._transposed)

    def materialize(self) -> torch.Tensor:
        """Read the window from the file (a CPU tensor in the checkpoint's dtype)."""
        if any(stop == start for start, stop in self._window):
            stored = torch.empty([stop - start for start, stop in self._window], dtype=self.dtype)
        else:
            stored = self._handle[tuple(slice(start, stop) for start, stop in self._window)]
        return stored.t() if self._transposed else stored

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        """Any torch function given a view (e.g. `param.copy_(view)`) gets the values."""

        def read(value: Any) -> Any:
            if isinstance(value, SafetensorsSlice):
                return value.materialize()
            if isinstance(value, list | tuple):
                return type(value)(read(v) for v in value)
            return value

        return func(*read(tuple(args)), **{k: read(v) for k, v in (kwargs or {}).items()})


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every floating-point parameter (float8 ones too) from U(low, high) (seeded), then
    norm weights with their identity scale (1; Gemma's 0), biases 0; integer ones (quantized
    weights, group indices) with 0."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if not param.is_floating_point():
            param.data.zero_()
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(0)
        if param.element_size() == 1:  # float8 (no uniform_ kernel): drawn in float32
            drawn = torch.empty(param.shape, device=param.device)
            param.data.copy_(drawn.uniform_(low, high, generator=generators[param.device]))
            continue
        param.data.uniform_(low, high, generator=generators[param.device])
    for module in model.modules():
        if isinstance(module, RMSNorm | nn.LayerNorm):
            # The identity scale: 1, or 0 where the norm scales by (1 + weight) (Gemma).
            identity = 0.0 if getattr(module, "unit_offset", False) else 1.0
            for name, param in module.named_parameters(recurse=False):
                param.data.fill_(identity if name == "weight" else 0.0)


def _load_naming_tensor(
    model: _LoadsWeights, weights: Iterable[tuple[str, torch.Tensor]], model_path: str
) -> set[str]:
    """`model.load_weights(weights)`, where an error loading a tensor (a weight loader's
    shape check: "has shape (3, 64), expected (4, 64)"; torch's own size mismatch) names the
    checkpoint tensor it happened on: UnsupportedModelError "checkpoint tensor NAME in PATH:
    ...". Errors that already name the tensor pass unchanged."""
    current: list[str] = []

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            current[:] = [name]
            yield name, tensor
        current.clear()  # an error after the last tensor is not that tensor's

    try:
        return model.load_weights(tracked())
    except (ValueError, RuntimeError) as e:
        if not current or current[0] in str(e):
            raise
        raise UnsupportedModelError(
            f"checkpoint tensor {current[0]!r} in {model_path!r}: {e}"
        ) from e


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
