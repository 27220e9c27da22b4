"""Token-expert pairs sorted by expert and padded per expert to the GEMM's row block (Triton).

The grouped GEMMs (`triton_moe.py`) process `block_m` rows at a time, and every row block
must belong to one expert. With T tokens and top-k experts each there are P = T * K
(token, expert) pairs; pair p = t * K + k is token t's k-th choice. This module lays the
pairs out as

    sorted_ids [max_padded] int32   pair index per row; padding rows hold P (a sentinel)
    expert_ids [max_blocks] int32   the local expert of each row block
    total      [1] int32            rows used (sum over experts of ceil(count / block_m) * block_m)

Expert e's pairs fill rows [start_e, start_e + count_e), padding up to the next multiple of
block_m follows. Pairs routed to experts outside [expert_start, expert_start + E) (another
rank's, under expert parallelism) get no row. Within an expert, pairs are in no particular
order (atomics decide); each row of a GEMM tile is computed the same way wherever it sits,
so the results do not depend on that order.

No host synchronisation: the buffer sizes depend only on P, E and block_m
(`max_padded = P + min(E, P) * (block_m - 1)`, the most padding the routing can need), and
the GEMMs skip row blocks at or past `total`, read on the device. So a CUDA graph captured
for one batch size is right for any routing.

Four launches: a memset of the counts, then
1. `_count_kernel` (grid over pairs): count pairs per expert; each pair's atomic_add returns
   its rank within its expert.
2. `_offsets_kernel` (one program): padded counts, their exclusive prefix sum (each expert's
   first row), the total, and the sentinel in each expert's padding rows.
3. `_scatter_kernel` (grid over pairs): sorted_ids[start_e + rank] = pair, and the expert id
   of the row block that row falls in (every used block has at least one real pair: padding
   is only ever the tail of a block).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

import torch
import triton
import triton.language as tl

_PAIRS_PER_PROGRAM = 1024
_EXPERTS_PER_STEP = 64


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    ids_ptr, counts_ptr, rank_ptr, num_pairs, expert_start, num_experts, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    local = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int32) - expert_start
    valid = in_range & (local >= 0) & (local < num_experts)
    rank = tl.atomic_add(counts_ptr + local, 1, mask=valid, sem="relaxed")
    tl.store(rank_ptr + offs, rank, mask=valid)


@triton.jit(do_not_specialize=["num_pairs"])
def _offsets_kernel(
    counts_ptr, starts_ptr, sorted_ids_ptr, total_ptr, num_pairs, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    rows = tl.arange(0, BLOCK_M)
    carry = tl.sum(tl.zeros([BLOCK_E], dtype=tl.int32), axis=0)  # an int32 scalar
    for e0 in range(0, num_experts, BLOCK_E):
        experts = e0 + tl.arange(0, BLOCK_E)
        mask = experts < num_experts
        count = tl.load(counts_ptr + experts, mask=mask, other=0)
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        start = tl.cumsum(padded, axis=0) - padded + carry
        tl.store(starts_ptr + experts, start, mask=mask)
        pad_rows = (start + count)[:, None] + rows[None, :]
        pad_mask = rows[None, :] < (padded - count)[:, None]
        tl.store(sorted_ids_ptr + pad_rows, tl.zeros_like(pad_rows) + num_pairs, mask=pad_mask)
        carry += tl.sum(padded, axis=0)
    tl.store(total_ptr, carry)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(
    ids_ptr, rank_ptr, starts_ptr, sorted_ids_ptr, expert_ids_ptr,
    num_pairs, expert_start, num_experts, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    local = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int32) - expert_start
    valid = in_range & (local >= 0) & (local < num_experts)
    rank = tl.load(rank_ptr + offs, mask=valid, other=0)
    row = tl.load(starts_ptr + local, mask=valid, other=0) + rank
    tl.store(sorted_ids_ptr + row, offs, mask=valid)
    tl.store(expert_ids_ptr + row // BLOCK_M, local, mask=valid)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the alignment can use: each non-empty expert pads fewer than block_m."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, K] int32/int64 global expert ids
    block_m: int,  # rows per GEMM block, a power of two >= 16
    num_experts: int,  # local experts E
    expert_start: int = 0,  # global id of local expert 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_padded] int32, expert_ids [cdiv(max_padded, block_m)] int32,
    total [1] int32) as the module docstring describes; entries of sorted_ids at or past
    `total` and of expert_ids at or past `total // block_m` are unspecified.
    vLLM's `moe_align_block_size` computes the same layout (there in CUDA)."""
    ids = topk_ids.reshape(-1).contiguous()
    num_pairs = ids.numel()
    device = ids.device
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(triton.cdiv(max_padded, block_m), dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(max(num_pairs, 1), dtype=torch.int32, device=device)
    grid = (max(triton.cdiv(num_pairs, _PAIRS_PER_PROGRAM), 1),)
    _count_kernel[grid](
        ids, counts, rank, num_pairs, expert_start, num_experts, BLOCK=_PAIRS_PER_PROGRAM
    )
    _offsets_kernel[(1,)](
        counts, starts, sorted_ids, total, num_pairs, num_experts,
        BLOCK_M=block_m, BLOCK_E=_EXPERTS_PER_STEP,
    )  # fmt: skip
    _scatter_kernel[grid](
        ids, rank, starts, sorted_ids, expert_ids, num_pairs, expert_start, num_experts,
        BLOCK_M=block_m, BLOCK=_PAIRS_PER_PROGRAM,
    )  # fmt: skip
    return sorted_ids, expert_ids, total
