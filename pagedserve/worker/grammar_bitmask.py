"""Apply a step's grammar bitmask (structured outputs) to the logits of its constrained rows.

vLLM does this in the GPU model runner (`apply_grammar_bitmask`) with xgrammar's kernel
before the sampler; so do we: before logit processors, penalties, temperature, top-k/top-p
and logprobs. Only the small bitmask travels to the device; the logits never leave it.
"""

import functools
from collections.abc import Callable

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
    banned past it. Raises KeyError if a constrained request has no logits row."""
    rows_of = {request_id: row for row, request_id in enumerate(sampled_request_ids)}
    rows = [rows_of[r] for r in grammar.structured_output_request_ids]
    bitmask = _to_device(torch.from_numpy(grammar.grammar_bitmask), logits.device)
    xgrammar_apply = _xgrammar_apply() if logits.is_cuda else None
    if xgrammar_apply is not None and logits.dtype == torch.float32:
        width = min(logits.shape[1], bitmask.shape[1] * 32)
        xgrammar_apply(logits, bitmask, vocab_size=width, indices=rows)
        if width < logits.shape[1]:
            logits[rows, width:] = _NEG_INF
        return
    rows_t = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    selected = logits.index_select(0, rows_t).masked_fill_(~allowed, _NEG_INF)
    logits.index_copy_(0, rows_t, selected)


# Two pinned staging buffers, used in turn: a step's copy may still be queued behind the
# forward in flight when the next step is launched (at most one step ahead).
_staging: list[torch.Tensor] = []
_turn = [0]


def _to_device(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The bitmask on `device`. To a GPU through pinned memory, so that the copy is queued
    behind the forward in flight instead of making the host wait for it (a copy from
    pageable memory can block until the stream reaches it)."""
    if device.type != "cuda":
        return bitmask
    numel = bitmask.numel()
    _turn[0] ^= 1
    if len(_staging) < 2:
        _staging[:] = [torch.empty(0, dtype=torch.int32).pin_memory() for _ in range(2)]
    if _staging[_turn[0]].numel() < numel:
        _staging[_turn[0]] = torch.empty(2 * numel, dtype=torch.int32).pin_memory()
    host = _staging[_turn[0]][:numel].view(bitmask.shape)
    host.copy_(bitmask)
    return host.to(device, non_blocking=True)


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
