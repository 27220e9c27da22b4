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

No mask function is registered for the name (transformers' `AttentionMaskInterface`): for an
implementation without one, transformers' `create_causal_mask` returns None at once, building
no dense mask (a registered one would also run its packed-sequence check, a device->host sync
every step). Causality, the cached prefix, sliding windows and request boundaries all come from
the AttentionMetadata instead.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.errors import UnsupportedModelError

ATTN_IMPLEMENTATION = "pagedserve"


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What one attention layer's call showed: the arguments of its `Attention` module."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None


class _ForwardContext:
    """The state one model forward runs under: the step's metadata and the model's layers, or
    (probing) the record of each layer's call."""

    def __init__(self) -> None:
        self.attn_metadata: AttentionMetadata | None = None
        self.layers: Sequence[torch.nn.Module] = ()
        self.probe: dict[int, LayerSpec] | None = None


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


@contextmanager
def probe_context() -> Iterator[dict[int, LayerSpec]]:
    """Run a model forward that only records each attention call (layer_idx -> LayerSpec) and
    returns its query as the output: how the wrapper learns each layer's heads, head size,
    scale, window and soft cap from the model's own code rather than from config names."""
    records: dict[int, LayerSpec] = {}
    previous = _context.probe
    _context.probe = records
    try:
        yield records
    finally:
        _context.probe = previous


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
    values of different head sizes, or a mask the model built itself (e.g. an ALiBi bias).
    """
    del dropout, kwargs  # inference: no dropout; other kwargs are other backends' options
    layer_idx = _check_call(module, query, key, value, attention_mask)
    _, num_heads, num_tokens, head_dim = query.shape
    if _context.probe is not None:
        if sliding_window is None:
            sliding_window = getattr(module, "sliding_window", None)
        _context.probe[layer_idx] = LayerSpec(
            num_heads=num_heads,
            num_kv_heads=key.shape[1],
            head_dim=head_dim,
            scale=float(scaling) if scaling is not None else head_dim**-0.5,
            sliding_window=int(sliding_window) if sliding_window else None,
            logits_soft_cap=float(softcap) if softcap else None,
        )
        return query.transpose(1, 2), None
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
    attention_mask: torch.Tensor | None,
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
    if attention_mask is not None:
        raise UnsupportedModelError(
            f"{name} got an attention mask that the model built itself (e.g. an ALiBi bias or "
            f"a custom mask); paged attention applies only causal, sliding-window and "
            f"soft-capped attention"
        )
    return layer_idx


def register_attention() -> None:
    """Register `paged_attention_forward` as transformers' `attn_implementation="pagedserve"`
    (idempotent; global to the process, as transformers' registry is)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
