"""What the mixture-of-experts models share: the sparse MoE block (router + `FusedMoE`) and
a Llama-style causal LM whose feed-forward blocks may be sparse, loading real checkpoints'
per-expert tensors into the stacked expert weights.

Checkpoint names of one expert's projections (all loaded into `mlp.experts.w13_weight` /
`w2_weight`; Mixtral's `block_sparse_moe.` is renamed to `mlp.` first, as transformers 5
names the module):

    Mixtral     ...block_sparse_moe.experts.{e}.w1 / w3 / w2.weight   (gate / up / down)
    Qwen MoE    ...mlp.experts.{e}.gate_proj / up_proj / down_proj.weight
    stacked     ...mlp.experts.gate_up_proj [E, 2I, H], ...mlp.experts.down_proj [E, H, I]
                (transformers 5's in-memory layout; its save_pretrained writes per-expert
                tensors again, but a state dict saved directly has these)
"""

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.layers.moe.layer import FusedMoE
from pagedserve.layers.moe.routing import renormalizes_topk
from pagedserve.models.llama import LlamaForCausalLM, LlamaModel
from pagedserve.quant_config import QuantizationConfig

_PER_EXPERT = re.compile(
    r"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\."
    r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_STACKED = re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
# Checkpoint projection name -> FusedMoE shard id.
_SHARD_OF = {
    "w1": "w1",
    "gate_proj": "w1",
    "w3": "w3",
    "up_proj": "w3",
    "w2": "w2",
    "down_proj": "w2",
}


def num_experts(hf_config: Any) -> int:
    """The routed experts per MoE layer: `num_experts` (Qwen) or `num_local_experts`
    (Mixtral; transformers 5 maps each name to the other for some configs)."""
    value = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
    return int(value or 0)


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has a MoE block (else a dense MLP), by Qwen2-MoE /
    Qwen3-MoE's rule: not in `mlp_only_layers`, experts configured, and (layer_idx + 1) a
    multiple of `decoder_sparse_step`."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return layer_idx not in mlp_only and num_experts(hf_config) > 0 and (layer_idx + 1) % step == 0


class SparseMoeBlock(nn.Module):
    """Router `gate` (a replicated [num_experts, hidden] linear, no bias) and routed
    `experts` (`FusedMoE`): sum over each token's top-k experts of weight * expert(x).
    `intermediate_size` is one expert's (moe_intermediate_size; Mixtral's
    intermediate_size)."""

    def __init__(self, hf_config: Any, intermediate_size: int) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hf_config.hidden_size, num_experts(hf_config), bias=False)
        self.experts = FusedMoE(
            num_experts=num_experts(hf_config),
            top_k=hf_config.num_experts_per_tok,
            hidden_size=hf_config.hidden_size,
            intermediate_size=intermediate_size,
            renormalize=renormalizes_topk(hf_config),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        out: torch.Tensor = self.experts(hidden_states, self.gate(hidden_states))
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-style causal LM whose layer i's feed-forward block is `build_mlp(hf_config,
    i)`; loads per-expert or stacked expert tensors into the `FusedMoE` stacks (each rank
    only its own experts / slices) and everything else as Llama does."""

    # MoE layers take no quantization method yet: a quantized checkpoint is refused
    # (registry.check_model_impl names the method) rather than loaded wrongly.
    supports_quantization: ClassVar[bool] = False
    supports_pp: ClassVar[bool] = False  # the expert loader expects every layer
    # (checkpoint name part, ours) renamings applied before anything else.
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def build_model(self, hf_config: Any, quant_config: QuantizationConfig | None) -> nn.Module:
        return LlamaModel(
            hf_config,
            self.attention_cls,
            quant_config,
            build_mlp=lambda i: self.build_mlp(hf_config, i),
        )

    def build_mlp(self, hf_config: Any, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s feed-forward block; every layer sparse unless overridden."""
        return SparseMoeBlock(hf_config, hf_config.intermediate_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's `load_weights`, with the experts' tensors taken into the stacks first.
        Raises UnsupportedModelError when a checkpoint fills only some of a layer's experts
        (naming what is missing), or names experts of a layer without them."""
        loaded: set[str] = set()
        experts = {
            name: module for name, module in self.named_modules() if isinstance(module, FusedMoE)
        }

        def dense_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for checkpoint_name, tensor in weights:
                name = checkpoint_name
                for part, ours in self.checkpoint_renames:
                    name = name.replace(part, ours)
                if not self._load_expert_tensor(experts, name, checkpoint_name, tensor):
                    yield name, tensor

        loaded |= super().load_weights(dense_weights())
        for module_name, module in experts.items():
            missing = module.missing_weights()
            if not missing:
                loaded |= {f"{module_name}.w13_weight", f"{module_name}.w2_weight"}
            elif len(missing) < 3 * module.num_local_experts:  # some, not all: a gap
                shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
                raise UnsupportedModelError(
                    f"checkpoint has no tensors for {len(missing)} expert projections of "
                    f"{module_name}: {shown}"
                )
        return loaded

    @staticmethod
    def _load_expert_tensor(
        experts: dict[str, FusedMoE], name: str, checkpoint_name: str, tensor: torch.Tensor
    ) -> bool:
        """Load `tensor` into its FusedMoE if it is an expert projection; False otherwise."""
        match = _PER_EXPERT.match(name) or _STACKED.match(name)
        if match is None:
            return False
        module = experts.get(match["module"])
        if module is None:
            raise UnsupportedModelError(
                f"checkpoint tensor {checkpoint_name!r} is an expert's, but {match['module']!r} "
                f"is no mixture-of-experts layer of this model (mlp_only_layers / "
                f"decoder_sparse_step in config.json?)"
            )
        if "expert" in match.groupdict():
            module.load_expert_weight(tensor, int(match["expert"]), _SHARD_OF[match["proj"]])
        else:
            module.load_fused_weight(tensor, "w13" if match["proj"] == "gate_up_proj" else "w2")
        return True
