"""The probe forward of the transformers backend: one 2-token forward of the model, at
construction, in which each attention call only records what paged attention must do for its
layer (heads, head size, scale, sliding window, soft cap), and refuses what it cannot do.

The window comes from the mask transformers builds for the layer, when it builds one: during
the probe a mask function is registered for our attention implementation (`mask_probe`) that
returns a marker carrying transformers' own mask predicate; `mask_window` reads the window
off that predicate. That is the window transformers' eager and SDPA attention apply, also for
models that put it only in the mask (e.g. PhiMoE), and a mask that is no causal sliding window
(chunked or bidirectional attention) is refused rather than silently run as causal. Outside the
probe no mask function is registered, so transformers builds no mask at all.

Each record also keeps the layer's reference: the model's own `eager_attention_forward` (the
function transformers runs for `attn_implementation="eager"`) bound to the module and the
exact arguments of the call. `verify.check_attention_semantics` runs it against paged
attention with the recorded spec, so that what the call's arguments do not show (a soft cap,
scale or sink that the eager code reads off the module, in some transformers version) is
refused instead of silently computed otherwise.
"""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.errors import UnsupportedModelError

# Keyword arguments of transformers' attention calls that change nothing here when set: the
# flat batch's layout (position ids, packed-sequence offsets), outputs we never return, and
# the arguments `paged_attention_forward` takes itself. Any other one with a value (e.g.
# GPT-OSS's attention sinks `s_aux`, a `position_bias`, sparse `indices`) changes the
# attention, so the model is refused.
_IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "output_attentions",
        "output_hidden_states",
        "use_cache",
        "return_dict",
        "layer_idx",
        "head_mask",
        "layer_head_mask",
    }
)
# Arguments that describe the probe forward's token layout, not the attention: left out of the
# reference call, which runs on other tokens.
_LAYOUT_KWARGS = frozenset(
    {"position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k"}
    | {"max_length_q", "max_length_k"}
)
# Query positions at which a layer's mask predicate is evaluated (against every key 0..last):
# windows up to _LAST_POSITION + 1 keys wide are told apart from full attention.
_LAST_POSITION = 2**18
_PROBED_QUERIES = (0, 1, 2, 7, 100, 4097, _LAST_POSITION // 2 + 3, _LAST_POSITION - 1)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What one attention layer's call showed: the arguments of its `Attention` module."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None
    # The model's eager attention with this call's arguments: (query [1, heads, T, head_dim],
    # key, value [1, kv_heads, T, head_dim], additive mask [1, 1, T, T]) -> [1, T, heads,
    # head_dim].
    reference: Callable[..., torch.Tensor] = field(compare=False, repr=False)


class _MaskMarker(torch.Tensor):
    """The mask the probe's mask function returns: an all-True boolean mask carrying the
    predicate transformers built it from (`mask_function`)."""

    mask_function: Callable[..., torch.Tensor]


_records: dict[int, LayerSpec] | None = None


def probing() -> bool:
    """Whether a probe forward is running (`probe_records`)."""
    return _records is not None


@contextmanager
def probe_records() -> Iterator[dict[int, LayerSpec]]:
    """Run a model forward whose attention calls only record (layer_idx -> LayerSpec) and
    return their query as the output."""
    global _records
    previous, _records = _records, {}
    try:
        yield _records
    finally:
        _records = previous


@contextmanager
def mask_probe(implementation: str) -> Iterator[None]:
    """Have transformers build masks for `implementation` (a `_MaskMarker` each) for the
    duration: registered in its AttentionMaskInterface, then removed again."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    previous = mapping.get(implementation)
    mapping[implementation] = _marker_mask
    try:
        yield
    finally:
        if previous is None:
            mapping.pop(implementation, None)
        else:
            mapping[implementation] = previous


def _marker_mask(
    batch_size: int = 1,
    q_length: int | None = None,
    kv_length: int = 1,
    mask_function: Callable[..., torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask-interface signature: an all-True mask of the usual shape that
    carries the mask predicate."""
    if mask_function is None:
        return None
    if q_length is None:  # transformers versions that pass cache_position instead
        q_length = len(kwargs.get("cache_position", ())) or kv_length
    mask = torch.ones(batch_size, 1, q_length, kv_length, dtype=torch.bool, device=device)
    marker = mask.as_subclass(_MaskMarker)
    marker.mask_function = mask_function
    return marker


def mask_window(mask_function: Callable[..., torch.Tensor], name: str) -> int | None:
    """The sliding window W (keys q - W + 1 .. q) of transformers' mask predicate
    `mask_function(batch_idx, head_idx, q_idx, kv_idx)`, or None for plain causal attention.
    Raises UnsupportedModelError for any other pattern (chunked, bidirectional, ...)."""
    queries = torch.tensor([*_PROBED_QUERIES, _LAST_POSITION])
    keys = torch.arange(_LAST_POSITION + 1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
    try:
        allowed = mask_function(zero, zero, queries.view(1, 1, -1, 1), keys.view(1, 1, 1, -1))
        allowed = allowed.expand(1, 1, len(queries), len(keys))[0, 0]
    except Exception as e:  # a predicate that only runs under vmap, or on other shapes
        raise UnsupportedModelError(
            f"{name}'s attention mask could not be evaluated ({type(e).__name__}: {e}); the "
            f"transformers backend applies only causal and sliding-window masks"
        ) from None
    num_keys = int(allowed[-1].sum())
    window = None if num_keys == _LAST_POSITION + 1 else num_keys
    first = queries - (window or _LAST_POSITION + 1) + 1
    expected = (keys[None, :] <= queries[:, None]) & (keys[None, :] >= first[:, None])
    if window == 0 or not torch.equal(allowed.bool(), expected):
        raise UnsupportedModelError(
            f"{name}'s attention mask is neither causal nor a causal sliding window (e.g. "
            f"chunked or bidirectional attention); paged attention applies only those"
        )
    return window


def record_call(
    module: torch.nn.Module,
    layer_idx: int,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict[str, Any],
) -> None:
    """Record one attention call of the probe forward (see the module docstring). Raises
    UnsupportedModelError for a layer that attends twice in one forward (a recurrent model,
    or differential attention: the cache holds one K/V per layer), a call that asks for
    non-causal attention or passes an argument that changes attention (`_IGNORED_KWARGS`),
    and a mask that is neither causal nor a sliding window."""
    assert _records is not None
    name = type(module).__name__
    if layer_idx in _records:
        raise UnsupportedModelError(
            f"{name} of layer {layer_idx} calls the attention function more than once per "
            f"forward (a recurrent model, or several attentions per layer); the paged KV cache "
            f"holds one key and value per layer"
        )
    if kwargs.get("is_causal", True) is False:
        raise UnsupportedModelError(
            f"{name} asks for non-causal attention (is_causal=False); the transformers backend "
            f"runs decoder-only text-generation models"
        )
    unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED_KWARGS | {"is_causal"})
    unknown = [k for k in unknown if kwargs[k] is not None]
    if unknown:
        raise UnsupportedModelError(
            f"{name} passes {', '.join(unknown)} to its attention function (e.g. attention "
            f"sinks or a position bias), which paged attention does not implement; the "
            f"transformers backend cannot run this model"
        )
    call_window = sliding_window
    if isinstance(attention_mask, _MaskMarker):
        sliding_window = mask_window(attention_mask.mask_function, name)
    elif attention_mask is not None:
        raise UnsupportedModelError(
            f"{name} got an attention mask that the model built itself (e.g. an ALiBi bias or "
            f"a custom mask); paged attention applies only causal, sliding-window and "
            f"soft-capped attention"
        )
    elif sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    reference = _eager_reference(module, name, scaling, call_window, softcap, kwargs)
    head_dim = query.shape[-1]
    _records[layer_idx] = LayerSpec(
        num_heads=query.shape[1],
        num_kv_heads=key.shape[1],
        head_dim=head_dim,
        scale=float(scaling) if scaling is not None else head_dim**-0.5,
        sliding_window=int(sliding_window) if sliding_window else None,
        logits_soft_cap=float(softcap) if softcap else None,
        reference=reference,
    )


def _eager_reference(
    module: torch.nn.Module,
    name: str,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict[str, Any],
) -> Callable[..., torch.Tensor]:
    """The module's modeling code's `eager_attention_forward` bound to `module` and the call's
    arguments (those the call gave; dropout 0). Raises UnsupportedModelError when that code
    has none: then nothing tells what the module's attention computes."""
    modeling = sys.modules.get(type(module).__module__)
    eager = getattr(modeling, "eager_attention_forward", None)
    if not callable(eager):
        raise UnsupportedModelError(
            f"{name}'s modeling code ({type(module).__module__}) has no "
            f"eager_attention_forward, the reference the transformers backend checks paged "
            f"attention against; it cannot run this model"
        )
    given = {"scaling": scaling, "sliding_window": sliding_window, "softcap": softcap}
    call = {k: v for k, v in kwargs.items() if k not in _LAYOUT_KWARGS}
    call |= {k: v for k, v in given.items() if v is not None} | {"dropout": 0.0}

    def reference(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        # Under tensor parallelism a rank holds num_heads / tp query heads and its KV heads
        # (replicated when fewer than the ranks), so the module's config-wide
        # num_key_value_groups need not match this rank's ratio: the keys are expanded to
        # one per query head here, and the eager code told to repeat nothing.
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        saved = getattr(module, "num_key_value_groups", None)
        if saved is not None:
            setattr(module, "num_key_value_groups", 1)  # noqa: B010 (an int, not a Module)
        try:
            output: torch.Tensor = eager(module, query, key, value, mask, **call)[0]
        finally:
            if saved is not None:
                setattr(module, "num_key_value_groups", saved)  # noqa: B010
        return output

    return reference
