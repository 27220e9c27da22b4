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

    On the CPU, xgrammar's C++ kernel applies each run of consecutive constrained rows in
    place (the torch path, which unpacks the mask into [rows, vocab] temporaries, is the
    fallback without xgrammar). On a GPU nothing here waits for the device: the bitmask and
    its row indices travel through pinned memory (a copy from pageable memory would first wait
    for the forward in flight); xgrammar's kernel reads bitmask row `i` for logits row `i`, so
    the rows are placed into a full-batch bitmask on the device, unless every row is
    constrained in batch order: then the bitmask is that full-batch mask already."""
    rows_of = {request_id: row for row, request_id in enumerate(sampled_request_ids)}
    rows = [rows_of[r] for r in grammar.structured_output_request_ids]
    compact = torch.from_numpy(grammar.grammar_bitmask)  # [len(rows), num_words] int32
    width = min(logits.shape[1], compact.shape[1] * 32)
    xgrammar_apply = _xgrammar_apply()
    if not logits.is_cuda:
        if xgrammar_apply is not None and logits.dtype in _XGRAMMAR_CPU_DTYPES:
            # xgrammar's C++ loop reads each bit once and writes only the banned logits; the
            # torch path below makes [rows, vocab] temporaries (6x slower for 256 x 151936).
            for start, stop, first in _runs(rows):
                xgrammar_apply(logits[first : first + stop - start], compact[start:stop],
                               vocab_size=width)  # fmt: skip
        else:
            rows_t = torch.tensor(rows, dtype=torch.int64)
            allowed = unpack_bitmask(compact, width)
            selected = logits[:, :width].index_select(0, rows_t).masked_fill_(~allowed, _NEG_INF)
            logits[:, :width].index_copy_(0, rows_t, selected)
        if width < logits.shape[1]:
            logits[rows, width:] = _NEG_INF
        return
    bitmask, rows_t = _to_device(compact, rows, logits.device)
    if xgrammar_apply is not None and logits.dtype == torch.float32:
        if rows == list(range(logits.shape[0])):
            # Every row constrained, in order: the bitmask is the full-batch mask as it is
            # (no [batch, words] temporary, no scatter, no row indices for the kernel).
            xgrammar_apply(logits, bitmask, vocab_size=width)
        else:
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


# The logits dtypes of xgrammar's CPU kernel (apply_token_bitmask_inplace_cpu, 0.2.x).
_XGRAMMAR_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """The runs of consecutive logits rows in `rows` (the logits row of each bitmask row):
    (start, stop, first) = bitmask rows start..stop-1 are logits rows first, first + 1, ...
    One run when all rows are constrained, in order."""
    runs = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((start, i, rows[start]))
            start = i
    return runs


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


def pin_host_array(array: np.ndarray) -> None:
    """Page-lock `array`'s memory in place (cudaHostRegister; e.g. shared memory the grammar
    process fills): a tensor over it is then pinned, and its copies to the GPU need no
    staging copy. Raises RuntimeError with CUDA's error code if registering fails."""
    code = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
        array.ctypes.data, array.nbytes, 0
    )
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister of {array.nbytes} bytes failed: error {int(code)}")


def unpin_host_array(array: np.ndarray) -> None:
    """Undo `pin_host_array` (after the device's last copy from it)."""
    torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)  # type: ignore[no-untyped-call]


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
    """xgrammar's `apply_token_bitmask_inplace` (its Triton kernel on CUDA, its C++ loop on
    the CPU) where xgrammar is installed, imported on the first constrained step; the torch
    path above is the fallback."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    apply: Callable[..., None] = apply_token_bitmask_inplace
    return apply
