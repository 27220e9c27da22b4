"""The mixture-of-experts computation in plain torch: the reference the fused kernel is
checked against, and the CPU path.

Source: the expert MLP of Mixtral / Qwen2-MoE / Qwen3-MoE (transformers' modeling code):
each token goes through its top-k experts, each a SwiGLU MLP, and their outputs are summed
with the routing weights.
"""

import torch
import torch.nn.functional as F


def check_moe_shapes(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """Raise ValueError unless the shapes are those `moe_reference` documents."""
    num_tokens, hidden_size = hidden_states.shape
    num_experts, two_i, w13_hidden = w13.shape
    if w13_hidden != hidden_size or two_i % 2 or w2.shape != (num_experts, hidden_size, two_i // 2):
        raise ValueError(
            f"moe_reference: shapes disagree: hidden_states {tuple(hidden_states.shape)}, "
            f"w13 {tuple(w13.shape)} (want [E, 2I, H]), w2 {tuple(w2.shape)} (want [E, H, I])"
        )
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"moe_reference: topk_weights {tuple(topk_weights.shape)} and topk_ids "
            f"{tuple(topk_ids.shape)} must both be [T={num_tokens}, K]"
        )


def expert_scales(scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An FP8 expert weight's scales as [E, 1] (one per expert) or [E, N] (one per output
    row) float32, from [E], [E, 1], [E, 1, 1], [E, N] or [E, N, 1]; weight: [E, N, K].
    Raises ValueError for any other shape."""
    num_experts, rows = weight.shape[:2]
    if scale.numel() not in (num_experts, num_experts * rows) or scale.shape[0] != num_experts:
        raise ValueError(
            f"fused_moe: weight scale {tuple(scale.shape)} for an expert weight "
            f"{tuple(weight.shape)}: want [E] (per tensor) or [E, N] (per channel)"
        )
    return scale.reshape(num_experts, -1).to(torch.float32).contiguous()


def dequantize_experts(
    weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """weight [E, N, K] (FP8 with `scale`, see `expert_scales`; or float without) in dtype."""
    if scale is None:
        return weight.to(dtype)
    return (weight.to(torch.float32) * expert_scales(scale, weight)[:, :, None]).to(dtype)


def moe_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t]).

    hidden_states: [T, H] (bf16/fp16/fp32). w13: [E, 2 * I, H], each expert's gate projection
    (rows :I) stacked over its up projection (rows I:), as nn.Linear weights. w2: [E, H, I],
    the down projections. topk_weights: [T, K] float (the routing weights, already
    normalised as the model's config says). topk_ids: [T, K] integer global expert ids.
    expert_start: global id of local expert 0 (expert parallelism: this rank holds experts
    [expert_start, expert_start + E)); pairs routed to other ranks' experts add nothing here.
    Returns [T, H] in hidden_states' dtype; each expert's SwiGLU runs in that dtype, the
    weighted sum in float32 (as the fused kernel accumulates).
    Raises ValueError when the shapes disagree.
    """
    check_moe_shapes(hidden_states, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden_states.shape
    num_experts = w13.shape[0]
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden_states.device)
    local_ids = topk_ids.long() - expert_start
    for expert in torch.unique(local_ids).tolist():
        if not 0 <= expert < num_experts:
            continue  # another rank's expert
        token_idx, slot = torch.nonzero(local_ids == expert, as_tuple=True)
        x = hidden_states[token_idx]
        gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None].float())
    return out.to(hidden_states.dtype)
