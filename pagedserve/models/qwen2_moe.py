"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention and sparse MoE blocks with a
shared expert that every token goes through, scaled by a sigmoid gate."""

from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.models.llama import LlamaAttention, LlamaMLP
from pagedserve.models.moe_base import MoeForCausalLM, SparseMoeBlock, is_sparse_layer


class Qwen2MoeAttention(LlamaAttention):
    """Llama attention with a q/k/v bias (the config's `qkv_bias`, on by default) and none on
    o_proj."""

    @classmethod
    def projection_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "qkv_bias", True)), False


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """Routed experts plus a shared expert (a dense SwiGLU MLP of
    `shared_expert_intermediate_size`, tensor-parallel as any MLP) weighted per token by
    sigmoid(shared_expert_gate(x)), a replicated [1, hidden] linear."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config, hf_config.moe_intermediate_size)
        self.shared_expert = LlamaMLP(
            hf_config, intermediate_size=hf_config.shared_expert_intermediate_size
        )
        self.shared_expert_gate = ReplicatedLinear(hf_config.hidden_size, 1, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        shared: torch.Tensor = self.shared_expert(hidden_states)
        shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return super().forward(hidden_states) + shared


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE: Qwen2 attention; layer i is a `Qwen2MoeSparseMoeBlock` unless in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`, where it is a
    dense MLP of `intermediate_size`. Routing renormalises the top-k when `norm_topk_prob`.
    """

    attention_cls: ClassVar[type[LlamaAttention]] = Qwen2MoeAttention

    def build_mlp(self, hf_config: Any, layer_idx: int) -> nn.Module:
        if is_sparse_layer(hf_config, layer_idx):
            return Qwen2MoeSparseMoeBlock(hf_config)
        return LlamaMLP(hf_config)
