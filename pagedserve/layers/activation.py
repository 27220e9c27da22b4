"""Activation functions: the gated SiLU of SwiGLU MLPs and GPT-2's tanh GELU."""

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


class GeluTanh(nn.Module):
    """GELU with the tanh approximation: HF's "gelu_new" and "gelu_pytorch_tanh" (equal
    up to float rounding; this one is a single fused torch op)."""

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, n] float
    ) -> torch.Tensor:  # [num_tokens, n] float
        return F.gelu(x, approximate="tanh")


def get_act_fn(name: str) -> nn.Module:
    """The activation module for an HF config's `activation_function`/`hidden_act` name.

    Raises NotImplementedError listing the supported names.
    """
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return GeluTanh()
    if name == "gelu":
        return nn.GELU()
    if name == "relu":
        return nn.ReLU()
    raise NotImplementedError(
        f"activation {name!r} is not supported; use gelu_new, gelu_pytorch_tanh, gelu_fast, "
        "gelu or relu"
    )
