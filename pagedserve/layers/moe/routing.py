"""Top-k expert routing of mixture-of-experts layers: which experts each token goes to, and
with what weight (vLLM's `fused_topk`).

Mixtral, Qwen2-MoE and Qwen3-MoE all route the same way (transformers' `*TopKRouter`):
softmax over all experts' router logits, keep the k largest probabilities, and - where the
config says so - renormalise those k to sum to 1. The configs differ only in that last step:
Mixtral always renormalises, Qwen2-MoE and Qwen3-MoE when `norm_topk_prob` is true.
"""

from typing import Any

import torch


def renormalizes_topk(hf_config: Any) -> bool:
    """Whether a model's router renormalises its top-k weights: always for Mixtral (no
    `norm_topk_prob` in its config), else the config's `norm_topk_prob` (Qwen2-MoE and
    Qwen3-MoE; transformers' default False)."""
    if getattr(hf_config, "model_type", None) == "mixtral":
        return True
    return bool(getattr(hf_config, "norm_topk_prob", False))


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] any float dtype
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # topk_weights [T, K] float32, topk_ids [T, K] int32
    """The k experts of each token and their weights: softmax(router_logits) in float32 over
    all experts, its k largest entries (ties go to the lower expert id, as torch.topk), and,
    with `renormalize`, those k divided by their sum.

    Returns (topk_weights float32 [T, K], topk_ids int32 [T, K]) on the logits' device, the
    layout `fused_moe` / `moe_reference` take. Raises ValueError when top_k is not in
    [1, num_experts].
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be in [1, num_experts={num_experts}]")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)
