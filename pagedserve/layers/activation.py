"""Activation functions: the gated SiLU of SwiGLU MLPs, the gated GELU of GeGLU MLPs (Gemma)
and GPT-2's tanh GELU."""

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.kernels import use_fused_ops


class SiluAndMul(nn.Module):
    """SwiGLU gate (arXiv:2002.05202): silu(gate) * up, for a fused [gate | up] input."""

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, 2 * intermediate_size] float, [gate | up]
    ) -> torch.Tensor:  # [num_tokens, intermediate_size] float
        if use_fused_ops(x):
            from pagedserve.layers.kernels.fused_ops import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """GeGLU gate (arXiv:2002.05202): gelu(gate) * up, for a fused [gate | up] input.
    `approximate` "tanh" is HF's gelu_pytorch_tanh (Gemma), "none" the exact erf GELU."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, 2 * intermediate_size] float, [gate | up]
    ) -> torch.Tensor:  # [num_tokens, intermediate_size] float
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def get_gated_act_fn(name: str) -> nn.Module:
    """The gate of a gated MLP (act(gate) * up on a fused [gate | up] input) for an HF config's
    `hidden_act` / `hidden_activation` name, as transformers' ACT2FN applies it.

    Raises NotImplementedError listing the supported names.
    """
    if name == "silu":
        return SiluAndMul()
    if name in _TANH_GELUS:
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul("none")
    raise NotImplementedError(
        f"hidden_act {name!r} is not supported; use silu, gelu, {', '.join(_TANH_GELUS)}"
    )


class GeluTanh(nn.Module):
    """GELU with the tanh approximation: HF's "gelu_new" and "gelu_pytorch_tanh" (equal
    up to float rounding; this one is a single fused torch op)."""

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, n] float
    ) -> torch.Tensor:  # [num_tokens, n] float
        return F.gelu(x, approximate="tanh")


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): HF's "quick_gelu" (CLIP's vision and text towers)."""

    def forward(
        self,
        x: torch.Tensor,  # [..., n] float
    ) -> torch.Tensor:  # [..., n] float
        return x * torch.sigmoid(1.702 * x)


def get_act_fn(name: str) -> nn.Module:
    """The activation module for an HF config's `activation_function`/`hidden_act` name.

    Raises NotImplementedError listing the supported names.
    """
    if name in _TANH_GELUS:
        return GeluTanh()
    if name == "gelu":
        return nn.GELU()
    if name == "relu":
        return nn.ReLU()
    if name == "quick_gelu":
        return QuickGELU()
    raise NotImplementedError(
        f"activation {name!r} is not supported; use gelu_new, gelu_pytorch_tanh, gelu_fast, "
        "gelu, relu or quick_gelu"
    )
