"""Quantized linear layers: the linear method each layer uses, picked from the checkpoint's
quantization config (parsed torch-free in `pagedserve.quant_config`).

The model loader builds a model inside `use_quant_config(config)`; each linear layer created
there takes `current_linear_method()` (vLLM passes `quant_config` down every constructor; a
scope keeps our model classes free of it, like the default dtype and device they are built
in). Methods: `UnquantizedLinearMethod`, `GPTQLinearMethod` (CPU reference path).
"""

from collections.abc import Iterator
from contextlib import contextmanager

from pagedserve.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod
from pagedserve.layers.quantization.gptq import GPTQLinearMethod
from pagedserve.quant_config import GPTQConfig, QuantizationConfig

__all__ = [
    "GPTQLinearMethod",
    "LinearMethodBase",
    "UnquantizedLinearMethod",
    "current_linear_method",
    "get_linear_method",
    "use_quant_config",
]

_current: list[QuantizationConfig | None] = [None]


def get_linear_method(config: QuantizationConfig | None) -> LinearMethodBase:
    """The linear method of a quantization config (None: unquantized). Raises
    NotImplementedError for a config with no linear method yet."""
    if config is None:
        return UnquantizedLinearMethod()
    if isinstance(config, GPTQConfig):
        return GPTQLinearMethod(config)
    raise NotImplementedError(f"no linear method for quantization {config.get_name()!r} yet")


def current_linear_method() -> LinearMethodBase:
    """The linear method for a layer created now (see `use_quant_config`)."""
    return get_linear_method(_current[-1])


@contextmanager
def use_quant_config(config: QuantizationConfig | None) -> Iterator[None]:
    """Linear layers created inside the block use `config`'s linear method."""
    _current.append(config)
    try:
        yield
    finally:
        _current.pop()
