"""Unpacking of int32-packed weights, the one weight layout the GPU W4A16 / W8A16 kernels
read, and its conversion from GPTQ's and AWQ's checkpoint layouts (torch ops only, any device:
run once per layer at load time).

For W^T [K in, N out] (K: this rank's input rows):

    qweight [K / pack, N] int32  packed along K as GPTQ does: row i holds rows i*pack + j of
                                 W^T in bits [j*bits, (j+1)*bits), LSB first (pack = 32 // bits)
    zeros   [G, N] int16         the zero points, unpacked, offset applied (None when every
                                 zero is one value: `zero_value`, e.g. 8 for 4-bit symmetric)
    scales  [G, N] float         as in the checkpoint
    g_idx   [K] int32 or None    group of each (sorted) row when the groups are not runs of
                                 `group_size` rows (act-order under row parallelism)
    perm    [K] int32 or None    act-order: kernel row k is the checkpoint's input row
                                 perm[k], so y = x[:, perm] @ W_sorted^T (None: identity)

    W^T[k, n] = scales[g, n] * (q[k, n] - zero[g, n]),  g = g_idx[k] or k // group_size

GPTQ without act-order keeps its qweight tensor as is; with act-order the rows are sorted by
group (a stable argsort of g_idx), so each K block of the kernel reads one group's scales.
AWQ's qweight [K, N / 8] (packed along N in the order 0 2 4 6 1 3 5 7) is repacked along K.
"""

import torch
from torch import nn


def unpack_int32(
    packed: torch.Tensor,  # int32, packed along `dim`
    bits: int,
    dim: int,
    order: tuple[int, ...] | None = None,
) -> torch.Tensor:  # int32, packed.size(dim) * (32 // bits) along `dim`, values in [0, 2**bits)
    """Split each int32 into its 32 // bits values, lowest bits first, along `dim`.

    `order[j]` is the position (in the unpacked run of 32 // bits values) of the value stored
    in bits [j*bits, (j+1)*bits); None is the identity (GPTQ)."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., n, pack]
    if order is not None:
        values = values[..., torch.argsort(torch.tensor(order, device=packed.device))]
    return values.reshape(*moved.shape[:-1], moved.shape[-1] * pack).movedim(-1, dim)


def pack_int32(
    values: torch.Tensor,  # int, values in [0, 2**bits), size along `dim` a multiple of 32/bits
    bits: int,
    dim: int,
) -> torch.Tensor:  # int32, size along `dim` divided by 32 // bits
    """Pack 32 // bits consecutive values along `dim` into each int32, lowest bits first (the
    inverse of `unpack_int32` without an order)."""
    pack = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // pack, pack)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (grouped << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement int32
    return words.to(torch.int32).movedim(-1, dim)


class PackedWeights(nn.Module):
    """A quantized linear's weight in the kernels' layout (module docstring); its tensors are
    frozen parameters, so they count in `model.parameters()` and move with the model.

    bits: 4 or 8; group_size: rows per group when `g_idx` is None (K for one group)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        zeros: torch.Tensor | None,
        zero_value: int,
        scales: torch.Tensor,
        g_idx: torch.Tensor | None,
        perm: torch.Tensor | None,
        bits: int,
        group_size: int,
    ) -> None:
        super().__init__()
        self.bits, self.group_size, self.zero_value = bits, group_size, zero_value
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.zeros = None if zeros is None else nn.Parameter(zeros, requires_grad=False)
        self.g_idx = None if g_idx is None else nn.Parameter(g_idx, requires_grad=False)
        self.perm = None if perm is None else nn.Parameter(perm, requires_grad=False)

    @property
    def in_features(self) -> int:
        """K: input rows (of this rank)."""
        return self.qweight.size(0) * (32 // self.bits)

    @property
    def out_features(self) -> int:
        """N: output columns (of this rank)."""
        return self.qweight.size(1)


def _constant_zero(zeros: torch.Tensor) -> int | None:
    """The value of every zero point if they are all equal (a load-time host sync)."""
    first = int(zeros.reshape(-1)[0].item())
    return first if bool((zeros == first).all().item()) else None


def _packed(
    q_packed: torch.Tensor,  # [K / pack, N] int32, checkpoint row order
    zeros: torch.Tensor,  # [G, N] int (unpacked, offset applied)
    scales: torch.Tensor,  # [G, N]
    groups: torch.Tensor,  # [K] int64: group of each checkpoint row
    bits: int,
    group_size: int,
) -> PackedWeights:
    """Sort rows by group when they are not already in group order, and drop per-group
    tensors that are constant."""
    k = groups.numel()
    runs = torch.arange(k, device=groups.device) // group_size
    perm = g_idx = None
    if not torch.equal(groups, runs):
        order = torch.argsort(groups, stable=True)
        q_packed = pack_int32(unpack_int32(q_packed, bits, 0)[order], bits, 0)
        sorted_groups = groups[order]
        perm = order.to(torch.int32)
        if not torch.equal(sorted_groups, runs):  # e.g. a row-parallel shard of act-order
            g_idx = sorted_groups.to(torch.int32)
    zero_value = _constant_zero(zeros)
    return PackedWeights(
        q_packed.contiguous(),
        None if zero_value is not None else zeros.to(torch.int16).contiguous(),
        zero_value if zero_value is not None else 0,
        scales.contiguous(),
        g_idx,
        perm,
        bits,
        group_size,
    )


def gptq_packed_weights(
    qweight: torch.Tensor,  # [K / pack, N] int32
    qzeros: torch.Tensor,  # [G, N / pack] int32
    scales: torch.Tensor,  # [G, N] float
    groups: torch.Tensor,  # [K] int64: scale/zero row of each input row (`groups()`)
    bits: int,
    zero_offset: int,
    group_size: int,  # rows per group (K for one group)
) -> PackedWeights:
    """A GPTQ tensor set in the kernels' layout (see `gptq.py` for the checkpoint's)."""
    zeros = unpack_int32(qzeros, bits, 1) + zero_offset
    return _packed(qweight, zeros, scales, groups, bits, group_size)


def awq_packed_weights(
    qweight: torch.Tensor,  # [K, N / 8] int32, AWQ order
    qzeros: torch.Tensor,  # [G, N / 8] int32, AWQ order
    scales: torch.Tensor,  # [G, N] float
    group_size: int,
    pack_order: tuple[int, ...],
) -> PackedWeights:
    """An AWQ (GEMM, 4-bit) tensor set in the kernels' layout (see `awq.py`)."""
    q = unpack_int32(qweight, 4, 1, pack_order)  # [K, N]
    zeros = unpack_int32(qzeros, 4, 1, pack_order)
    groups = torch.arange(q.size(0), device=q.device) // group_size
    return _packed(pack_int32(q, 4, 0), zeros, scales, groups, 4, group_size)
