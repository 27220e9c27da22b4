"""GPT-2: learned position embeddings, LayerNorm, fused c_attn and a tied LM head."""

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.activation import get_act_fn
from pagedserve.layers.attention import Attention
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    get_weight_loader,
)

# HF stores these GPT-2 weights as Conv1D, i.e. [in_features, out_features]: transpose them.
_CONV1D_WEIGHTS = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
# Causal-mask buffers that old GPT-2 checkpoints saved alongside the weights.
_SKIPPED_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    """Multi-head self-attention with a fused c_attn ([q | k | v]) and no RoPE."""

    def __init__(self, hf_config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        total_num_heads = hf_config.num_attention_heads
        self.head_dim = hidden_size // total_num_heads
        self.c_attn = QKVParallelLinear(hidden_size, self.head_dim, total_num_heads, bias=True)
        self.c_proj = RowParallelLinear(hidden_size, hidden_size, bias=True)
        scale = self.head_dim**-0.5 if getattr(hf_config, "scale_attn_weights", True) else 1.0
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.num_heads = self.c_attn.num_heads  # on this rank
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_heads)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        q, k, v = self.c_attn(hidden_states).chunk(3, dim=-1)
        out: torch.Tensor = self.c_proj(self.attn(q, k, v, attn_metadata))
        return out


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x))) with act = config.activation_function (gelu_new for GPT-2)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        intermediate_size = getattr(hf_config, "n_inner", None) or 4 * hidden_size
        self.c_fc = ColumnParallelLinear(hidden_size, intermediate_size, bias=True)
        self.c_proj = RowParallelLinear(intermediate_size, hidden_size, bias=True)
        self.act = get_act_fn(getattr(hf_config, "activation_function", "gelu_new"))

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size] float
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        out: torch.Tensor = self.c_proj(self.act(self.c_fc(x)))
        return out


class GPT2Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.))."""

    def __init__(self, hf_config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = hf_config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.attn = GPT2Attention(hf_config, layer_idx)
        self.ln_2 = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(hf_config)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), attn_metadata)
        out: torch.Tensor = hidden_states + self.mlp(self.ln_2(hidden_states))
        return out


class GPT2Model(nn.Module):
    """Token and position embeddings, blocks and final LayerNorm (HF's `transformer.`)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        if getattr(hf_config, "add_cross_attention", False):
            raise NotImplementedError("GPT-2 with cross-attention is not supported")
        hidden_size = hf_config.hidden_size
        self.wte = VocabParallelEmbedding(hf_config.vocab_size, hidden_size)
        self.wpe = nn.Embedding(hf_config.max_position_embeddings, hidden_size)
        self.h = nn.ModuleList(GPT2Block(hf_config, i) for i in range(hf_config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(hidden_size, eps=hf_config.layer_norm_epsilon)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden_states = block(hidden_states, attn_metadata)
        out: torch.Tensor = self.ln_f(hidden_states)
        return out


class GPT2LMHeadModel(nn.Module):
    """GPT-2 causal LM. The LM head shares `transformer.wte.weight` unless the config unties it.

    Checkpoints may name tensors with or without the `transformer.` prefix.
    """

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        self.transformer = GPT2Model(hf_config)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float, final LayerNorm applied
        out: torch.Tensor = self.transformer(input_ids, positions, attn_metadata)
        return out

    def compute_logits(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
    ) -> torch.Tensor:  # [num_tokens, vocab_size] float32
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns the names of our parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for checkpoint_name, tensor in weights:
            if checkpoint_name.endswith(_SKIPPED_BUFFERS):
                continue
            name = checkpoint_name
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name
            if self.tie_word_embeddings and name == "lm_head.weight":
                name = "transformer.wte.weight"  # the same tensor when tied
            if name not in params:
                raise UnsupportedModelError(
                    f"checkpoint tensor {checkpoint_name!r} matches no GPT-2 parameter"
                )
            param = params[name]
            if name.endswith(_CONV1D_WEIGHTS):
                tensor = tensor.t()
            if ".c_attn." in name:
                for shard_id, shard in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                    get_weight_loader(param)(param, shard, shard_id)
            else:
                get_weight_loader(param)(param, tensor)
            loaded.add(name)
        return loaded
