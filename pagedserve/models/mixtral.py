"""Mixtral: Mistral's attention with every feed-forward block a sparse mixture of experts
(softmax top-k routing, top-k weights always renormalised)."""

from typing import ClassVar

from pagedserve.models.moe_base import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral 8x7B / 8x22B: Llama attention (no biases; the config's `sliding_window` on
    every layer, as Mistral), and in every layer `num_local_experts` SwiGLU experts of
    `intermediate_size`, `num_experts_per_tok` per token.

    Checkpoint names: `block_sparse_moe.gate` (router) and `block_sparse_moe.experts.{e}.w1 /
    w3 / w2` (gate / up / down) load into `mlp.gate` and `mlp.experts`' stacks.
    """

    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ((".block_sparse_moe.", ".mlp."),)
