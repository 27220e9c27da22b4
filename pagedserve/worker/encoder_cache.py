"""The encoder cache: each running request's image embeddings, computed once when a step
first feeds one of the image's placeholder tokens and kept until the request's prefill has
passed the image (vLLM's EncoderCacheManager and `_gather_mm_embeddings`, per request).

A chunked prefill may split an image's placeholder tokens across steps; each step puts in
the rows of the image that its own tokens cover:

    prompt positions   ... [ offset ............ offset + length ) ...
    this step's tokens          [ start ....... end )
    rows of the image            [start - offset, end - offset)
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pagedserve.step import ScheduledRequest
from pagedserve.worker.input_batch import CachedRequestState


class _ImageSlice(NamedTuple):
    """Rows [lo, hi) of one of a request's images go to the step's rows [row, row + hi - lo)."""

    row: int
    state: CachedRequestState
    image: int  # its index in the request's mm_features
    lo: int
    hi: int


def build_inputs_embeds(
    model: Any,  # has embed_input_ids and embed_mm_features (a multimodal model)
    scheduled: Sequence[ScheduledRequest],
    states: dict[str, CachedRequestState],
    input_ids: torch.Tensor,  # [num_tokens] int64, placeholders of async scheduling filled
    query_start_loc: Sequence[int],  # [num_reqs + 1]: each request's first row in input_ids
) -> torch.Tensor | None:  # [num_tokens, hidden_size] float, or None: no image token
    """The step's input embeddings with the images' rows in place of their placeholder
    tokens, encoding the images not in the cache yet (all of the step's in one batch); None
    when the step feeds no image token (the model then embeds input_ids itself, the
    text-only path). Drops the cached images whose tokens this step finishes feeding."""
    pieces: list[_ImageSlice] = []
    missing: list[tuple[CachedRequestState, int]] = []
    for i, request in enumerate(scheduled):
        state = states[request.request_id]
        start = request.num_computed_tokens
        end = start + request.num_new_tokens
        for k, feature in enumerate(state.mm_features):
            if not feature.overlaps(start, end):
                continue
            lo, hi = max(start, feature.offset), min(end, feature.end)  # prompt positions
            row = query_start_loc[i] + lo - start
            pieces.append(_ImageSlice(row, state, k, lo - feature.offset, hi - feature.offset))
            if k not in state.encoder_outputs:
                missing.append((state, k))
    if not pieces:
        return None
    if missing:
        _encode(model, missing, input_ids.device)
    embeds: torch.Tensor = model.embed_input_ids(input_ids)
    for row, state, k, lo, hi in pieces:
        embeds[row : row + hi - lo] = state.encoder_outputs[k][lo:hi].to(embeds.dtype)
    for request in scheduled:  # the prefill has passed these images: free them
        state = states[request.request_id]
        end = request.num_computed_tokens + request.num_new_tokens
        for k, feature in enumerate(state.mm_features):
            if feature.end <= end:
                state.encoder_outputs.pop(k, None)
    return embeds


def _encode(
    model: Any, missing: list[tuple[CachedRequestState, int]], device: torch.device
) -> None:
    """Run the vision encoder on the missing images in one batch (the model batches them its
    own way: `embed_mm_features`); cache each one's rows."""
    features = [state.mm_features[k] for state, k in missing]
    outputs = model.embed_mm_features(features, device)
    for (state, k), output in zip(missing, outputs, strict=True):
        feature = state.mm_features[k]
        if output.shape[0] != feature.length:
            raise RuntimeError(
                f"request {state.request_id}: image {k} has {feature.length} placeholder "
                f"tokens but the vision encoder gave {output.shape[0]} embeddings; the "
                f"processor's image size or patch size does not match the model's config"
            )
        state.encoder_outputs[k] = output
