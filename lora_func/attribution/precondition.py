"""Preconditioners of per-example gradients: LESS's Adam direction, or any function.

A preconditioner is a function ``grads -> grads`` on a dict like ``adapter.params`` whose
tensors have a leading example axis ``(B, *shape)`` (what :func:`lora_func.per_example_grads`
returns), applied before the features are flattened and projected. :class:`AdamPreconditioner`
is LESS's (Xia et al. 2024): the direction of one Adam step from the warm-up run's moments,

    m' = β₁ m + (1 − β₁) g,    v' = β₂ v + (1 − β₂) g²,    Γ(g) = m' / √(v' + ε)

with ``ε`` under the square root as in LESS's ``obtain_gradients_with_adam`` (torch's Adam adds
it after the root). Any other transform is a plain function, e.g. the second moments alone:
``lambda g: {k: g[k] / (v[k].sqrt() + 1e-8) for k in g}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.adapter import AdapterLike

__all__ = ["AdamPreconditioner", "Preconditioner", "adam_preconditioner"]

Preconditioner = Callable[[dict[str, Tensor]], dict[str, Tensor]]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class AdamPreconditioner:
    """LESS's Adam direction ``m' / √(v' + ε)`` of per-example gradients (module docstring).

    ``exp_avg`` / ``exp_avg_sq``: Adam's first and second moments per adapter key, each of the
    key's shape (a stack's: ``(K, *shape)``); ``betas``, ``eps``: the optimiser's. Build it with
    :func:`adam_preconditioner`. Calling it maps ``{key: g (B, *shape)}`` to the same keys and
    shapes, computed in at least float32.
    """

    exp_avg: Mapping[str, Tensor]
    exp_avg_sq: Mapping[str, Tensor]
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __call__(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        beta1, beta2 = self.betas
        out = {}
        for key, g in grads.items():
            dtype = torch.promote_types(g.dtype, torch.float32)
            g = g.to(dtype)
            m = self.exp_avg[key].to(device=g.device, dtype=dtype)
            v = self.exp_avg_sq[key].to(device=g.device, dtype=dtype)
            out[key] = (beta1 * m + (1 - beta1) * g) / (beta2 * v + (1 - beta2) * g.square() + self.eps).sqrt()
        return out


def _optimizer_moments(optimizer: torch.optim.Optimizer, adapter: AdapterLike) -> tuple[dict, dict, tuple[float, float], float]:
    """The Adam moments ``optimizer`` holds for each of ``adapter.params`` (found by identity)
    and the betas / eps of their parameter group."""
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    missing, settings = [], set()
    exp_avg, exp_avg_sq = {}, {}
    for key, param in adapter.params.items():
        state = optimizer.state.get(param, {})
        if id(param) not in groups or any(name not in state for name in _MOMENTS):
            missing.append(key)
            continue
        exp_avg[key], exp_avg_sq[key] = state["exp_avg"], state["exp_avg_sq"]
        group = groups[id(param)]
        settings.add((tuple(group.get("betas", (0.9, 0.999))), float(group.get("eps", 1e-8))))
    if missing:
        raise ValueError(  # error: attribution-optimizer-state
            f"adam_preconditioner: the {type(optimizer).__name__} holds no Adam moments (exp_avg, exp_avg_sq) for adapter "
            f"tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}; pass the Adam/AdamW optimiser that trained exactly "
            f"these tensors (adapter.params as its parameters, after at least one step), or a dict "
            f"{{key: {{'exp_avg': m, 'exp_avg_sq': v}}}}"
        )
    if len(settings) > 1:
        raise ValueError(  # error: attribution-optimizer-groups
            f"adam_preconditioner: the adapter's tensors are in parameter groups with different betas/eps "
            f"{sorted(settings)}; LESS's direction uses one setting: pass a dict of moments with betas= and eps="
        )
    (betas, eps), = settings
    return exp_avg, exp_avg_sq, (float(betas[0]), float(betas[1])), eps


def adam_preconditioner(
    source: torch.optim.Optimizer | Mapping[str, Mapping[str, Tensor]],
    adapter: AdapterLike,
    *,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
) -> AdamPreconditioner:
    """LESS's Adam preconditioner for ``adapter``'s per-example gradients.

    Args:
      source: the ``torch.optim.Adam`` / ``AdamW`` that trained ``adapter.params`` (its state
        for each tensor, found by identity; its group's ``betas`` and ``eps``), or a dict
        ``{adapter key: {"exp_avg": m, "exp_avg_sq": v}}`` (torch's per-parameter state,
        keyed as ``adapter.params``; a checkpoint's optimiser state mapped to the keys).
      adapter: the adapter whose gradients are preconditioned.
      betas, eps: override the optimiser's (for a dict: default LESS's ``(0.9, 0.999)``,
        ``1e-8``).

    Every key of ``adapter.params`` needs both moments, each of the key's shape; checked here.
    """
    params = adapter.params
    if isinstance(source, torch.optim.Optimizer):
        exp_avg, exp_avg_sq, found_betas, found_eps = _optimizer_moments(source, adapter)
    elif isinstance(source, Mapping):
        bad = sorted(
            str(key) for key in params
            if not isinstance(source.get(key), Mapping) or any(not isinstance(source[key].get(name), Tensor) for name in _MOMENTS)
        )
        unknown = sorted(str(key) for key in source if key not in params)
        if bad or unknown:
            raise KeyError(  # error: attribution-moments-keys
                f"adam_preconditioner: the moments dict must map every key of adapter.params to "
                f"{{'exp_avg': tensor, 'exp_avg_sq': tensor}}; missing or incomplete {bad[:4]}, unknown {unknown[:4]}"
            )
        exp_avg = {key: source[key]["exp_avg"] for key in params}
        exp_avg_sq = {key: source[key]["exp_avg_sq"] for key in params}
        found_betas, found_eps = (0.9, 0.999), 1e-8
    else:
        raise TypeError(  # error: attribution-preconditioner-type
            f"adam_preconditioner: source must be a torch.optim Adam/AdamW optimiser or a dict of moments "
            f"{{key: {{'exp_avg': m, 'exp_avg_sq': v}}}}, got {type(source).__name__}"
        )
    for key, param in params.items():
        for name, moments in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if tuple(moments[key].shape) != tuple(param.shape):
                raise ValueError(  # error: attribution-moments-shape
                    f"adam_preconditioner: {name} of {key!r} has shape {tuple(moments[key].shape)}, the adapter tensor "
                    f"{tuple(param.shape)}; the moments must come from training this adapter"
                )
    chosen_betas = found_betas if betas is None else (float(betas[0]), float(betas[1]))
    return AdamPreconditioner(exp_avg, exp_avg_sq, chosen_betas, found_eps if eps is None else float(eps))


def resolve(preconditioner: Any, adapter: AdapterLike, where: str) -> Preconditioner | None:
    """``preconditioner`` as a function: ``None``, a function (kept), an optimiser or a dict of
    moments (:func:`adam_preconditioner`)."""
    if preconditioner is None:
        return None
    if isinstance(preconditioner, (torch.optim.Optimizer, Mapping)):
        return adam_preconditioner(preconditioner, adapter)
    if callable(preconditioner):
        return preconditioner
    raise TypeError(  # error: attribution-preconditioner
        f"{where}: preconditioner must be None, a function grads -> grads, the Adam/AdamW optimiser that trained the "
        f"adapter, or a dict {{key: {{'exp_avg': m, 'exp_avg_sq': v}}}} (LESS), got {type(preconditioner).__name__}"
    )
