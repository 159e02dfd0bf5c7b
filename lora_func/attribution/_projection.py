"""The random (Johnson-Lindenstrauss) projection of attribution features, block by block.

``P (D, k)`` has independent entries ``±1/√k`` (Rademacher, the projection TRAK's CUDA kernel and
LESS use), so ``E[(Pᵀx)·(Pᵀy)] = x·y`` for every pair of rows. It is never held whole: the ``D``
rows are cut into blocks of :func:`block_rows` rows (a function of ``k`` only) and block ``j`` is
drawn from its own CPU generator seeded by ``(seed, j)``. A row's projection is the sum over the
blocks of its slice times the block, in block order. So the matrix is a function of ``(seed, D,
k)`` alone: the same for every batch, chunk size and device (the blocks are drawn on the CPU and
moved), and the same seed gives bit-identical features. The rows are multiplied in tiles of
:data:`ROW_TILE` (zero rows pad the last), so a row's rounding does not depend on how many rows
share its call: splitting a dataset into other batches or chunks gives the same bits (on the
BLAS libraries tested; their kernels are chosen by the row count, not the values).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Projection", "block_rows"]

# Elements of one generated block (1 Mi: 4 MiB in float32), the memory the projection adds; the
# draws cost the same per element down to blocks of this size.
BLOCK_ELEMENTS = 1 << 20
ROW_TILE = 8
_GOLDEN = 0x9E3779B97F4A7C15  # the 64-bit golden ratio: consecutive blocks get unrelated seeds
_SIGN_BIT = -(2**31)
_ONE_BITS = 0x3F800000  # float32 1.0


def block_rows(dim: int) -> int:
    """Rows of ``P`` per generated block for a projection to ``dim`` columns (at least 1)."""
    return max(1, BLOCK_ELEMENTS // dim)


def _signs(rows: int, cols: int, seed: int) -> Tensor:
    """A ``(rows, cols)`` float32 matrix of independent ±1, on the CPU, from ``seed``.

    Each 32-bit word of the generator gives 32 signs: word bit ``31 - j`` (shifted to the sign
    bit) over the bits of 1.0, so no per-element draw and no float conversion (the draws cost
    about a tenth of a normal matrix's)."""
    count = rows * cols
    words = -(-count // 32)
    generator = torch.Generator().manual_seed(seed % 2**64)
    raw = torch.empty(-(-words // 2), dtype=torch.int64).random_(-(2**63), None, generator=generator)
    word = raw.view(torch.int32)[:words]
    out = torch.empty(32, words, dtype=torch.int32)
    for shift in range(32):
        torch.bitwise_left_shift(word, shift, out=out[shift])
    out.bitwise_and_(_SIGN_BIT).bitwise_or_(_ONE_BITS)
    return out.view(torch.float32).view(-1)[:count].view(rows, cols)


@dataclasses.dataclass(frozen=True)
class Projection:
    """``P (in_dim, dim)`` with entries ``±1/√dim`` drawn block by block from ``seed``."""

    seed: int
    in_dim: int
    dim: int

    def block(self, index: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Rows ``[index·R, min((index+1)·R, in_dim))`` of ``P``, unscaled (±1), ``R = block_rows(dim)``."""
        rows = block_rows(self.dim)
        start = index * rows
        signs = _signs(min(rows, self.in_dim - start), self.dim, self.seed + index * _GOLDEN)
        return signs.to(device=device, dtype=dtype)

    def apply(self, pieces: Sequence[Tensor]) -> Tensor:
        """``cat(pieces, 1) @ P``: ``pieces`` are ``(n, d_i)`` column slices of ``(n, in_dim)``
        features in order (one per adapter tensor, never concatenated); returns ``(n, dim)``."""
        first = pieces[0]
        n, dtype, device = first.shape[0], first.dtype, first.device
        # Rows padded to a multiple of ROW_TILE: BLAS picks its kernels by the row count, so
        # every call multiplying a whole number of tiles gives each row the same rounding
        # whatever the other rows (the same features from any chunk_size or batch split).
        pad = -n % ROW_TILE
        if pad:
            pieces = [torch.cat([piece, piece.new_zeros(pad, piece.shape[1])]) for piece in pieces]
        out = torch.zeros(n + pad, self.dim, dtype=dtype, device=device)
        rows = block_rows(self.dim)
        bounds = []
        offset = 0
        for piece in pieces:
            bounds.append((offset, offset + piece.shape[1], piece))
            offset += piece.shape[1]
        for index in range(-(-self.in_dim // rows)):
            lo, hi = index * rows, min((index + 1) * rows, self.in_dim)
            block = self.block(index, device, dtype)
            for start, stop, piece in bounds:
                a, b = max(lo, start), min(hi, stop)
                if a < b:
                    out.addmm_(piece[:, a - start : b - start], block[a - lo : b - lo])
        return out[:n].mul_(self.dim**-0.5)
