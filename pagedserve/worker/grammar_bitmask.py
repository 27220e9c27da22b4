"""Apply a step's grammar bitmask (structured outputs) to the logits of its constrained rows.

vLLM does this in the GPU model runner (`apply_grammar_bitmask`) with xgrammar's kernel
before the sampler; so do we: before logit processors, penalties, temperature, top-k/top-p
and logprobs. Only the small bitmask travels to the device; the logits never leave it.
"""

import functools
from collections.abc import Callable

import numpy as np
import torch

from pagedserve.step import GrammarOutput

_NEG_INF = float("-inf")


def apply_grammar_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab_size] float, changed in place
    grammar: GrammarOutput,
    sampled_request_ids: list[str],  # the request of each logits row
) -> None:
    """Set to -inf every logit that the row's grammar forbids. Rows of requests without a
    constraint are left as they are. Logits wider than the bitmask (a padded vocabulary) are
    banned past it. Raises KeyError if a constrained request has no logits row.

    On a GPU nothing here waits for the device: the bitmask and its row indices travel through
    pinned memory (a copy from pageable memory would first wait for the forward in flight),
    and the rows are placed into a full-batch bitmask on the device, as xgrammar's kernel
    reads bitmask row `i` for logits row `i`."""
    rows_of = {request_id: row for row, request_id in enumerate(sampled_request_ids)}
    rows = [rows_of[r] for r in grammar.structured_output_request_ids]
    compact = torch.from_numpy(grammar.grammar_bitmask)  # [len(rows), num_words] int32
    if not logits.is_cuda:
        rows_t = torch.tensor(rows, dtype=torch.int64)
        allowed = unpack_bitmask(compact, logits.shape[1])
        selected = logits.index_select(0, rows_t).masked_fill_(~allowed, _NEG_INF)
        logits.index_copy_(0, rows_t, selected)
        return
    bitmask, rows_t = _to_device(compact, rows, logits.device)
    width = min(logits.shape[1], compact.shape[1] * 32)
    xgrammar_apply = _xgrammar_apply()
    if xgrammar_apply is not None and logits.dtype == torch.float32:
        # All ones (every token allowed) but the constrained rows, which the kernel visits.
        full = torch.full((logits.shape[0], compact.shape[1]), -1, dtype=torch.int32,
                          device=logits.device)  # fmt: skip
        full.index_copy_(0, rows_t.long(), bitmask)
        xgrammar_apply(logits, full, vocab_size=width, indices=rows_t)
    else:
        rows_l = rows_t.long()
        allowed = unpack_bitmask(bitmask, width)
        selected = logits[:, :width].index_select(0, rows_l).masked_fill_(~allowed, _NEG_INF)
        logits[:, :width].index_copy_(0, rows_l, selected)
    if width < logits.shape[1]:
        logits[:, width:].index_fill_(0, rows_t.long(), _NEG_INF)


# Two pinned staging buffers, used in turn: a step's copy may still be queued behind the
# forward in flight when the next step is launched (at most one step ahead). Each holds a
# step's row indices followed by its bitmask, as int32.
_staging: list[torch.Tensor] = []
_turn = [0]


def pinned_host_bitmask(shape: tuple[int, int]) -> np.ndarray:
    """An int32 host array in pinned (page-locked) memory, [rows, words]: a structured-output
    manager fills its bitmasks there (`use_bitmask_buffers`), and `apply_grammar_bitmask`
    copies them to the GPU straight from it, with no staging copy."""
    with torch.inference_mode():
        return torch.empty(shape, dtype=torch.int32, pin_memory=True).numpy()


def _to_device(
    bitmask: torch.Tensor,  # [num_rows, num_words] int32, host
    rows: list[int],  # [num_rows]
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_rows, num_words], [num_rows]) int32 on device
    """The bitmask and its row indices on the GPU `device`, through one pinned buffer, so that
    the copy is queued behind the forward in flight instead of making the host wait for it.
    A bitmask already in pinned memory (`pinned_host_bitmask`) goes as it is; only its row
    indices are staged."""
    pinned = bitmask.is_pinned()
    num_rows, num_words = bitmask.shape
    numel = num_rows * (1 if pinned else num_words + 1)
    _turn[0] ^= 1
    if len(_staging) < 2:
        _staging[:] = [torch.empty(0, dtype=torch.int32).pin_memory() for _ in range(2)]
    if _staging[_turn[0]].numel() < numel:
        _staging[_turn[0]] = torch.empty(2 * numel, dtype=torch.int32).pin_memory()
    with torch.inference_mode():  # the buffers may have been made under it (inference tensors)
        host = _staging[_turn[0]][:numel]
        host[:num_rows] = torch.tensor(rows, dtype=torch.int32)
        if pinned:
            return bitmask.to(device, non_blocking=True), host.to(device, non_blocking=True)
        host[num_rows:].view(num_rows, num_words).copy_(bitmask)
        on_device = host.to(device, non_blocking=True)
    return on_device[num_rows:].view(num_rows, num_words), on_device[:num_rows]


def unpack_bitmask(
    bitmask: torch.Tensor,  # [num_rows, num_words] int32
    vocab_size: int,
) -> torch.Tensor:  # [num_rows, vocab_size] bool, True = allowed
    """The bitmask as booleans: bit b of word w is token 32 * w + b. Tokens past the mask's
    32 * num_words bits are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: & 1 reads the bit
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    padding = torch.zeros(
        bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device
    )
    return torch.cat([allowed, padding], dim=1)


@functools.cache
def _xgrammar_apply() -> Callable[..., None] | None:
    """xgrammar's CUDA kernel where xgrammar is installed (the GPU image carries a wheel),
    imported on the first constrained GPU step; the torch path above is the fallback and
    the CPU path."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    apply: Callable[..., None] = apply_token_bitmask_inplace
    return apply
