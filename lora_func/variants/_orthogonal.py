"""Orthogonal blocks shared by the OFT and BOFT variants (not a variant: the registry skips
modules whose name starts with ``_``).

Shapes: a batch of ``k`` square blocks is ``(k, b, b)``; OFT stores each block's strictly upper
triangle as a vector ``(k, b(b-1)/2)`` (peft's ``oft_R.weight``), BOFT the full ``(k, b, b)``
matrix of which only the skew part counts (peft's ``boft_R``). Every function is pure (no
in-place writes to its inputs, no ``.item()``), so ``vmap``, ``grad`` and ``torch.compile`` see
through it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from lora_func.variants._kernels import promoted

__all__ = [
    "block_multiplicative_dropout",
    "block_size_of",
    "cayley",
    "cayley_neumann",
    "coft_project",
    "rotate_blocks",
    "skew_from_upper",
]


def block_size_of(n_elements: int) -> int:
    """The block size ``b`` whose strict upper triangle has ``n_elements = b(b-1)/2`` entries."""
    b = (1 + math.isqrt(1 + 8 * n_elements)) // 2
    return b


def _upper_index_of(b: int) -> Tensor:
    """``(b(b-1)/2,)``: the flat positions ``i·b + j`` of the strict upper triangle of a ``b × b``
    matrix in row-major order (``torch.triu_indices(b, b, 1)``, peft's order)."""
    rows, cols = torch.triu_indices(b, b, 1)
    return rows * b + cols


_upper_index_memo = functools.lru_cache(maxsize=None)(_upper_index_of)


def _upper_index(b: int) -> Tensor:
    """:func:`_upper_index_of`, memoized in eager code (a trace computes it: it cannot follow
    the memo, and folds the constant itself)."""
    if torch.compiler.is_compiling():
        return _upper_index_of(b)
    return _upper_index_memo(b)


class _SkewFromUpper(torch.autograd.Function):
    """``vec (k, n) -> U − Uᵀ (k, b, b)``. One autograd node whose backward reads the constant
    index again instead of saving it (an ``index_copy`` node would keep the ``(n,)`` int64
    index for backward): nothing is saved but ``b``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(vec: Tensor, b: int) -> Tensor:
        return _skew_ops(vec, b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.b = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        b = ctx.b
        # d(U − Uᵀ)/dU applied to the gradient: G − Gᵀ, read at the upper positions.
        both = (grad - grad.transpose(-1, -2)).reshape(-1, b * b)
        return both.index_select(1, _upper_index(b).to(grad.device)), None


def _skew_ops(vec: Tensor, b: int) -> Tensor:
    upper = vec.new_zeros(vec.shape[0], b * b).index_copy(1, _upper_index(b).to(vec.device), vec).view(-1, b, b)
    return upper - upper.transpose(-1, -2)


def skew_from_upper(vec: Tensor, b: int) -> Tensor:
    """``(k, b(b-1)/2) -> (k, b, b)``: the skew-symmetric matrices ``U − Uᵀ`` whose strict upper
    triangles ``U`` are the rows of ``vec`` in row-major order (peft's ``_pytorch_skew_symmetric``:
    zeros, one out-of-place index write, one subtraction; :class:`_SkewFromUpper`). Under a
    trace the plain ops (dynamo does not trace this node; the compiled graph holds the constant
    index itself)."""
    if torch.compiler.is_compiling():
        return _skew_ops(vec, b)
    return _SkewFromUpper.apply(vec, b)


def cayley_neumann(q: Tensor, terms: int) -> Tensor:
    """peft 0.21's truncated Cayley–Neumann series for skew ``q (..., b, b)``:
    ``I + 2Q + 2Q² + ⋯ + 2Q^{m−1} + Q^m`` with ``m = max(terms − 1, 3)`` for ``terms ≥ 3``,
    ``I + 2Q`` for ``terms == 2`` and ``I`` for ``terms ≤ 1`` (peft's ``_cayley_batch``: its
    loop makes 3 and 4 terms equal). It approximates the Cayley map ``(I + Q)(I − Q)⁻¹``,
    orthogonal up to ``O(Q^m)``."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    if terms <= 1:
        return eye.expand(q.shape)
    # add(..., alpha=2) and bmm, as peft: one op per term each, no separate scaling or reshapes.
    matmul = torch.bmm if q.dim() == 3 else torch.matmul
    out = torch.add(eye, q, alpha=2.0)
    if terms == 2:
        return out
    power = matmul(q, q)
    out = torch.add(out, power, alpha=2.0)
    for _ in range(3, terms - 1):
        power = matmul(power, q)
        out = torch.add(out, power, alpha=2.0)
    return out + matmul(power, q)


def cayley(q: Tensor) -> Tensor:
    """The exact Cayley map ``(I − Q)(I + Q)⁻¹`` of skew ``q (..., b, b)``, an orthogonal matrix
    (peft's ``use_cayley_neumann=False`` and BOFT's ``cayley_batch``). The solve runs in at
    least fp32; the result is in ``q``'s dtype."""
    ct = promoted(q.dtype, torch.float32)
    qc = q.to(ct)
    eye = torch.eye(q.shape[-1], dtype=ct, device=q.device)
    return torch.linalg.solve(eye + qc, eye - qc, left=False).to(q.dtype)


def coft_project(vec: Tensor, b: int, eps: float) -> Tensor:
    """COFT's constraint (Qiu et al. 2023; peft's ``_project_batch``), straight through: the
    value of each block's skew matrix pulled back onto the Frobenius ball of radius
    ``eps / √k`` (``k`` blocks) around zero where it lies outside, with the identity as its
    gradient. peft writes the projection into the parameter (in place, under ``no_grad``)
    before every forward; a pure function cannot, so the gradient w.r.t. the stored tensor is
    the same and the stored tensor itself is left as it is."""
    k = vec.shape[-2]
    with torch.no_grad():
        # peft computes the radius in fp32 (eps / torch.sqrt(torch.tensor(k))): the same rounding
        # here, so a loaded checkpoint gives its outputs to float64 round-off.
        radius = (torch.tensor(eps, dtype=torch.float32) / torch.tensor(float(k), dtype=torch.float32).sqrt()).to(vec.device, vec.dtype)
        # ‖U − Uᵀ‖_F = √2 ‖vec‖; peft compares the skew matrix's norm with the radius.
        norm = torch.linalg.vector_norm(skew_from_upper(vec, b), dim=(-2, -1))[..., None]
        projected = torch.where(norm <= radius, vec, radius * (vec / norm.clamp(min=torch.finfo(vec.dtype).tiny)))
    # `vec - vec.detach()` is exactly zero with the identity as its gradient: the value is the
    # projection bit for bit (`vec + (projected - vec)` would round).
    return projected + (vec - vec.detach())


def block_multiplicative_dropout(blocks: Tensor, p: float) -> Tensor:
    """peft's multiplicative dropout of OFT/BOFT blocks, for a training step: in ``blocks
    (k, b, b)``, exactly ``int(p·k)`` blocks at random positions replaced by the identity
    (none when ``k == 1``, OFT's ``block_share``). Draws from the global RNG (``torch.rand``),
    so under ``vmap`` it follows ``randomness=``."""
    k, b = blocks.shape[-3], blocks.shape[-1]
    dropped = int(p * k)
    if k == 1 or dropped == 0:
        return blocks
    # A random permutation's first `dropped` positions: exactly `dropped` blocks, no .item().
    order = torch.rand(k, device=blocks.device).argsort()
    mask = (order < dropped).to(blocks.dtype)[:, None, None]
    eye = torch.eye(b, dtype=blocks.dtype, device=blocks.device)
    return blocks * (1 - mask) + eye * mask


def rotate_blocks(x: Tensor, blocks: Tensor) -> Tensor:
    """``x (..., k·b)`` times the block-diagonal matrix of ``blocks (k, b, b)`` (a row vector
    times each block: ``y_i = x_i R_i``), without building the ``(k·b, k·b)`` matrix. A
    ``(1, b, b)`` ``blocks`` is shared by every block of ``x``."""
    b = blocks.shape[-1]
    grouped = rearrange(x, "... (k b) -> ... k b", b=b)
    return rearrange(torch.einsum("...kb,kbc->...kc", grouped, blocks.expand(grouped.shape[-2], b, b)), "... k c -> ... (k c)")
