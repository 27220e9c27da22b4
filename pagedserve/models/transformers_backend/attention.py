"""The attention function that transformers' modeling code calls when a model is built with
`attn_implementation="pagedserve"`, and the forward context that gives it the step.

transformers looks the function up in its registry (`AttentionInterface`) by the config's
`_attn_implementation` and calls it from each attention module as
`fn(module, query, key, value, attention_mask, scaling=..., sliding_window=..., softcap=...)`
with query [1, num_heads, num_tokens, head_dim] and key/value [1, num_kv_heads, num_tokens,
head_dim] (keys not yet repeated for GQA). Ours writes the new K/V into the paged cache and
attends through the layer's `pagedserve.layers.attention.Attention` (found by the module's
`layer_idx`), using the step's AttentionMetadata that the model wrapper's forward put in the
context.

No mask function is registered for the name (transformers' `AttentionMaskInterface`) outside
the construction-time probe (`probe.py`): for an implementation without one, transformers'
`create_causal_mask` returns None at once, building no dense mask (a registered one would also
run its packed-sequence check, a device->host sync every step). Causality, the cached prefix,
sliding windows and request boundaries all come from the AttentionMetadata instead.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.errors import UnsupportedModelError
from pagedserve.models.transformers_backend.probe import probing, record_call

ATTN_IMPLEMENTATION = "pagedserve"


class _ForwardContext:
    """The state one model forward runs under: the step's metadata and the model's layers."""

    def __init__(self) -> None:
        self.attn_metadata: AttentionMetadata | None = None
        self.layers: Sequence[torch.nn.Module] = ()


_context = _ForwardContext()


@contextmanager
def forward_context(
    attn_metadata: AttentionMetadata, layers: Sequence[torch.nn.Module]
) -> Iterator[None]:
    """Run a model forward with `attn_metadata` reaching every attention call; `layers[i]` is
    the Attention module of the transformers module whose `layer_idx` is i."""
    previous = (_context.attn_metadata, _context.layers)
    _context.attn_metadata, _context.layers = attn_metadata, layers
    try:
        yield
    finally:
        _context.attn_metadata, _context.layers = previous


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # [1, num_tokens, num_heads, head_dim], no weights
    """transformers' attention-function signature (`AttentionInterface`) on paged attention.

    Raises UnsupportedModelError for a call the paged kernels cannot serve: no `layer_idx` on
    the module, a batch of more than one row, non-causal attention (an encoder), keys and
    values of different head sizes; during the probe forward also what `probe.record_call`
    refuses (a mask the model built itself, attention sinks, a layer attending twice, ...).
    """
    del dropout  # inference: no dropout
    layer_idx = _check_call(module, query, key, value)
    _, num_heads, num_tokens, head_dim = query.shape
    if probing():  # the kwargs and the mask were checked by the probe, once per layer
        record_call(
            module, layer_idx, query, key, attention_mask, scaling, sliding_window, softcap, kwargs
        )
        return query.transpose(1, 2), None
    if attention_mask is not None:
        raise RuntimeError(
            f"{type(module).__name__} got an attention mask outside the probe forward"
        )
    metadata = _context.attn_metadata
    if metadata is None or layer_idx >= len(_context.layers):
        raise RuntimeError("the transformers backend's model ran outside its forward context")
    layer = _context.layers[layer_idx]
    out = layer(
        query[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim),
        key[0].transpose(0, 1).reshape(num_tokens, -1),
        value[0].transpose(0, 1).reshape(num_tokens, -1),
        metadata,
    )
    return out.view(1, num_tokens, num_heads, head_dim), None


def _check_call(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> int:
    """The module's layer index, after the checks of `paged_attention_forward`."""
    name = type(module).__name__
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise UnsupportedModelError(
            f"{name} has no layer_idx: the transformers backend needs one per attention layer "
            f"to find its KV cache"
        )
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError(
            f"{name} is not causal (an encoder's attention): the transformers backend runs "
            f"decoder-only text-generation models"
        )
    if query.shape[0] != 1:
        raise RuntimeError(
            f"expected the flat batch [1, heads, tokens, head_dim], got {query.shape}"
        )
    if key.shape[-1] != value.shape[-1] or key.shape[-1] != query.shape[-1]:
        raise UnsupportedModelError(
            f"{name} uses different head sizes for query {query.shape[-1]}, key {key.shape[-1]} "
            f"and value {value.shape[-1]}; paged attention needs one"
        )
    return layer_idx


def register_attention() -> None:
    """Register `paged_attention_forward` as transformers' `attn_implementation="pagedserve"`
    (idempotent; global to the process, as transformers' registry is)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
