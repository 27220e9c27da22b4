"""TransformersForCausalLM: a transformers causal LM behind pagedserve's model interface."""

import copy
import inspect
import logging
import re
from collections.abc import Iterable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.parallel_state import get_tp_size
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.attention import Attention
from pagedserve.layers.linear import default_weight_loader
from pagedserve.models.transformers_backend.attention import (
    ATTN_IMPLEMENTATION,
    forward_context,
    probe_context,
    register_attention,
)
from pagedserve.models.transformers_backend.support import causal_lm_class

logger = logging.getLogger(__name__)


class TransformersForCausalLM(nn.Module):
    """Any AutoModelForCausalLM architecture on transformers' modeling code, with paged
    attention, as our native models: `forward(input_ids, positions, attn_metadata)` ->
    hidden states, `compute_logits`, `load_weights` (vLLM's TransformersForCausalLM).

    transformers builds the model (the class the config's `architectures` names, else
    `AutoModelForCausalLM`'s for its model_type; `from_config` in the default dtype
    on the default device that the loader sets) with `attn_implementation="pagedserve"`. Its
    children become this module's (so parameter names are the checkpoint's, e.g.
    `model.layers.0.self_attn.q_proj.weight`), and `paged_attention[i]` is the `Attention`
    module (owning the KV cache) of the transformers attention module whose `layer_idx` is i.
    Each layer's heads, head size, scale, sliding window and soft cap are read from one
    2-token probe forward at construction, i.e. from what the model's own code passes.

    The flat step goes in as one row: input_ids and position_ids [1, num_tokens]. Logits come
    from the causal LM's own forward over the given hidden states (its lm_head, tied or not,
    and whatever it does after: Gemma's final soft-capping, Granite's logits_scaling, Cohere's
    logit_scale), with the base model swapped for a pass-through.

    Raises ValueError under tensor parallelism (this backend runs on one rank) and
    UnsupportedModelError for a model whose attention the paged kernels cannot serve.
    """

    supports_quantization: ClassVar[bool] = False
    # Decode steps are captured in CUDA graphs when capture works; runner_setup falls back to
    # eager (one log line) for a model whose forward cannot be captured.
    cuda_graphs_best_effort: ClassVar[bool] = True
    _logits_head: nn.Module  # kept out of the module tree (its children are ours)

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        if get_tp_size() > 1:
            raise ValueError(
                f"the transformers backend (model_impl 'transformers') runs on one rank; "
                f"tensor_parallel_size {get_tp_size()} needs a native model (model_impl "
                f"'pagedserve')"
            )
        register_attention()
        # transformers sets the attention implementation on the config it is given: a copy
        # keeps the engine's config (shared in-process) as the user's.
        hf_config = copy.deepcopy(hf_config)
        hf_model = causal_lm_class(hf_config)._from_config(
            hf_config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.get_default_dtype()
        )
        self.config = hf_model.config
        prefix = hf_model.base_model_prefix
        if not isinstance(getattr(hf_model, prefix, None), nn.Module):
            raise UnsupportedModelError(
                f"{type(hf_model).__name__} has no base model {prefix!r} (its "
                f"base_model_prefix); the transformers backend cannot run it"
            )
        self.base_model_name = prefix
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self._renamings = _checkpoint_renamings(hf_model)
        self._ignored_names = [
            re.compile(pattern)
            for pattern in getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or []
        ]
        # The causal LM with a pass-through in place of its base model: its forward turns
        # final hidden states into logits exactly as the model's own code does.
        head = copy.copy(hf_model)
        head._modules = dict(hf_model._modules)
        head._modules[prefix] = _HiddenStatesPassThrough()
        head.training = False  # `eval()` on this module does not reach the copy
        self.__dict__["_logits_head"] = head
        parameters = inspect.signature(hf_model.forward).parameters
        self._head_kwargs: dict[str, Any] = {"use_cache": False, "return_dict": True}
        if "logits_to_keep" in parameters:
            self._head_kwargs["logits_to_keep"] = 0  # all rows
        layers = self._probe_attention_layers(type(hf_model).__name__)
        self.paged_attention = nn.ModuleList(layers)
        self._layers_by_index = layers  # the same modules, as the Sequence the context takes
        logger.info(
            "transformers backend: %s with %d paged attention layers",
            type(hf_model).__name__,
            len(self.paged_attention),
        )

    @property
    def base_model(self) -> nn.Module:
        """transformers' base model (embeddings, decoder layers, final norm)."""
        module: nn.Module = getattr(self, self.base_model_name)
        return module

    def _probe_attention_layers(self, class_name: str) -> list[Attention]:
        """One Attention module per attention layer, from a 2-token probe forward."""
        device = next(iter(self.parameters())).device
        ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
        positions = torch.arange(2, device=device)[None]
        with torch.no_grad(), probe_context() as specs:
            self.base_model(input_ids=ids, position_ids=positions, use_cache=False)
        if sorted(specs) != list(range(len(specs))) or not specs:
            raise UnsupportedModelError(
                f"{class_name} called the attention function for layers {sorted(specs)}; the "
                f"transformers backend needs every layer 0..N-1 to attend through it (models "
                f"that compute attention themselves, e.g. with ALiBi, or mix in recurrent "
                f"layers, are not supported)"
            )
        return [
            Attention(
                spec.num_heads,
                spec.head_dim,
                spec.scale,
                spec.num_kv_heads,
                sliding_window=spec.sliding_window,
                logits_soft_cap=spec.logits_soft_cap,
            )
            for _, spec in sorted(specs.items())
        ]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size] float, final norm applied
        with forward_context(attn_metadata, self._layers_by_index):
            outputs = self.base_model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        hidden_states: torch.Tensor = outputs[0][0]
        return hidden_states

    def compute_logits(
        self,
        hidden_states: torch.Tensor,  # [num_rows, hidden_size] float
    ) -> torch.Tensor:  # [num_rows, vocab_size] float32
        outputs = self._logits_head(inputs_embeds=hidden_states[None], **self._head_kwargs)
        logits: torch.Tensor = outputs.logits[0]
        return logits[:, : self.config.vocab_size].float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by their transformers names; a checkpoint saved from the
        base model alone (no `model.` prefix) or under another prefix is mapped onto ours.
        Saved buffers (rotary inv_freq, causal-mask buffers) and the names transformers
        ignores (`_keys_to_ignore_on_load_unexpected`) are skipped. Returns the names of our
        parameters loaded; raises UnsupportedModelError for a tensor with no parameter."""
        params = dict(self.named_parameters(remove_duplicate=False))
        canonical = {id(param): name for name, param in self.named_parameters()}
        buffers = {name for name, _ in self.named_buffers()}
        loaded: set[str] = set()
        for checkpoint_name, tensor in weights:
            name = self._parameter_name(checkpoint_name, params)
            if name is None:
                if self._skipped(checkpoint_name, buffers):
                    continue
                raise UnsupportedModelError(
                    f"checkpoint tensor {checkpoint_name!r} matches no parameter of "
                    f"{type(self._logits_head).__name__}; does config.json's architecture "
                    f"match the weights?"
                )
            param = params[name]
            default_weight_loader(param, tensor)
            loaded.add(canonical[id(param)])
        return loaded

    def _parameter_name(self, checkpoint_name: str, params: dict[str, nn.Parameter]) -> str | None:
        """Our parameter that a checkpoint tensor fills: its name after transformers' own
        renamings of the architecture's checkpoints (e.g. GPT-NeoX's `embed_out` ->
        `lm_head`), as it is or under the base model's prefix."""
        prefix = self.base_model_name + "."
        for renaming in self._renamings:
            renamed = renaming.rename_source_key(checkpoint_name)
            checkpoint_name = renamed[0] if isinstance(renamed, tuple) else renamed
        candidates = [checkpoint_name, prefix + checkpoint_name]
        first, _, rest = checkpoint_name.partition(".")
        if first in ("model", "transformer", "base_model") and rest:
            candidates.append(prefix + rest)
        return next((c for c in candidates if c in params), None)

    def _skipped(self, checkpoint_name: str, buffers: set[str]) -> bool:
        prefix = self.base_model_name + "."
        if checkpoint_name in buffers or prefix + checkpoint_name in buffers:
            return True
        if checkpoint_name.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")):
            return True
        return any(pattern.search(checkpoint_name) for pattern in self._ignored_names)


def _checkpoint_renamings(hf_model: nn.Module) -> list[Any]:
    """transformers' renamings from an architecture's checkpoint names to its module names
    (`WeightRenaming`s of `get_model_conversion_mapping`; transformers >= 5). Conversions that
    merge or split tensors (`WeightConverter`, e.g. fused MoE experts) are not applied: such a
    checkpoint fails to load with the tensor's name."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return []
    transforms = get_model_conversion_mapping(cast(Any, hf_model))
    # (rename_source_key is how transformers 5.x renames one key; a version without it
    # loads by module names only.)
    return [
        t
        for t in transforms
        if isinstance(t, WeightRenaming) and callable(getattr(t, "rename_source_key", None))
    ]


class _HiddenStatesPassThrough(nn.Module):
    """Stands in for a causal LM's base model: returns the hidden states it is given."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=inputs_embeds)
