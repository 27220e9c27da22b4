"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with sparse MoE feed-forward blocks."""

from typing import Any, ClassVar

from torch import nn

from pagedserve.models.llama import LlamaAttention, LlamaMLP
from pagedserve.models.moe_base import MoeForCausalLM, SparseMoeBlock, is_sparse_layer
from pagedserve.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-30B-A3B / 235B-A22B: Qwen3 attention; layer i is sparse (`num_experts` experts
    of `moe_intermediate_size`, top `num_experts_per_tok`, renormalised when
    `norm_topk_prob`) unless in `mlp_only_layers` or (i + 1) is not a multiple of
    `decoder_sparse_step`, where it is a dense MLP of `intermediate_size`. No shared expert.
    """

    attention_cls: ClassVar[type[LlamaAttention]] = Qwen3Attention

    def build_mlp(self, hf_config: Any, layer_idx: int) -> nn.Module:
        if is_sparse_layer(hf_config, layer_idx):
            return SparseMoeBlock(hf_config, hf_config.moe_intermediate_size)
        return LlamaMLP(hf_config)
