"""`FusedMoE`: the experts of a mixture-of-experts layer as two stacked weights, routed,
computed by `fused_moe` and summed over the ranks.

How the experts are spread over the tensor-parallel ranks (vLLM's two modes):

    tensor parallel (default)              expert parallel (--enable-expert-parallel)
    every rank holds every expert,         rank r holds experts [r*E/n, (r+1)*E/n) whole
    1/n of each one's intermediate dim
    rank 0: e0[:I/n] e1[:I/n] ...          rank 0: e0 e1 ... e(E/n - 1)
    rank 1: e0[I/n:] e1[I/n:] ...          rank 1: e(E/n) ...

Either way each rank computes a partial sum for every token - its slice of each chosen
expert, or the chosen experts it holds (the others add nothing) - and one all-reduce over
the ranks adds them up. Under expert parallelism that all-reduce is the token exchange: the
attention layers leave every rank with the same hidden states of all tokens (tensor-parallel
attention ends in an all-reduce), so each rank already has the tokens its experts need, and
the all-reduce brings every token the outputs of the experts on the other ranks.
"""

import torch
from torch import nn

from pagedserve.distributed.comm import tensor_model_parallel_all_reduce
from pagedserve.distributed.parallel_state import get_expert_parallel, get_tp_rank, get_tp_size
from pagedserve.layers.moe.fused_moe import fused_moe
from pagedserve.layers.moe.routing import select_experts

# Checkpoint projections of one expert -> (our stacked weight, row block in it).
# w1 = gate_proj (w13 rows [0, I)), w3 = up_proj (w13 rows [I, 2I)), w2 = down_proj.
EXPERT_SHARDS = ("w1", "w2", "w3")


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer (SwiGLU experts, softmax top-k routing).

    Parameters on this rank: `w13_weight` [E_local, 2 * I_local, H], each local expert's
    gate projection (rows :I_local) over its up projection (rows I_local:), and `w2_weight`
    [E_local, H, I_local], its down projection (nn.Linear layout). Under tensor parallelism
    E_local = num_experts and I_local = intermediate_size / tp_size (rank r's columns
    [r * I_local, (r + 1) * I_local) of every expert); under expert parallelism
    E_local = num_experts / tp_size (global ids from `expert_start`) and I_local =
    intermediate_size. Raises ValueError when the split is uneven (naming the counts).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,  # of one expert, over all ranks
        renormalize: bool,
    ) -> None:
        super().__init__()
        tp_rank, tp_size = get_tp_rank(), get_tp_size()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.reduce = tp_size > 1
        if get_expert_parallel() and tp_size > 1:
            if num_experts % tp_size:
                raise ValueError(
                    f"num_experts ({num_experts}) is not divisible by the expert-parallel size "
                    f"(tensor_parallel_size {tp_size}); each rank must hold as many experts"
                )
            self.num_local_experts = num_experts // tp_size
            self.expert_start = tp_rank * self.num_local_experts
            self.shard_rank, self.num_shards = 0, 1  # whole experts: no intermediate split
        else:
            if intermediate_size % tp_size:
                raise ValueError(
                    f"the experts' intermediate size ({intermediate_size}) is not divisible by "
                    f"tensor_parallel_size ({tp_size}); enable_expert_parallel places whole "
                    f"experts on the ranks instead"
                )
            self.num_local_experts, self.expert_start = num_experts, 0
            self.shard_rank, self.num_shards = tp_rank, tp_size
        self.intermediate_size = intermediate_size
        self.intermediate_per_rank = intermediate_size // self.num_shards
        i_local = self.intermediate_per_rank
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * i_local, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, i_local), requires_grad=False
        )
        # (local expert, shard) pieces filled from a checkpoint: `missing_weights` lists the
        # rest, so a checkpoint lacking one expert's tensor is an error, not random weights.
        self._loaded: set[tuple[int, str]] = set()

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float, the same on every rank
        router_logits: torch.Tensor,  # [num_tokens, num_experts] float
    ) -> torch.Tensor:  # [num_tokens, hidden_size], summed over the ranks
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_moe(
            hidden_states,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            self.expert_start,
        )
        return tensor_model_parallel_all_reduce(out) if self.reduce else out

    def is_local(self, expert_id: int) -> bool:
        """Whether global expert `expert_id` lives on this rank."""
        return self.expert_start <= expert_id < self.expert_start + self.num_local_experts

    def load_expert_weight(
        self,
        loaded_weight: torch.Tensor,  # [I, H] for w1/w3, [H, I] for w2 (full, unsharded)
        expert_id: int,  # global
        shard_id: str,  # "w1" (gate_proj), "w3" (up_proj) or "w2" (down_proj)
    ) -> bool:
        """Copy this rank's part of one expert's checkpoint projection into the stack;
        returns False (reading nothing) for another rank's expert. Raises ValueError for an
        unknown shard_id, an expert id out of range, or a tensor of the wrong shape."""
        if shard_id not in EXPERT_SHARDS:
            raise ValueError(f"expert shard_id must be one of {EXPERT_SHARDS}, got {shard_id!r}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range (num_experts {self.num_experts})")
        if not self.is_local(expert_id):
            return False
        local = expert_id - self.expert_start
        i_local, hidden = self.intermediate_per_rank, self.w2_weight.shape[1]
        full = (
            (self.intermediate_size, hidden)
            if shard_id != "w2"
            else (hidden, self.intermediate_size)
        )
        if tuple(loaded_weight.shape) != full:
            raise ValueError(
                f"expert {expert_id} {shard_id} has shape {tuple(loaded_weight.shape)}, "
                f"expected {full}"
            )
        start = self.shard_rank * i_local
        if shard_id == "w2":
            self.w2_weight.data[local].copy_(loaded_weight.narrow(1, start, i_local))
        else:
            row = 0 if shard_id == "w1" else i_local
            target = self.w13_weight.data[local].narrow(0, row, i_local)
            target.copy_(loaded_weight.narrow(0, start, i_local))
        self._loaded.add((local, shard_id))
        return True

    def load_fused_weight(
        self,
        loaded_weight: torch.Tensor,  # [E, 2I, H] gate_up_proj or [E, H, I] down_proj
        which: str,  # "w13" or "w2"
    ) -> None:
        """Copy this rank's part of all experts' stacked projections (transformers 5's
        in-memory layout: `experts.gate_up_proj` [E, 2I, H] with gate rows first,
        `experts.down_proj` [E, H, I]). Raises ValueError for a tensor of the wrong shape."""
        num, inter, hidden = self.num_experts, self.intermediate_size, self.w2_weight.shape[1]
        full = (num, 2 * inter, hidden) if which == "w13" else (num, hidden, inter)
        if tuple(loaded_weight.shape) != full:
            raise ValueError(
                f"stacked experts' {which} has shape {tuple(loaded_weight.shape)}, expected {full}"
            )
        mine = loaded_weight.narrow(0, self.expert_start, self.num_local_experts)
        i_local, start = self.intermediate_per_rank, self.shard_rank * self.intermediate_per_rank
        if which == "w2":
            self.w2_weight.data.copy_(mine.narrow(2, start, i_local))
            shards: tuple[str, ...] = ("w2",)
        else:
            for block in (0, 1):  # gate rows [0, I), up rows [I, 2I)
                part = mine.narrow(1, block * inter + start, i_local)
                self.w13_weight.data.narrow(1, block * i_local, i_local).copy_(part)
            shards = ("w1", "w3")
        self._loaded.update((e, s) for e in range(self.num_local_experts) for s in shards)

    def missing_weights(self) -> list[str]:
        """The local experts' projections no checkpoint tensor has filled, as
        "expert E wN" (global ids); empty once all are loaded."""
        return [
            f"expert {self.expert_start + e} {s}"
            for e in range(self.num_local_experts)
            for s in EXPERT_SHARDS
            if (e, s) not in self._loaded
        ]

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_local_experts}/{self.num_experts} (from {self.expert_start}), "
            f"top_k={self.top_k}, intermediate={self.intermediate_per_rank}/"
            f"{self.intermediate_size}, renormalize={self.renormalize}"
        )
