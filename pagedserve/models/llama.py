"""Llama 2/3 and Mistral decoder-only models on paged attention (also the base of Qwen2/Qwen3)."""

from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.parallel_state import is_first_pp_rank, is_last_pp_rank
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.activation import SiluAndMul, get_gated_act_fn
from pagedserve.layers.attention import Attention
from pagedserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    get_weight_loader,
)
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, get_rope
from pagedserve.models.kv_scales import load_kv_scale
from pagedserve.models.pp_utils import (
    IntermediateTensors,
    PPMissingLayer,
    make_layers,
    missing_prefixes,
)
from pagedserve.quant_config import QuantizationConfig


def get_head_dim(hf_config: Any) -> int:
    """`head_dim` from the config when given, else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """Each decoder layer's sliding window (None: full causal attention), as transformers 5
    applies the config's `sliding_window`.

    Mistral applies it to every layer. Qwen2 and Qwen3 apply it only where `use_sliding_window`
    is true, to the layers that `layer_types` lists as "sliding_attention" (transformers
    derives those from `max_window_layers`: layers >= it; a config without `layer_types`
    gets the same rule here). A window at least `max_position_embeddings` wide is full
    attention. Raises NotImplementedError for a layer type other than full or sliding.
    """
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if not getattr(hf_config, "use_sliding_window", True):
        window = None
    if window is not None and window >= hf_config.max_position_embeddings:
        window = None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        first_windowed = getattr(hf_config, "max_window_layers", 0) or 0
        layer_types = [
            "sliding_attention" if i >= first_windowed else "full_attention"
            for i in range(num_layers)
        ]
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise NotImplementedError(
            f"layer_types {sorted(unknown)} are not supported; supported: 'full_attention', "
            f"'sliding_attention'"
        )
    return [window if t == "sliding_attention" else None for t in layer_types[:num_layers]]


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv_proj -> RoPE -> paged attention -> o_proj."""

    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        qkv_bias, o_proj_bias = self.projection_biases(hf_config)
        self.head_dim = get_head_dim(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size,
            self.head_dim,
            hf_config.num_attention_heads,
            getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            bias=qkv_bias,
            quant_config=quant_config,
        )
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # on this rank
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            hf_config.num_attention_heads * self.head_dim,
            hf_config.hidden_size,
            o_proj_bias,
            quant_config,
        )
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def rope_fusable(self) -> bool:
        """Whether the rotary embedding is one the qkv layer's `forward_rope` can apply: plain
        RoPE over whole heads (not M-RoPE, which a VLM may swap in after construction)."""
        rope = self.rotary_emb
        return type(rope) is RotaryEmbedding and rope.head_dim == self.head_dim

    @classmethod
    def projection_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        """(qkv_proj has bias, o_proj has bias); Llama uses `attention_bias` for both."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def split_qkv(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size] float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, q_size], [T, kv_size] x 2
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        qkv = None
        if positions.dim() == 1 and self.rope_fusable():  # the 4-bit GEMV rotates q and k
            qkv = self.qkv_proj.forward_rope(
                hidden_states,
                positions,
                self.rotary_emb.cos_sin_cache,
                self.head_dim,
                self.q_size + self.kv_size,
            )
        if qkv is not None:
            q, k, v = self.split_qkv(qkv)
        else:
            q, k, v = self.split_qkv(self.qkv_proj(hidden_states))
            q, k = self.rotary_emb(positions, q, k)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, attn_metadata))
        return out


class LlamaMLP(nn.Module):
    """Gated feed-forward: down_proj(act(gate_proj(x)) * up_proj(x)), gate/up fused; SwiGLU
    with Llama's silu, GeGLU with Gemma's tanh GELU (`hidden_act` overrides the config's)."""

    def __init__(
        self,
        hf_config: Any,
        quant_config: QuantizationConfig | None = None,
        hidden_act: str | None = None,
        intermediate_size: int | None = None,  # the config's intermediate_size when None
    ) -> None:
        super().__init__()
        self.act_fn = get_gated_act_fn(hidden_act or str(getattr(hf_config, "hidden_act", "silu")))
        self.silu_fusable = isinstance(self.act_fn, SiluAndMul)
        bias = bool(getattr(hf_config, "mlp_bias", False))
        if intermediate_size is None:
            intermediate_size = hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hf_config.hidden_size, [intermediate_size, intermediate_size], bias, quant_config
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hf_config.hidden_size, bias, quant_config
        )

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size] float
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float
        if self.silu_fusable:  # the 4-bit GEMV applies silu(gate) * up itself
            fused = self.gate_up_proj.forward_silu_and_mul(x)
            if fused is not None:
                out: torch.Tensor = self.down_proj(fused)
                return out
        out = self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; carries the residual stream separately so norms can fuse the add.
    `mlp` replaces the dense LlamaMLP (a mixture-of-experts block), called as mlp(x)."""

    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
        quant_config: QuantizationConfig | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(hf_config, rotary_emb, quant_config)
        self.mlp = mlp if mlp is not None else LlamaMLP(hf_config, quant_config)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
        residual: torch.Tensor | None,  # [num_tokens, hidden_size] float; None in layer 0
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (hidden_states, residual), both [T, hidden_size]
        hidden_states, residual = pre_norm_attention(
            self.input_layernorm, self.self_attn, positions, hidden_states, residual, attn_metadata
        )
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def pre_norm_attention(
    norm: RMSNorm,
    self_attn: LlamaAttention,
    positions: torch.Tensor,  # [num_tokens] int64
    hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
    residual: torch.Tensor | None,  # [num_tokens, hidden_size] float; None in layer 0
    attn_metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:  # (attention output, residual), both [T, hidden_size]
    """A block's first half: the residual stream gets the previous block's output added (none
    in layer 0) and is normed (fused with the add) into self-attention."""
    if residual is None:
        residual = hidden_states
        hidden_states = norm(hidden_states)
    else:
        hidden_states, residual = norm(hidden_states, residual)
    return self_attn(positions, hidden_states, attn_metadata), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix). `build_mlp(i)`, when
    given, builds layer i's feed-forward block (mixture-of-experts models).

    Under pipeline parallelism this stage builds only layers [start_layer, end_layer); the
    first stage alone the embedding, the last alone the final norm (`pp_utils`)."""

    def __init__(
        self,
        hf_config: Any,
        attention_cls: type[LlamaAttention],
        quant_config: QuantizationConfig | None = None,
        build_mlp: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
            if is_first_pp_rank()
            else PPMissingLayer()
        )
        rotary_emb = get_rope(hf_config, get_head_dim(hf_config))
        self.start_layer, self.end_layer, self.layers = make_layers(
            hf_config.num_hidden_layers,
            lambda i: LlamaDecoderLayer(
                hf_config,
                rotary_emb,
                attention_cls,
                quant_config,
                None if build_mlp is None else build_mlp(i),
            ),
        )
        windows = layer_sliding_windows(hf_config)
        for i in range(self.start_layer, self.end_layer):
            attn: Attention = self.layers[i].self_attn.attn  # type: ignore[union-attr,assignment]
            attn.sliding_window = windows[i]
        self.is_last_stage = is_last_pp_rank()
        self.norm: nn.Module = (
            RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
            if self.is_last_stage
            else PPMissingLayer()
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size] float
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:  # [num_tokens, hidden_size] float
        """`inputs_embeds`, when given, replaces `embed_tokens(input_ids)` (a multimodal
        model's prompt embeddings with its images' put in; CUDA graphs never pass it).
        `intermediate_tensors`: the previous pipeline stage's output, which a stage other
        than the first starts from (its `input_ids` unused). Returns the final-normed hidden
        states on the last stage, else this stage's IntermediateTensors for the next."""
        if intermediate_tensors is not None:
            hidden_states = intermediate_tensors.hidden_states
            residual: torch.Tensor | None = intermediate_tensors.residual
        else:
            hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        # islice: slicing a ModuleList builds a new module (costly on every step).
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        assert residual is not None  # every stage has at least one layer
        if not self.is_last_stage:
            return IntermediateTensors(hidden_states, residual)
        normed: torch.Tensor = self.norm(hidden_states, residual)[0]
        return normed


class LlamaForCausalLM(nn.Module):
    """Llama 2/3 (GQA, RoPE scaling, tied or untied embeddings) for paged inference.

    Checkpoint names map onto fused modules: q/k/v_proj -> qkv_proj, gate/up_proj ->
    gate_up_proj (`stacked_params_mapping`); KV cache scales go to the attention layers'
    buffers (`kv_scales.load_kv_scale`); everything else keeps its HF name.
    """

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    supports_quantization: ClassVar[bool] = True  # takes a quant_config for its linears
    # Builds only its pipeline stage's layers (`LlamaModel`); subclasses that build another
    # `self.model` or load weights their own way say False (vLLM's SupportsPP).
    supports_pp: ClassVar[bool] = True
    # (our parameter name part, checkpoint name part, shard id)
    stacked_params_mapping: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(self, hf_config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.model = self.build_model(hf_config, quant_config)
        self.lm_head: ParallelLMHead | PPMissingLayer = (
            ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
            if is_last_pp_rank()
            else PPMissingLayer()
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Tied on one stage: one tensor. The last of several stages has its own LM head,
        # loaded from the checkpoint's embedding (`load_weights`).
        if self.tie_word_embeddings and is_first_pp_rank() and is_last_pp_rank():
            self.lm_head.weight = self.get_parameter("model.embed_tokens.weight")

    def build_model(self, hf_config: Any, quant_config: QuantizationConfig | None) -> nn.Module:
        """`self.model`: embedding, decoder layers and final norm (Gemma builds its own)."""
        return LlamaModel(hf_config, self.attention_cls, quant_config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size] float
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:  # [num_tokens, hidden_size] float, final norm
        """`inputs_embeds`, `intermediate_tensors`: see LlamaModel.forward (passed only when
        given, so that models built on other `self.model` classes need not take them).
        Returns IntermediateTensors on a pipeline stage other than the last."""
        if intermediate_tensors is not None:
            out: torch.Tensor | IntermediateTensors = self.model(
                input_ids, positions, attn_metadata, intermediate_tensors=intermediate_tensors
            )
        elif inputs_embeds is None:
            out = self.model(input_ids, positions, attn_metadata)
        else:
            out = self.model(input_ids, positions, attn_metadata, inputs_embeds)
        return out

    def compute_logits(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size] float
    ) -> torch.Tensor:  # [num_tokens, vocab_size] float32
        assert isinstance(self.lm_head, ParallelLMHead)  # the last pipeline stage's
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns the names of our parameters loaded.
        A pipeline stage skips the tensors of the modules other stages hold."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        missing = missing_prefixes(self)  # () on one stage
        embed_missing = "model.embed_tokens." in missing
        for checkpoint_name, tensor in weights:
            if "rotary_emb.inv_freq" in checkpoint_name:
                continue  # a buffer some old checkpoints saved; we recompute it
            name = checkpoint_name
            if self.tie_word_embeddings and name == "lm_head.weight" and not embed_missing:
                name = "model.embed_tokens.weight"  # the same tensor when tied
            elif self.tie_word_embeddings and name == "model.embed_tokens.weight" and embed_missing:
                name = "lm_head.weight"  # the last stage's own copy of the tied tensor
            if name.startswith(missing):
                continue  # another pipeline stage's
            if load_kv_scale(self, checkpoint_name, tensor):
                continue  # the fp8 KV cache's k_scale / v_scale: buffers, not parameters
            for param_part, checkpoint_part, shard_id in self.stacked_params_mapping:
                if checkpoint_part in name:
                    name = name.replace(checkpoint_part, param_part)
                    param = _param(params, name, checkpoint_name)
                    get_weight_loader(param)(param, tensor, shard_id)
                    break
            else:
                param = _param(params, name, checkpoint_name)
                get_weight_loader(param)(param, tensor)
            loaded.add(name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama architecture, with its `sliding_window` (when set) on every layer
    (`layer_sliding_windows`)."""


def _param(params: dict[str, nn.Parameter], name: str, checkpoint_name: str) -> nn.Parameter:
    """Look up a parameter; a checkpoint tensor with no home means the wrong architecture."""
    if name not in params:
        raise UnsupportedModelError(
            f"checkpoint tensor {checkpoint_name!r} matches no model parameter (looked for "
            f"{name!r}); does config.json's architecture match the weights?"
        )
    return params[name]
