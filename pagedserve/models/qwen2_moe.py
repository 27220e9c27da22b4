"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention and sparse MoE blocks with a
shared expert that every token goes through, scaled by a sigmoid gate."""

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.models.llama import LlamaAttention, LlamaMLP
from pagedserve.models.moe_base import MoeForCausalLM, SparseMoeBlock, is_sparse_layer


class Qwen2MoeAttention(LlamaAttention):
    """Llama attention with a q/k/v bias (the config's `qkv_bias`, on by default) and none on
    o_proj."""

    @classmethod
    def projection_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "qkv_bias", True)), False


def shared_expert_size(hf_config: Any) -> int:
    """The shared expert's intermediate size: `shared_expert_intermediate_size`, the config's
    `intermediate_size` when that is None (as transformers' Qwen2MoeMLP), 0 for a model with no
    shared expert (transformers then builds a zero-width MLP whose output is 0, so the block
    is the routed experts alone; vLLM builds none). Raises UnsupportedModelError when
    negative."""
    size = getattr(hf_config, "shared_expert_intermediate_size", None)
    if size is None:
        return int(hf_config.intermediate_size)
    if size < 0:
        raise UnsupportedModelError(
            f"shared_expert_intermediate_size must be >= 0 (0: no shared expert), got {size}"
        )
    return int(size)


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """Routed experts plus a shared expert (a dense SwiGLU MLP of `shared_expert_size`,
    tensor-parallel as any MLP) weighted per token by sigmoid(shared_expert_gate(x)), a
    replicated [1, hidden] linear. With size 0 there is no shared expert and no gate
    (`shared_expert` and `shared_expert_gate` are None): the routed experts alone."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config, hf_config.moe_intermediate_size)
        size = shared_expert_size(hf_config)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if size > 0:
            self.shared_expert = LlamaMLP(hf_config, intermediate_size=size)
            self.shared_expert_gate = ReplicatedLinear(hf_config.hidden_size, 1, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        routed = super().forward(hidden_states)
        if self.shared_expert is None or self.shared_expert_gate is None:
            return routed
        shared: torch.Tensor = self.shared_expert(hidden_states)
        shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return routed + shared


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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """`MoeForCausalLM.load_weights`, less the tensors of a shared expert the config has
        none of (shared_expert_intermediate_size 0): transformers' save_pretrained writes
        its zero-width projections and its gate, whose product with them is 0. A non-empty
        shared-expert projection there still raises UnsupportedModelError (no such
        parameter)."""
        without_shared = {
            name
            for name, module in self.named_modules()
            if isinstance(module, Qwen2MoeSparseMoeBlock) and module.shared_expert is None
        }

        def kept() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                block, _, rest = name.partition(".shared_expert")
                if block in without_shared and (rest.startswith("_gate.") or tensor.numel() == 0):
                    continue
                yield name, tensor

        return super().load_weights(kept())
