"""FP8 W8A8 linear layers (vLLM's `Fp8LinearMethod`; also compressed-tensors' W8A8-FP8).

Weights are float8_e4m3fn W [N out, K in] with float32 scales, per tensor or per output
channel; activations are quantized to float8_e4m3fn per call, with a static scale (the
checkpoint's `input_scale`) or a dynamic one (per tensor, or per token):

    x_q = clamp(x / x_scale, -448, 448) as e4m3     x_scale: [] or [M, 1] float32
    y   = (x_q * x_scale) (W_q * w_scale)^T          w_scale: [] or [N, 1] float32

Checkpoint tensors (names as vLLM, AutoFP8 and llm-compressor write them):
    weight       [N, K] float8_e4m3fn
    weight_scale [] / [1] per tensor, or [N] / [N, 1] per channel (any float dtype)
    input_scale  [] / [1] (static activation scheme only)
Fused layers (qkv, gate_up) load one weight_scale and input_scale per shard; after loading,
per-tensor shard scales become one scale as vLLM does: the largest, with each shard's weight
requantized to it (`requantize_to_max_scale`), and the largest input scale.
Online FP8 (an unquantized checkpoint with `quantization="fp8"`) loads float weights and
quantizes each with one scale per tensor (per rank) in `process_weights_after_loading`.

Backends, picked per layer at load: `torch._scaled_mm` on CUDA GPUs with FP8 support
(compute capability >= 8.9, K and N multiples of 16); on older GPUs the weight is
dequantized once to the activation dtype and used weight-only (logged once); elsewhere (CPU)
the reference: the same activation quantization, then both operands dequantized and
multiplied in float32, the path the GPU one is tested against.
"""

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.kernels import use_quant_kernels
from pagedserve.layers.quantization.base import LinearMethodBase, layer_tensor, register_param
from pagedserve.quant_config import Fp8Config

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest dynamic scale (vLLM's MIN_SCALING_FACTOR): an all-zero row stays finite.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# Fused shard ids of QKVParallelLinear, in their order in the fused output.
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


def fp8_dynamic_scale(
    x: torch.Tensor,  # [M, K] float
    per_token: bool,
) -> torch.Tensor:  # [M, 1] (per token) or [] float32
    """The scale that maps the largest |x| (of each row, or of all) onto 448."""
    amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax()
    # times the float32 1/448, not / 448: PyTorch's CUDA division by a scalar multiplies by
    # the reciprocal, and the fused kernel (layers/kernels/fp8_quant.py) does the same, so CPU,
    # GPU PyTorch and the kernel agree bit for bit
    return (amax.to(torch.float32) * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)


def quantize_fp8(
    x: torch.Tensor,  # [M, K] float
    scale: torch.Tensor,  # broadcastable to x: [], [M, 1] or [N, 1] float32
) -> torch.Tensor:  # [M, K] float8_e4m3fn
    """x / scale, saturated to e4m3's range and rounded to nearest."""
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_matmul_reference(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [] or [M, 1] float32
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn
    w_scale: torch.Tensor,  # [] or [N, 1] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] out_dtype
    """(x_q * x_scale) (w_q * w_scale)^T in float32: the CPU path and the GPU reference."""
    x = x_q.to(torch.float32) * x_scale
    w = w_q.to(torch.float32) * w_scale
    return (x @ w.t()).to(out_dtype)


def fp8_matmul_scaled_mm(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn, row-major
    x_scale: torch.Tensor,  # [] or [M, 1] float32
    w_q: torch.Tensor,  # [N, K] float8_e4m3fn, row-major (so w_q.t() is column-major)
    w_scale: torch.Tensor,  # [] or [N, 1] float32
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] out_dtype
    """The same product through `torch._scaled_mm` (cuBLASLt / CUTLASS FP8 GEMM).

    Its convention (torch 2.13): mat2 column-major, K and N multiples of 16 (M is free);
    scales float32, both one element (tensor-wise) or scale_a [M, 1] with scale_b [1, N]
    (row-wise, bfloat16 output only). Other dtypes with row-wise scales: unit-scale GEMM in
    float32, then the scales applied outside (as vLLM's torch channel-wise fallback)."""
    w_t = w_q.t()
    if x_scale.numel() == 1 and w_scale.numel() == 1:
        return torch._scaled_mm(
            x_q, w_t, scale_a=x_scale, scale_b=w_scale.reshape(()), out_dtype=out_dtype
        )
    m, n = x_q.size(0), w_q.size(0)
    row_a = x_scale.reshape(-1, 1).expand(m, 1).contiguous()
    row_b = w_scale.reshape(1, -1).expand(1, n).contiguous()
    if out_dtype == torch.bfloat16:
        return torch._scaled_mm(x_q, w_t, scale_a=row_a, scale_b=row_b, out_dtype=out_dtype)
    one = torch.ones((), dtype=torch.float32, device=x_q.device)
    out = torch._scaled_mm(x_q, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (out * row_a * row_b).to(out_dtype)


def requantize_to_max_scale(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn (fused shards stacked along N)
    shard_scales: list[float],  # one per-tensor scale per shard
    shard_sizes: list[int],  # rows of each shard
) -> tuple[torch.Tensor, float]:  # ([N, K] float8_e4m3fn, the max scale)
    """One scale for a fused layer whose shards were quantized with their own (vLLM's
    requantize_with_max_scale): each shard with a smaller scale is dequantized and
    quantized again with the largest."""
    max_scale = max(shard_scales)
    start = 0
    for size, scale in zip(shard_sizes, shard_scales, strict=True):
        if scale != max_scale:
            shard = weight[start : start + size].to(torch.float32) * scale
            weight[start : start + size] = quantize_fp8(shard, torch.tensor(max_scale))
        start += size
    return weight, max_scale


def _log_weight_only_once(capability: tuple[int, int]) -> None:
    if not getattr(_log_weight_only_once, "done", False):
        _log_weight_only_once.done = True  # type: ignore[attr-defined]
        logger.warning(
            "FP8: this GPU (compute capability %d.%d) has no FP8 matmul (needs >= 8.9); "
            "FP8 weights are dequantized at load and run weight-only in the activation dtype",
            *capability,
        )


class Fp8LinearMethod(LinearMethodBase):
    """FP8 W8A8 linear method (see the module docstring for the tensors and the backends)."""

    def __init__(self, quant_config: Fp8Config) -> None:
        self.quant_config = quant_config
        self.backend = "reference"  # or "scaled_mm", "weight_only" (set after loading)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        weight_loader: Any,
    ) -> None:
        config = self.quant_config
        self.params_dtype = params_dtype
        self.shard_sizes = list(output_partition_sizes)
        n = sum(output_partition_sizes)
        dtype = FP8_DTYPE if config.checkpoint_fp8 else params_dtype
        weight = torch.empty(n, input_size_per_partition, dtype=dtype)
        register_param(layer, "weight", weight, {"input_dim": 1, "output_dim": 0}, weight_loader)
        if not config.checkpoint_fp8:
            return
        # Per channel until loaded: per-tensor checkpoints fill each shard's rows (see
        # `_load_weight_scale`), and become one scale in `process_weights_after_loading`.
        self._layer_loader = weight_loader
        scale = torch.ones(n, 1, dtype=torch.float32)
        register_param(layer, "weight_scale", scale, {"output_dim": 0}, self._load_weight_scale)
        if config.activation_scheme == "static":
            input_scale = torch.ones(len(output_partition_sizes), dtype=torch.float32)
            register_param(layer, "input_scale", input_scale, {}, self._load_input_scale)

    def _shard_index(self, shard_id: int | str | None) -> int:
        if shard_id is None:
            return 0
        return _QKV_SHARDS[shard_id] if isinstance(shard_id, str) else shard_id

    def _load_weight_scale(
        self,
        param: nn.Parameter,  # [N / tp, 1] float32
        loaded: torch.Tensor,  # [] / [1] per tensor, or [N_shard] / [N_shard, 1] per channel
        shard_id: int | str | None = None,
    ) -> None:
        """Load a shard's weight_scale: a per-tensor one fills the shard's rows (and is
        remembered as per tensor); a per-channel one is sharded like the weight's rows."""
        if math.prod(loaded.shape) == 1:
            index = self._shard_index(shard_id)
            start = sum(self.shard_sizes[:index])
            param.data[start : start + self.shard_sizes[index]] = torch.reshape(loaded, ())
            shards: set[int] = getattr(param, "per_tensor_shards", set())
            param.per_tensor_shards = shards | {index}  # type: ignore[attr-defined]
            return
        column = torch.reshape(loaded, (-1, 1))  # reads a lazy slice whole (a few KB)
        if shard_id is None:
            self._layer_loader(param, column)
        else:
            self._layer_loader(param, column, shard_id)

    def _load_input_scale(
        self,
        param: nn.Parameter,  # [num_shards] float32
        loaded: torch.Tensor,  # [] or [1]
        shard_id: int | str | None = None,
    ) -> None:
        """Load a shard's static input_scale (one value)."""
        if math.prod(loaded.shape) != 1:
            raise ValueError(
                f"input_scale has shape {tuple(loaded.shape)}, expected one value ([] or [1])"
            )
        param.data[self._shard_index(shard_id)] = torch.reshape(loaded, ())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Settle the scales (per-tensor shards to one, static input scales to their max),
        quantize float weights (online FP8), and pick the backend."""
        weight = layer_tensor(layer, "weight").data
        if not self.quant_config.checkpoint_fp8:
            w_scale = fp8_dynamic_scale(weight, per_token=False)
            weight = quantize_fp8(weight, w_scale)
        else:
            scale_param = layer_tensor(layer, "weight_scale")
            w_scale = scale_param.data
            per_tensor: set[int] = getattr(scale_param, "per_tensor_shards", set())
            if per_tensor == set(range(len(self.shard_sizes))):
                starts = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
                scales = [float(w_scale[start, 0]) for start in starts]
                weight, max_scale = requantize_to_max_scale(weight, scales, self.shard_sizes)
                w_scale = torch.tensor(max_scale, dtype=torch.float32, device=weight.device)
        _replace(layer, "weight", weight)
        _replace(layer, "weight_scale", w_scale)
        if self.quant_config.activation_scheme == "static":
            _replace(layer, "input_scale", layer_tensor(layer, "input_scale").data.max())
        if weight.device.type == "cuda":
            capability = torch.cuda.get_device_capability(weight.device)
            if capability < (8, 9):
                _log_weight_only_once(capability)
                self.backend = "weight_only"
                dense = weight.to(torch.float32) * w_scale
                _replace(layer, "weight", dense.to(self.params_dtype))
            elif weight.size(0) % 16 == 0 and weight.size(1) % 16 == 0:
                self.backend = "scaled_mm"

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [..., K] float
        bias: torch.Tensor | None = None,  # [N]
    ) -> torch.Tensor:  # [..., N] x's dtype
        weight = layer_tensor(layer, "weight")
        if self.backend == "weight_only":
            return F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.size(-1))
        static = self.quant_config.activation_scheme == "static"
        static_scale = layer_tensor(layer, "input_scale") if static else None
        if self.backend == "scaled_mm" and use_quant_kernels(x2):
            # One or two fused kernels instead of about six PyTorch ops (same values).
            from pagedserve.layers.kernels.fp8_quant import quantize_fp8_dynamic

            x_q, x_scale = quantize_fp8_dynamic(x2, self.quant_config.per_token, static_scale)
        else:
            if static_scale is not None:
                x_scale = static_scale
            else:
                x_scale = fp8_dynamic_scale(x2, self.quant_config.per_token)
            x_q = quantize_fp8(x2, x_scale)
        matmul = fp8_matmul_scaled_mm if self.backend == "scaled_mm" else fp8_matmul_reference
        out = matmul(x_q, x_scale, weight, layer_tensor(layer, "weight_scale"), x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.size(0))


def _replace(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Swap a parameter's tensor (new dtype or shape), keeping it a frozen parameter."""
    setattr(layer, name, nn.Parameter(tensor, requires_grad=False))
