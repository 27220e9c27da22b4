"""The fused mixture-of-experts computation (placeholder on this branch: the torch reference;
the Triton kernel of issue 23 replaces this module)."""

import torch

from pagedserve.layers.moe.reference import moe_reference


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
) -> torch.Tensor:
    """`moe_reference`'s signature and result (shapes there): [T, H] in hidden_states' dtype."""
    return moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, expert_start)
