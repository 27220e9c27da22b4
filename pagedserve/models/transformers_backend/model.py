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
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.attention import Attention
from pagedserve.layers.linear import get_weight_loader
from pagedserve.models.transformers_backend.attention import (
    ATTN_IMPLEMENTATION,
    forward_context,
    register_attention,
)
from pagedserve.models.transformers_backend.probe import mask_probe, probe_records
from pagedserve.models.transformers_backend.support import (
    causal_lm_class,
    check_transformers_version,
)
from pagedserve.models.transformers_backend.tensor_parallel import shard_model
from pagedserve.models.transformers_backend.verify import check_attention_semantics, scratch_step

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
    2-token probe forward at construction, i.e. from what the model's own code passes, and
    checked against the model's own eager attention (`verify.check_attention_semantics`).

    The flat step goes in as one row: input_ids and position_ids [1, num_tokens]. Logits come
    from the causal LM's own forward over the given hidden states (its lm_head, tied or not,
    and whatever it does after: Gemma's final soft-capping, Granite's logits_scaling, Cohere's
    logit_scale), with the base model swapped for a pass-through.

    Under tensor parallelism the linears that the model's TP plan splits become column- /
    row-parallel layers (`tensor_parallel.shard_model`) before the probe, so each rank's
    attention layers get its share of the heads. Raises ValueError for tensor parallelism
    without a usable TP plan and UnsupportedModelError for a model whose attention the paged
    kernels cannot serve, or a transformers older than `support.MIN_TRANSFORMERS_VERSION`.
    """

    supports_quantization: ClassVar[bool] = False
    # Decode steps are captured in CUDA graphs when capture works; runner_setup falls back to
    # eager (one log line) for a model whose forward cannot be captured.
    cuda_graphs_best_effort: ClassVar[bool] = True
    _logits_head: nn.Module  # kept out of the module tree (its children are ours)

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        check_transformers_version()
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
        shard_model(hf_model, prefix)  # tensor parallelism by the model's TP plan (tp > 1)
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self._renamings, self._converts = _checkpoint_renamings(hf_model)
        self._ignored_names = [
            re.compile(pattern)
            for pattern in getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or []
        ]
        # The causal LM with a pass-through in place of its base model: its forward turns
        # final hidden states into logits exactly as the model's own code does.
        head = copy.copy(hf_model)
        head._modules = dict(hf_model._modules)
        head._modules[prefix] = _HiddenStatesPassThrough(getattr(hf_model, prefix))
        head.training = False  # `eval()` on this module does not reach the copy
        self.__dict__["_logits_head"] = head
        parameters = inspect.signature(hf_model.forward).parameters
        self._head_kwargs: dict[str, Any] = {"use_cache": False, "return_dict": True}
        if "logits_to_keep" in parameters:
            self._head_kwargs["logits_to_keep"] = 0  # all rows
        layers = self._probe_attention_layers(type(hf_model).__name__)
        self.paged_attention = nn.ModuleList(layers)
        self._layers_by_index = layers  # the same modules, as the Sequence the context takes
        self.eval()  # as the loader returns it: no dropout in the check below
        self._check_incremental(type(hf_model).__name__)
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
        """One Attention module per attention layer, from a 2-token probe forward (with
        transformers' masks as markers: `probe.mask_probe`); then the logits head runs once
        on its output, which must not attend again (an encoder-decoder's head that reruns
        the decoder) nor fail. Raises UnsupportedModelError for what `probe.record_call`
        refuses, for those heads, and for a layer whose eager attention computes otherwise
        than paged attention with the probed spec (`verify.check_attention_semantics`)."""
        device = next(iter(self.parameters())).device
        ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
        positions = torch.arange(2, device=device)[None]
        with torch.no_grad(), probe_records() as specs, mask_probe(ATTN_IMPLEMENTATION):
            outputs = self.base_model(input_ids=ids, position_ids=positions, use_cache=False)
        with torch.no_grad(), probe_records() as head_calls:
            try:
                self.compute_logits(outputs[0][0])
            except Exception as e:
                raise UnsupportedModelError(
                    f"{class_name}'s logits code fails on the final hidden states alone "
                    f"({type(e).__name__}: {e}); the transformers backend cannot run it"
                ) from None
        if head_calls:
            raise UnsupportedModelError(
                f"{class_name} attends again after its base model (its logits code runs "
                f"decoder layers); the transformers backend cannot run it"
            )
        if sorted(specs) != list(range(len(specs))) or not specs:
            raise UnsupportedModelError(
                f"{class_name} called the attention function for layers {sorted(specs)}; the "
                f"transformers backend needs every layer 0..N-1 to attend through it (models "
                f"that compute attention themselves, e.g. with ALiBi, or mix in recurrent "
                f"layers, are not supported)"
            )
        check_attention_semantics([specs[i] for i in range(len(specs))], class_name)
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

    def _check_incremental(self, class_name: str) -> None:
        """Raise UnsupportedModelError unless 6 tokens fed in one step and as 3 + 3 (the
        second step reading the first's K/V from a scratch paged cache) give the same hidden
        states: a model that keeps state outside its attention calls (Mamba or linear-
        attention layers, e.g. Falcon-H1, MiniMax) loses it between steps here, and one that
        numbers positions itself (BART's decoder) restarts them. It runs at construction, on
        the initial weights: in half precision only large differences show (the tolerance
        must stay above rounding), so a weak dependence may pass there."""
        from pagedserve.attention.torch_backend import TorchAttentionBackend

        device = next(iter(self.parameters())).device
        dtype = torch.get_default_dtype()
        vocab_size = int(getattr(self.config, "vocab_size", 0) or 2)
        ids = torch.arange(1, 7, device=device) % vocab_size
        for layer in self._layers_by_index:
            shape = (2, 2, 4, layer.num_kv_heads, layer.head_dim)
            layer.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.backend = TorchAttentionBackend()
        try:
            with torch.no_grad():
                whole = self(ids, torch.arange(6, device=device), scratch_step(0, 6, device))
                self(ids[:3], torch.arange(3, device=device), scratch_step(0, 3, device))
                second = self(
                    ids[3:], torch.arange(3, 6, device=device), scratch_step(3, 3, device)
                )
        finally:
            for layer in self._layers_by_index:
                layer.kv_cache, layer.backend = None, None
        error = float(
            (second - whole[3:]).float().norm() / whole[3:].float().norm().clamp(min=1e-6)
        )
        # Rounding alone differs by ~1e-7 in float32 and ~1e-2 in half precision; a model
        # that drops state between steps, even at its initial weights, by 5e-3 or much more.
        tolerance = 1e-3 if dtype == torch.float32 else 5e-2
        if not error < tolerance:
            raise UnsupportedModelError(
                f"{class_name} gives other outputs when a sequence is fed in two steps than "
                f"in one (relative difference {error:.3g}): it keeps state outside its "
                f"attention layers (e.g. Mamba or linear-attention layers) or computes "
                f"positions itself rather than from position_ids, which the transformers "
                f"backend does not support"
            )

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
                why = (
                    "transformers merges or splits this architecture's checkpoint tensors when "
                    "loading (e.g. per-expert MoE weights into fused ones), which the "
                    "transformers backend does not do yet (model_impl 'auto' runs native "
                    "architectures, e.g. Mixtral and Qwen MoE, with pagedserve's own code)"
                    if self._converts
                    else "does config.json's architecture match the weights?"
                )
                raise UnsupportedModelError(
                    f"checkpoint tensor {checkpoint_name!r} matches no parameter of "
                    f"{type(self._logits_head).__name__}; {why}"
                )
            param = params[name]
            get_weight_loader(param)(param, tensor)  # sharded linears take their rank's part
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


def _checkpoint_renamings(hf_model: nn.Module) -> tuple[list[Any], bool]:
    """transformers' renamings from an architecture's checkpoint names to its module names
    (`WeightRenaming`s of `get_model_conversion_mapping`; transformers >= 5). Conversions that
    merge or split tensors (`WeightConverter`, e.g. fused MoE experts) are not applied: such a
    checkpoint fails to load with the tensor's name; the bool says whether there are any."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return [], False
    transforms = get_model_conversion_mapping(cast(Any, hf_model))
    # (rename_source_key is how transformers 5.x renames one key; a version without it
    # loads by module names only.)
    renamings = [
        t
        for t in transforms
        if isinstance(t, WeightRenaming) and callable(getattr(t, "rename_source_key", None))
    ]
    return renamings, any(not isinstance(t, WeightRenaming) for t in transforms)


class _HiddenStatesPassThrough(nn.Module):
    """Stands in for a causal LM's base model: returns the hidden states it is given, in an
    output whose other fields (router logits, cross attentions, ...) are all None. The base
    model's other attributes are its own (e.g. Falcon-H1's `lm_head_multiplier`), but for
    its submodules, which pass through too (OPT's and BART's causal LMs call
    `self.model.decoder`)."""

    def __init__(self, base_model: nn.Module) -> None:
        super().__init__()
        self.__dict__["_wrapped"] = base_model  # not a child: its parameters are not ours

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = getattr(self.__dict__["_wrapped"], name)
            return _HiddenStatesPassThrough(value) if isinstance(value, nn.Module) else value

    def forward(self, *args: Any, inputs_embeds: torch.Tensor, **kwargs: Any) -> Any:
        return _PassThroughOutput(last_hidden_state=inputs_embeds)


def _pass_through_output_class() -> type:
    """A BaseModelOutputWithPast whose missing fields read as None (built on first use:
    transformers is imported lazily)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class PassThroughOutput(BaseModelOutputWithPast):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return PassThroughOutput


def _PassThroughOutput(last_hidden_state: torch.Tensor) -> Any:  # noqa: N802 (a class's role)
    global _output_class
    if _output_class is None:
        _output_class = _pass_through_output_class()
    return _output_class(last_hidden_state=last_hidden_state)


_output_class: type | None = None
