"""The fused mixture-of-experts computation: the Triton kernels (`triton_moe.py`) for CUDA
tensors, the torch reference (`reference.py`) elsewhere.

Triton is imported only when a CUDA tensor arrives, so CPU-only installs (and CI, which has
no Triton) never import it.
"""

import functools

import torch

from pagedserve.layers.moe.reference import check_moe_shapes, dequantize_experts, moe_reference


@functools.cache
def _triton_moe_importable() -> bool:
    try:
        import pagedserve.layers.moe.triton_moe  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton_moe(hidden_states: torch.Tensor) -> bool:
    """Whether `fused_moe` runs the Triton kernels: a CUDA tensor, with Triton importable."""
    return hidden_states.is_cuda and _triton_moe_importable()


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int = 0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t]): `moe_reference`'s
    arguments and result (vLLM's `fused_experts` with SiLU, its w1 = our w13).

    hidden_states: [T, H]; w13: [E, 2I, H] (gate rows :I, up rows I:); w2: [E, H, I];
    topk_weights: [T, K] float; topk_ids: [T, K] int32/int64 global expert ids;
    expert_start: global id of local expert 0 (expert parallelism: pairs routed outside
    [expert_start, expert_start + E) add nothing). Returns [T, H] in hidden_states' dtype.
    FP8 weights (weight-only): w13 / w2 float8_e4m3fn with w13_scale / w2_scale float32
    ([E] per tensor, or [E, 2I] / [E, H] per output row, as fp8.py stores a linear layer's).
    On CUDA the Triton kernels compute it (hidden_states float16, bfloat16 or float32, the
    weights in that dtype or FP8; float32 accumulation); elsewhere `moe_reference` (FP8
    weights dequantized first).
    Raises ValueError when the shapes disagree, or the weights' dtypes or scales do not fit.
    """
    check_moe_shapes(hidden_states, w13, w2, topk_weights, topk_ids)
    if use_triton_moe(hidden_states):
        from pagedserve.layers.moe.triton_moe import fused_moe_triton

        return fused_moe_triton(
            hidden_states, w13, w2, topk_weights, topk_ids, expert_start, w13_scale, w2_scale
        )
    if w13_scale is not None or w2_scale is not None:
        w13 = dequantize_experts(w13, w13_scale, hidden_states.dtype)
        w2 = dequantize_experts(w2, w2_scale, hidden_states.dtype)
    return moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, expert_start)
