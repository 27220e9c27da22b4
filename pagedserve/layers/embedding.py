"""Token embedding and LM head, both sharded over the vocabulary across tensor-parallel ranks."""

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.comm import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pagedserve.layers.linear import set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows: rank r holds token ids [r * n, (r + 1) * n), with
    n = ceil(num_embeddings / tp_size). Rows past the real vocabulary (padding of the last
    shard) are zero. Each rank embeds the ids it owns and the partial results are all-reduced.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings  # the real vocabulary size
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(
        self,
        param: nn.Parameter,  # [num_embeddings_per_partition, embedding_dim]
        loaded_weight: torch.Tensor,  # [num_embeddings, embedding_dim]
    ) -> None:
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"embedding checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected "
                f"{(self.num_embeddings, self.embedding_dim)}"
            )
        num_rows = max(0, min(self.num_embeddings, self.vocab_end_index) - self.vocab_start_index)
        param.data[:num_rows].copy_(loaded_weight.narrow(0, self.vocab_start_index, num_rows))
        param.data[num_rows:].zero_()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, embedding_dim] float
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(owned, input_ids - self.vocab_start_index, 0)
        embeddings = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1)
        return tensor_model_parallel_all_reduce(embeddings)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocabulary logits, sharded like `VocabParallelEmbedding`.

    For tied embeddings, assign the embedding's parameter: `lm_head.weight = embed.weight`
    (same shape and sharding on every rank). Use `compute_logits`, not `forward`.
    """

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead holds LM-head weights; call compute_logits()")

    def compute_logits(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, embedding_dim] float
    ) -> torch.Tensor:  # [num_tokens, num_embeddings] float32
        logits = F.linear(hidden_states, self.weight)  # [num_tokens, vocab shard]
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings].float()
