"""RMSNorm with an optional fused residual add (LayerNorm models use torch's nn.LayerNorm), and
Gemma's variant that scales by (1 + weight)."""

from typing import ClassVar

import torch
from torch import nn

from pagedserve.layers.kernels import use_fused_ops


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (arXiv:1910.07467), computed in float32 as in HF Llama.

    `forward(x)` returns the normalized x. `forward(x, residual)` first adds: with
    s = x + residual it returns (norm(s), s), the new residual stream (vLLM's fused form).
    Works on any [..., hidden_size] input, e.g. per-head q/k norms on [num_tokens, H, D].
    """

    # Gemma's norm (`GemmaRMSNorm`): scale by (1 + weight) in float32, then cast.
    unit_offset: ClassVar[bool] = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        initial = torch.zeros if self.unit_offset else torch.ones  # the identity scale
        self.weight = nn.Parameter(initial(hidden_size), requires_grad=False)

    def _norm(
        self,
        x: torch.Tensor,  # [..., hidden_size] float
    ) -> torch.Tensor:  # [..., hidden_size], dtype of x
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(input_dtype)
        return self.weight * x32.to(input_dtype)

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size] float
        residual: torch.Tensor | None = None,  # [..., hidden_size], dtype of x
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_fused_ops(x):
            return self._fused_forward(x, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _fused_forward(
        self,
        x: torch.Tensor,  # [..., hidden_size] half, on CUDA
        residual: torch.Tensor | None,  # [..., hidden_size], dtype of x
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from pagedserve.layers.kernels.fused_ops import rms_norm

        rows = x.reshape(-1, self.hidden_size)
        if residual is None:
            return rms_norm(rows, self.weight, self.eps, unit_offset=self.unit_offset)[0].view(
                x.shape
            )
        out, new_residual = rms_norm(
            rows,
            self.weight,
            self.eps,
            residual.reshape(-1, self.hidden_size),
            unit_offset=self.unit_offset,
        )
        assert new_residual is not None
        return out.view(x.shape), new_residual.view(x.shape)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm (Gemma 2 and 3 in transformers): norm(x) * (1 + weight), the product
    taken in float32 and only then cast to x's dtype (Llama casts before scaling). The
    checkpoint stores weight - 1, so a weight of 0 is the identity."""

    unit_offset: ClassVar[bool] = True
