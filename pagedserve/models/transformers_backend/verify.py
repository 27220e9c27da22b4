"""Construction-time checks of the transformers backend that compare paged attention with the
model's own code: `check_attention_semantics` (each layer against its eager attention), and
`scratch_step`, the metadata of the checks' scratch paged cache."""

from collections.abc import Sequence

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.errors import UnsupportedModelError
from pagedserve.layers.attention import Attention
from pagedserve.models.transformers_backend.probe import LayerSpec

# Tokens of the attention check: two blocks of the scratch cache (`scratch_step`).
_CHECK_TOKENS = 8
# float32 on CPU: the same math differs by ~1e-5 here even at scores of 1e3; a soft cap, scale
# or sink applied by one side only moves outputs (mixes of values of std 1) by >= 1e-2.
_CHECK_TOLERANCE = 2e-3


def scratch_step(num_computed: int, num_new: int, device: torch.device) -> AttentionMetadata:
    """The metadata of one request feeding `num_new` tokens after `num_computed`, in blocks
    0 and 1 of 4 slots (the checks' scratch cache: [2, 2, 4, kv_heads, head_dim])."""
    seq_len = num_computed + num_new
    query_start_loc = torch.tensor([0, num_new], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32, device=device),
        slot_mapping=torch.arange(num_computed, seq_len, device=device),
        max_query_len=num_new,
        max_seq_len=seq_len,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def check_attention_semantics(specs: Sequence[LayerSpec], class_name: str) -> None:
    """Raise UnsupportedModelError unless, for every layer, paged attention built from its
    probed spec (scale, sliding window, soft cap; the torch reference backend, float32, CPU)
    gives the output of the model's own eager attention called as the model calls it
    (`LayerSpec.reference`) on the same 8 random tokens.

    The probe reads the spec off the call's arguments and transformers' mask; what a
    transformers version does beyond them (a soft cap, scale or attention sink that the
    eager code takes from the module rather than from an argument) shows here as different
    outputs. Query rows are scaled from 0.1x to 1000x, so that scores range from ~0.1 (a
    wrong scale shows) to ~1e3 (a soft cap up to ~1e3 shows)."""
    from pagedserve.attention.torch_backend import TorchAttentionBackend

    cpu = torch.device("cpu")
    metadata = scratch_step(0, _CHECK_TOKENS, cpu)
    for layer_idx, spec in enumerate(specs):
        generator = torch.Generator().manual_seed(layer_idx)
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        tokens = _CHECK_TOKENS
        query = torch.randn(1, heads, tokens, dim, generator=generator)
        exponents = torch.rand(1, heads, tokens, 1, generator=generator) * 4 - 1
        query = query * 10**exponents * (dim**-0.5 / spec.scale)  # scores as if scale 1/sqrt(D)
        key = torch.randn(1, kv_heads, tokens, dim, generator=generator)
        value = torch.randn(1, kv_heads, tokens, dim, generator=generator)
        positions = torch.arange(tokens)
        allowed = positions[None, :] <= positions[:, None]
        if spec.sliding_window is not None:
            allowed &= positions[None, :] > positions[:, None] - spec.sliding_window
        mask = torch.zeros(1, 1, tokens, tokens).masked_fill(
            ~allowed, torch.finfo(torch.float32).min
        )
        try:
            with torch.no_grad():
                expected = spec.reference(query, key, value, mask).reshape(tokens, -1)
        except Exception as e:  # e.g. eager code that reads module tensors (on the GPU)
            raise UnsupportedModelError(
                f"{class_name}'s eager attention of layer {layer_idx} could not be run as the "
                f"reference of paged attention ({type(e).__name__}: {e}); the transformers "
                f"backend cannot establish what its attention computes"
            ) from None
        paged = Attention(
            heads,
            dim,
            spec.scale,
            kv_heads,
            sliding_window=spec.sliding_window,
            logits_soft_cap=spec.logits_soft_cap,
        )
        paged.kv_cache = torch.zeros(2, 2, 4, kv_heads, dim)
        paged.backend = TorchAttentionBackend()
        with torch.no_grad():
            got = paged(
                query[0].transpose(0, 1).reshape(tokens, -1),
                key[0].transpose(0, 1).reshape(tokens, -1),
                value[0].transpose(0, 1).reshape(tokens, -1),
                metadata,
            )
        error = float((got - expected).abs().max()) if got.shape == expected.shape else None
        if error is None or not error <= _CHECK_TOLERANCE:
            found = "other shapes" if error is None else f"max abs difference {error:.3g}"
            raise UnsupportedModelError(
                f"{class_name}'s attention in layer {layer_idx} computes something other than "
                f"paged attention with what its call passes (scale {spec.scale:.4g}, sliding "
                f"window {spec.sliding_window}, soft cap {spec.logits_soft_cap}): its own eager "
                f"attention gives {found} on the same inputs (e.g. a soft cap, scale or sink "
                f"that this transformers version takes from the module rather than the call); "
                f"the transformers backend cannot run it"
            )
