"""Quantized linear layers: the linear method each layer uses, picked from the checkpoint's
quantization config (parsed torch-free in `pagedserve.quant_config`).

The model loader parses the checkpoint's config (`quant_config.get_quantization_config`) and
passes it to the model, which passes it down to every linear layer (as vLLM does); each layer
takes `get_linear_method(quant_config)`. Methods: `UnquantizedLinearMethod`,
`GPTQLinearMethod`, `AWQLinearMethod` (CPU reference paths), `Fp8LinearMethod` (FP8 W8A8:
`torch._scaled_mm` on the GPU), `CompressedTensorsWNA16Method` (llm-compressor's packed
int weights, served as GPTQ).
"""

from pagedserve.layers.quantization.awq import AWQLinearMethod
from pagedserve.layers.quantization.base import LinearMethodBase, UnquantizedLinearMethod
from pagedserve.layers.quantization.compressed_tensors import CompressedTensorsWNA16Method
from pagedserve.layers.quantization.fp8 import Fp8LinearMethod
from pagedserve.layers.quantization.gptq import GPTQLinearMethod
from pagedserve.quant_config import (
    AWQConfig,
    CompressedTensorsConfig,
    Fp8Config,
    GPTQConfig,
    QuantizationConfig,
)

__all__ = [
    "AWQLinearMethod",
    "CompressedTensorsWNA16Method",
    "Fp8LinearMethod",
    "GPTQLinearMethod",
    "LinearMethodBase",
    "UnquantizedLinearMethod",
    "get_linear_method",
]


def get_linear_method(config: QuantizationConfig | None) -> LinearMethodBase:
    """The linear method of a quantization config (None: unquantized). Raises
    NotImplementedError for a config with no linear method yet."""
    if config is None:
        return UnquantizedLinearMethod()
    if isinstance(config, GPTQConfig):
        return GPTQLinearMethod(config)
    if isinstance(config, AWQConfig):
        return AWQLinearMethod(config)
    if isinstance(config, Fp8Config):
        return Fp8LinearMethod(config)
    if isinstance(config, CompressedTensorsConfig):
        # W8A8-FP8 is the FP8 method itself; packed int weights become GPTQ's tensors.
        if isinstance(config.scheme, Fp8Config):
            return Fp8LinearMethod(config.scheme)
        if isinstance(config.scheme, GPTQConfig):
            return CompressedTensorsWNA16Method(config.scheme)
    raise NotImplementedError(f"no linear method for quantization {config.get_name()!r} yet")
