"""Phi-3 (and Phi-3.5 mini): the Llama architecture with fused qkv_proj and gate_up_proj
checkpoint tensors, LongRoPE scaling for the long-context variants (`layers.rotary`), and
transformers' sliding window on every layer (Phi-3-mini-4k: 2047)."""

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from pagedserve.layers.attention import Attention
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, get_head_dim
from pagedserve.quant_config import QuantizationConfig


def phi3_sliding_window(hf_config: Any) -> int | None:
    """The window transformers' Phi-3 applies to every layer: `sliding_window`, or None when
    it is absent or covers the whole context (Phi-3-mini-128k: 262144 > 131072)."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None or window >= hf_config.max_position_embeddings:
        return None
    return int(window)


class Phi3Attention(LlamaAttention):
    """Llama's attention, no projection biases, with the config's sliding window."""

    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(hf_config, rotary_emb, quant_config)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=phi3_sliding_window(hf_config),
        )

    @classmethod
    def projection_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return False, False  # transformers' Phi3Attention has none, whatever the config says


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM. The checkpoint's fused `qkv_proj` is cut into its q, k and v rows and
    `gate_up_proj` into halves before loading, so that each part is sharded over the
    tensor-parallel ranks as Llama's separate q/k/v and gate/up tensors are (a rank's slice of
    the fused tensor would mix q, k and v rows).
    """

    attention_cls: ClassVar[type[LlamaAttention]] = Phi3Attention
    # Quantized Phi-3 checkpoints pack the fused tensors along other dims: not handled yet.
    supports_quantization: ClassVar[bool] = False
    supports_pp: ClassVar[bool] = False  # not tested split over pipeline stages yet

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the checkpoint with qkv_proj / gate_up_proj replaced by q_proj, k_proj,
        v_proj / gate_proj, up_proj parts (narrowed views: a lazy slice stays lazy)."""
        config = self.config
        head_dim = get_head_dim(config)
        q_size = config.num_attention_heads * head_dim
        kv_size = (config.num_key_value_heads or config.num_attention_heads) * head_dim
        qkv_parts = ((".q_proj.", q_size), (".k_proj.", kv_size), (".v_proj.", kv_size))
        gate_up_parts = ((".gate_proj.", config.intermediate_size),) + (
            (".up_proj.", config.intermediate_size),
        )
        for name, tensor in weights:
            if ".qkv_proj." in name:
                yield from _split_rows(name, tensor, ".qkv_proj.", qkv_parts)
            elif ".gate_up_proj." in name:
                yield from _split_rows(name, tensor, ".gate_up_proj.", gate_up_parts)
            else:
                yield name, tensor


def _split_rows(
    name: str,
    tensor: torch.Tensor,  # [sum(sizes), ...] the fused checkpoint tensor (or a lazy view)
    fused: str,
    parts: tuple[tuple[str, int], ...],  # (name part replacing `fused`, rows)
) -> Iterator[tuple[str, torch.Tensor]]:
    """The consecutive row blocks of a fused tensor under their unfused names; ValueError
    naming both when the rows do not add up."""
    total = sum(rows for _, rows in parts)
    if tensor.shape[0] != total:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {total} "
            f"rows ({' + '.join(str(rows) for _, rows in parts)})"
        )
    offset = 0
    for part, rows in parts:
        yield name.replace(fused, part), tensor.narrow(0, offset, rows)
        offset += rows
