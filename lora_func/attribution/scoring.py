"""Attribution scores from features, and the linear datamodeling score (LDS) that judges them.

With ``train`` features ``X (n_train, D)`` and ``test`` features ``T (n_test, D)`` (rows from
:func:`lora_func.attribution.features`, the same projection for both):

- ``"tracin"``: ``T Xᵀ`` (TracIn, Pruthi et al. 2020, at one checkpoint; over checkpoints with
  ``weights`` the learning rates);
- ``"less"``: the cosine of every pair of rows, ``normalize(T) normalize(X)ᵀ`` (LESS, Xia et al.
  2024; with Adam-preconditioned training features and checkpoint weights as in its recipe);
- ``"trak"``: ``T (XᵀX + damping·I)⁻¹ Xᵀ`` (TRAK, Park et al. 2023, without its out-to-loss
  weights ``Q``: multiply the columns by them).

Features with a leading axis ``(C, n, D)`` (a stack of adapters, checkpoints) give each
member's scores, averaged (``weights``: a weighted sum): TRAK's ensembling. Every array may be a
tensor or a numpy array (the memory map of :func:`lora_func.attribution.write_features`); train
rows are read block by block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

__all__ = ["METHODS", "lds", "scores"]

Method = Literal["tracin", "less", "trak"]
METHODS: tuple[str, ...] = ("tracin", "less", "trak")
# Values of one block of train rows (64 MiB in float32).
BLOCK_VALUES = 1 << 24

Array = Any  # a Tensor or a numpy array (2-D rows)


def _members(features: Any, argument: str, where: str) -> list[Array]:
    """``features`` as its list of ``(n, D)`` members: one for a 2-D array, ``C`` for ``(C, n, D)``
    or a sequence of 2-D arrays."""
    if isinstance(features, (Tensor, np.ndarray)):
        if features.ndim == 2:
            return [features]
        if features.ndim == 3:
            return [features[c] for c in range(features.shape[0])]
        raise ValueError(  # error: attribution-features-shape
            f"{where}: {argument} must be features (n, D), or (C, n, D) for C checkpoints/members, got shape "
            f"{tuple(features.shape)}"
        )
    if isinstance(features, Sequence) and not isinstance(features, str) and features and all(
        isinstance(f, (Tensor, np.ndarray)) and f.ndim == 2 for f in features
    ):
        return list(features)
    raise TypeError(  # error: attribution-features-type
        f"{where}: {argument} must be a tensor or numpy array of features (n, D) or (C, n, D), or a list of C (n, D) "
        f"arrays, got {type(features).__name__}"
    )


def _dtype(array: Array) -> torch.dtype:
    if isinstance(array, Tensor):
        return array.dtype
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype


def _rows(array: Array, start: int, stop: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(array, Tensor):
        return array[start:stop].to(device=device, dtype=dtype)
    return torch.from_numpy(np.array(array[start:stop])).to(device=device, dtype=dtype)  # a copy: memory maps are read-only


def _blocks(array: Array, dtype: torch.dtype, device: torch.device) -> Any:
    n, width = array.shape
    step = max(1, BLOCK_VALUES // max(1, width))
    for start in range(0, n, step):
        yield start, _rows(array, start, min(n, start + step), dtype, device)


def check_pairs(train: Any, test: Any, where: str) -> tuple[list[Array], list[Array]]:
    """Both feature arguments as lists of members, checked: the same number of members and
    the same width ``D``."""
    trains, tests = _members(train, "train", where), _members(test, "test", where)
    stacked = (not isinstance(train, (Tensor, np.ndarray)) or train.ndim == 3, not isinstance(test, (Tensor, np.ndarray)) or test.ndim == 3)
    if len(trains) != len(tests) or stacked[0] != stacked[1]:
        raise ValueError(  # error: attribution-checkpoints
            f"{where}: train has {len(trains) if stacked[0] else 'no'} checkpoint/member axis"
            f"{f' ({len(trains)})' if stacked[0] else ''} and test {len(tests) if stacked[1] else 'none'}; both must be "
            f"(n, D), or both (C, n, D) with the same C (the features of the same C adapters)"
        )
    widths = sorted({int(a.shape[1]) for a in trains} | {int(a.shape[1]) for a in tests})
    if len(widths) != 1:
        raise ValueError(  # error: attribution-feature-dims
            f"{where}: train and test features have different widths D {widths}; compute both with the same adapter "
            f"and the same proj_dim and generator seed"
        )
    return trains, tests


def _weights(weights: Any, count: int, where: str) -> list[float]:
    if weights is None:
        return [1.0 / count] * count
    values = weights.tolist() if isinstance(weights, Tensor) else list(weights) if isinstance(weights, Sequence) else None
    if values is None or len(values) != count or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ValueError(  # error: attribution-weights
            f"{where}: weights must be {count} finite numbers, one per checkpoint/member (e.g. the learning rates, as "
            f"TracIn and LESS weight checkpoints), got {weights!r}"
        )
    return [float(v) for v in values]


def _trak_one(train: Array, test: Tensor, damping: float, dtype: torch.dtype, where: str) -> Tensor:
    """``test (XᵀX + damping·I)⁻¹ Xᵀ`` of one member, the kernel and solve in float64."""
    n, width = train.shape
    if damping == 0.0 and width > n:
        raise ValueError(  # error: attribution-trak-rank
            f"{where}: method='trak' with damping=0 needs train features with D <= n_train, got D={width} > "
            f"n_train={n} (XᵀX has rank <= {n}, no inverse); project to proj_dim <= {n}, or pass damping > 0"
        )
    device = test.device
    kernel = torch.zeros(width, width, dtype=torch.float64, device=device)
    for _, block in _blocks(train, torch.float64, device):
        kernel.addmm_(block.T, block)
    kernel.diagonal().add_(damping)
    factor, info = torch.linalg.cholesky_ex(kernel)
    if int(info) != 0:
        raise ValueError(  # error: attribution-trak-singular
            f"{where}: method='trak': XᵀX + damping·I is not positive definite in float64 (pivot {int(info)} of "
            f"{width}; damping={damping}); pass a larger damping, or fewer projected dimensions than train examples"
        )
    solved = torch.cholesky_solve(test.to(torch.float64).T, factor)  # (D, n_test)
    out = torch.empty(test.shape[0], n, dtype=torch.float64, device=device)
    for start, block in _blocks(train, torch.float64, device):
        out[:, start : start + block.shape[0]] = (block @ solved).T
    return out.to(dtype)


def scores(
    train: Any,
    test: Any,
    *,
    method: Method = "tracin",
    damping: float = 0.0,
    weights: Sequence[float] | Tensor | None = None,
) -> Tensor:
    """Attribution scores ``(n_test, n_train)``: entry ``(j, i)`` says how much training example
    ``i`` supports test example ``j`` (positive: training on it lowers the test loss, for
    loss-gradient features).

    Args:
      train: features ``(n_train, D)``; or ``(C, n_train, D)`` / a list of ``C`` arrays for ``C``
        checkpoints or stack members (the matching test features alike). Tensors or numpy
        arrays (memory maps are read in blocks of rows).
      test: features ``(n_test, D)`` (or ``(C, n_test, D)``), from the same adapter(s),
        ``proj_dim`` and generator seed as ``train``; held in memory.
      method: ``"tracin"`` (``test · trainᵀ``), ``"less"`` (cosine of rows), ``"trak"``
        (``test (trainᵀ train + damping·I)⁻¹ trainᵀ``, solved in float64 by Cholesky).
      damping: TRAK's ridge term (``>= 0``; ``"trak"`` only). With ``0`` the train features
        need ``D <= n_train``.
      weights: ``C`` numbers: the members' scores are summed with these weights (default: their
        mean). LESS and TracIn weight checkpoints by their learning rates.

    Returns float32 scores for float32 features (float64 for float64), on ``test``'s device.
    """
    where = "scores"
    if method not in METHODS:
        raise ValueError(f"{where}: method={method!r} is not one of {list(METHODS)}")  # error: attribution-method
    if not isinstance(damping, (int, float)) or isinstance(damping, bool) or not math.isfinite(damping) or damping < 0:
        raise ValueError(f"{where}: damping must be a finite number >= 0, got {damping!r}")  # error: attribution-damping
    if damping and method != "trak":
        raise ValueError(  # error: attribution-damping-method
            f"{where}: damping={damping} applies to method='trak' only (tracin and less have no inverse); leave it at 0"
        )
    trains, tests = check_pairs(train, test, where)
    mix = _weights(weights, len(trains), where)
    dtype = torch.float32
    for array in (*trains, *tests):
        dtype = torch.promote_types(dtype, _dtype(array))
    device = tests[0].device if isinstance(tests[0], Tensor) else torch.device("cpu")
    total: Tensor | None = None
    for weight, train_c, test_c in zip(mix, trains, tests, strict=True):
        query = _rows(test_c, 0, test_c.shape[0], dtype, device)
        if method == "trak":
            part = _trak_one(train_c, query, float(damping), dtype, where)
        else:
            if method == "less":
                query = torch.nn.functional.normalize(query, dim=1)
            part = torch.empty(query.shape[0], train_c.shape[0], dtype=dtype, device=device)
            for start, block in _blocks(train_c, dtype, device):
                if method == "less":
                    block = torch.nn.functional.normalize(block, dim=1)
                part[:, start : start + block.shape[0]] = query @ block.T
        total = part * weight if total is None else total.add_(part, alpha=weight)
    assert total is not None
    return total


def _average_ranks(values: Tensor) -> Tensor:
    """Ranks (1-based) of each row of ``values (rows, m)``, ties given their average rank."""
    values = values.contiguous()
    ordered = values.sort(dim=1).values
    low = torch.searchsorted(ordered, values, right=False)
    high = torch.searchsorted(ordered, values, right=True)
    return (low + high + 1).to(torch.float64) / 2


def lds(scores: Tensor, subsets: Tensor, margins: Tensor) -> Tensor:
    """The linear datamodeling score of each test example: ``(n_test,)``.

    For ``M`` models each trained on a subset of the training set, the attribution's prediction
    of test example ``j``'s output under model ``m`` is the sum of the scores of the examples in
    subset ``m``; LDS (Park et al. 2023) is the Spearman rank correlation, over the ``M`` models,
    between that prediction and the output actually measured. Its mean over test examples is
    the score of an attribution method (1: ranks the subset models perfectly).

    Args:
      scores: ``(n_test, n_train)`` from :func:`scores` (or any attribution).
      subsets: ``(M, n_train)`` bool (or 0/1) masks: which training examples model ``m`` saw.
      margins: ``(M, n_test)``: each model's measured output on each test example (e.g. the
        log-probability of the answer), higher meaning more of what the scores predict.

    Returns float64 correlations; ``nan`` for a test example whose predictions or margins are
    all equal (no ranking).
    """
    where = "lds"
    tensors = {"scores": scores, "subsets": subsets, "margins": margins}
    if not all(isinstance(t, Tensor) and t.dim() == 2 for t in tensors.values()):
        got = {k: tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__ for k, v in tensors.items()}
        raise ValueError(f"{where}: scores (n_test, n_train), subsets (M, n_train) and margins (M, n_test) must be 2-D tensors, got {got}")  # error: attribution-lds-input
    (n_test, n_train), (models, seen), rows = scores.shape, subsets.shape, margins.shape
    if seen != n_train or rows != (models, n_test) or models < 2:
        raise ValueError(  # error: attribution-lds-shapes
            f"{where}: shapes disagree: scores {tuple(scores.shape)} is (n_test, n_train), subsets {tuple(subsets.shape)} "
            f"must be (M, n_train) and margins {tuple(margins.shape)} (M, n_test), with M >= 2 subset models"
        )
    mask = subsets.to(device=scores.device, dtype=torch.float64)
    predicted = mask @ scores.to(torch.float64).T  # (M, n_test)
    a = _average_ranks(predicted.T)
    b = _average_ranks(margins.to(device=scores.device, dtype=torch.float64).T)
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))
