"""LoRA's optimiser methods (peft's ``peft.optimizers``) on any adapter tree: LoRA+, LoRA-FA and
the Riemannian ``r × r`` preconditioner, each two ways.

- For ``torch.optim`` loops (``lora_func.train``, your own): :func:`loraplus_param_groups` /
  :func:`loraplus_optimizer`, :func:`lorafa_optimizer`, :func:`riemannian_optimizer` build
  parameter groups / an optimiser over ``adapter.params`` that step exactly as peft's
  ``create_loraplus_optimizer``, ``create_lorafa_optimizer`` and ``create_riemannian_optimizer``
  step a peft model holding the same tensors.
- For pure loops (``torch.func.grad`` plus torchopt or hand-written updates): the same math as
  functions of ``(adapter, grads or updates) -> dict`` with the adapter's flat keys, no state,
  nothing mutated: :func:`loraplus_scale`, :func:`lorafa_project`, :func:`riemannian_precondition`.
  They work on stacks (every stack axis is a batch axis of the ``r × r`` solves) and on
  compositions and combinations (each leaf adapter's keys, with their part prefix).

Which tensors are the factors is read from each variant's declaration, not from key names: in a
layer, the ``A`` factor is the one trainable 2-D tensor of shape ``(r, d_in)`` whose declared rank
axis (``Variant.rank_axes``) is 0, and ``B`` the one of shape ``(d_out, r)`` whose rank axis is 1
(:func:`factor_pairs`). LoRA, PiSSA, EVA, DoRA and AdaLoRA layers have such a pair; HRA, IA3,
DeLoRA have none (LoRA-FA and the preconditioner leave them alone, as peft's do). The scale
``s`` of ``s·B A`` that LoRA-FA's projection divides by is the layer's ``alpha/r`` (``alpha/√r``
with ``use_rslora``), the member's own in a rank-padded stack.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import lora_scale
from lora_func.adapter import SHARED, AdapterLike, leaf_adapters, leaves, walk

__all__ = [
    "FactorPair",
    "LoraFA",
    "factor_pairs",
    "loraplus_param_groups",
    "loraplus_optimizer",
    "loraplus_roles",
    "loraplus_scale",
    "lorafa_optimizer",
    "lorafa_project",
    "riemannian_optimizer",
    "riemannian_precondition",
]


@dataclasses.dataclass(frozen=True)
class FactorPair:
    """One layer's low-rank factor pair of ``s·B A``, by the adapter's flat keys.

    Attributes:
      a: key of ``A (..., r, d_in)`` (``...``: the stack axes, if any).
      b: key of ``B (..., d_out, r)``.
      scale: ``s``: a float, or a tensor of the stack's shape for a rank-padded stack (each
        member's own ``alpha / r``).
    """

    a: str
    b: str
    scale: float | Tensor


def factor_pairs(adapter: AdapterLike) -> list[FactorPair]:
    """The ``(A, B)`` pair of every layer of every leaf of ``adapter`` that has one, in
    application order (see the module docstring for how a pair is recognised)."""
    pairs = []
    for prefix, leaf in leaves(adapter):
        axes = leaf.variant.rank_axes
        for layer in leaf.layers:
            info, module = layer.info, layer.target.module
            a_like = [n for n, shape in layer.param_shapes if len(shape) == 2 and axes.get(n) == (0,) and shape[1] == info.d_in]
            b_like = [n for n, shape in layer.param_shapes if len(shape) == 2 and axes.get(n) == (1,) and shape[0] == info.d_out]
            if len(a_like) != 1 or len(b_like) != 1:
                continue
            _, buffers = leaf.layer_tensors(layer)
            pairs.append(FactorPair(f"{prefix}{module}.{a_like[0]}", f"{prefix}{module}.{b_like[0]}", lora_scale(info, buffers)))
    return pairs


def _check_grads(where: str, adapter: AdapterLike, grads: Mapping[str, Tensor]) -> None:
    params = adapter.params
    unknown = sorted(set(grads) - set(params))
    if unknown:
        raise KeyError(  # error: optim-unknown-keys
            f"{where}: grads has keys the adapter does not have: {unknown[:5]}; pass the gradients of adapter.params "
            f"(torch.func.grad over adapter.params, or adapter.with_params(p) inside the loss)"
        )


# ------------------------------------------------------------------------------------- LoRA+


def loraplus_roles(adapter: AdapterLike) -> dict[str, str]:
    """Each trainable key's LoRA+ group, as peft's ``create_loraplus_optimizer`` sorts a peft
    model's parameters: ``"embedding"`` (a layer on an embedding), ``"B"`` (a ``B`` factor or a
    vector, e.g. DoRA's magnitude), ``"B_no_decay"`` (those of them whose name contains
    ``"bias"``), ``"A"`` (everything else: ``A`` factors, AdaLoRA's ``lora_E``, HRA's vectors,
    and a combinator's own tensors such as :func:`lora_func.combine`'s weights, which peft does
    not have)."""
    leaf_adapters(adapter, "loraplus_roles(adapter)")
    b_keys = {pair.b for pair in factor_pairs(adapter)}
    roles = {f"{prefix}{name}": "A" for prefix, node in walk(adapter) if node.parts for name in node.own_params()}
    for prefix, leaf in leaves(adapter):
        layers = [(layer.target.module, layer.param_shapes, layer.target.layout) for layer in leaf.layers]
        if leaf.shared is not None:
            layers.append((SHARED, leaf.shared.param_shapes, ""))
        for module, shapes, layout in layers:
            for name, shape in shapes:
                key = f"{prefix}{module}.{name}"
                if layout == "embedding":
                    roles[key] = "embedding"
                elif key in b_keys or len(shape) == 1:
                    roles[key] = "B_no_decay" if "bias" in name else "B"
                else:
                    roles[key] = "A"
    return roles


def loraplus_param_groups(
    adapter: AdapterLike,
    *,
    lr: float,
    loraplus_lr_ratio: float,
    loraplus_lr_embedding: float = 1e-6,
    loraplus_weight_decay: float = 0.0,
    params: Mapping[str, Tensor] | None = None,
) -> list[dict[str, Any]]:
    """LoRA+ (Hayou, Ghosh, Yu 2024, arXiv 2402.12354): torch parameter groups over
    ``params`` (default ``adapter.params``), peft's four in peft's order: ``A`` at ``lr``, the
    embedding layers at ``loraplus_lr_embedding``, ``B`` at ``lr · loraplus_lr_ratio`` with
    ``loraplus_weight_decay``, ``B`` without decay (names with ``"bias"``). Each group also
    holds ``"names"``, the adapter keys of its tensors."""
    _check_ratio("loraplus_param_groups", loraplus_lr_ratio)
    roles = loraplus_roles(adapter)
    tensors = adapter.params if params is None else params
    _check_grads("loraplus_param_groups(params=)", adapter, tensors)
    settings = {
        "A": (lr, loraplus_weight_decay),
        "embedding": (loraplus_lr_embedding, loraplus_weight_decay),
        "B": (lr * loraplus_lr_ratio, loraplus_weight_decay),
        "B_no_decay": (lr * loraplus_lr_ratio, 0.0),
    }
    groups = []
    for role, (group_lr, decay) in settings.items():
        names = [k for k in tensors if roles[k] == role]
        groups.append({"params": [tensors[k] for k in names], "names": names, "lr": group_lr, "weight_decay": decay})
    return groups


def loraplus_optimizer(
    adapter: AdapterLike,
    optimizer_cls: type[torch.optim.Optimizer],
    *,
    lr: float,
    loraplus_lr_ratio: float,
    loraplus_lr_embedding: float = 1e-6,
    loraplus_weight_decay: float = 0.0,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """``optimizer_cls`` over :func:`loraplus_param_groups` of ``adapter.params`` (peft's
    ``create_loraplus_optimizer``); ``kwargs`` go to the optimiser (betas, eps, ...)."""
    groups = loraplus_param_groups(
        adapter, lr=lr, loraplus_lr_ratio=loraplus_lr_ratio, loraplus_lr_embedding=loraplus_lr_embedding,
        loraplus_weight_decay=loraplus_weight_decay,
    )
    return optimizer_cls(groups, **({"lr": lr} | kwargs))


def loraplus_scale(
    adapter: AdapterLike, updates: Mapping[str, Tensor], *, loraplus_lr_ratio: float, embedding_ratio: float = 1.0
) -> dict[str, Tensor]:
    """LoRA+ in a pure loop: ``updates`` (an optimiser's step per key, e.g. torchopt's) with the
    ``B`` group's multiplied by ``loraplus_lr_ratio`` and the embedding group's by
    ``embedding_ratio`` (peft: ``loraplus_lr_embedding / lr``). Scaling the *update*, not the
    gradient, is what per-group learning rates are for Adam-like optimisers, whose update does
    not scale with the gradient; the decoupled weight decay of AdamW scales with it too."""
    _check_ratio("loraplus_scale", loraplus_lr_ratio)
    _check_grads("loraplus_scale", adapter, updates)
    roles = loraplus_roles(adapter)
    factor = {"A": 1.0, "embedding": embedding_ratio, "B": loraplus_lr_ratio, "B_no_decay": loraplus_lr_ratio}
    return {k: u * factor[roles[k]] if factor[roles[k]] != 1.0 else u for k, u in updates.items()}


def _check_ratio(where: str, ratio: Any) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(  # error: loraplus-ratio
            f"{where}: loraplus_lr_ratio={ratio!r} must be a finite number > 0 (B's learning rate over A's; the "
            f"paper uses 2-16, peft's docs suggest >= 1)"
        )


# ------------------------------------------------------------------------------- Riemannian


def _damped_inverse(mat: Tensor, reg: float) -> Tensor:
    eye = torch.eye(mat.shape[-1], device=mat.device, dtype=mat.dtype)
    return torch.linalg.pinv(mat + reg * eye)


def riemannian_precondition(adapter: AdapterLike, grads: Mapping[str, Tensor], *, reg: float = 1e-2) -> dict[str, Tensor]:
    """Riemannian preconditioning (Zhang, Pilanci 2024, arXiv 2402.02347), peft's
    ``create_riemannian_optimizer``: for every factor pair of the adapter whose gradients are in
    ``grads``, ``g_A ← (BᵀB + reg·I)⁺ g_A`` and ``g_B ← g_B (A Aᵀ + reg·I)⁺`` (``r × r``, in at
    least fp32, cast back), with ``A``, ``B`` the adapter's current values. Other keys unchanged."""
    _check_grads("riemannian_precondition", adapter, grads)
    params = adapter.params
    out = dict(grads)
    for pair in factor_pairs(adapter):
        if pair.a not in grads or pair.b not in grads:
            continue  # peft preconditions only pairs that both train
        compute = torch.promote_types(params[pair.a].dtype, torch.float32)
        a, b = params[pair.a].detach().to(compute), params[pair.b].detach().to(compute)
        g_a, g_b = grads[pair.a], grads[pair.b]
        out[pair.a] = (_damped_inverse(b.mT @ b, reg) @ g_a.to(compute)).to(g_a.dtype)
        out[pair.b] = (g_b.to(compute) @ _damped_inverse(a @ a.mT, reg)).to(g_b.dtype)
    return out


def riemannian_optimizer(
    adapter: AdapterLike, optimizer_cls: type[torch.optim.Optimizer], *, lr: float, reg: float = 1e-2, **kwargs: Any
) -> torch.optim.Optimizer:
    """``optimizer_cls`` over ``adapter.params`` whose ``step()`` first preconditions the
    ``.grad`` of every factor pair with :func:`riemannian_precondition` (in place, as peft's);
    other tensors step unchanged. Closures are refused, as peft refuses them."""
    if not factor_pairs(adapter):
        raise ValueError(  # error: optim-no-factor-pairs
            "riemannian_optimizer: the adapter has no (A, B) factor pair (a (r, d_in) and a (d_out, r) trainable tensor "
            "per layer): the preconditioner is defined for the low-rank product s·B A only (lora, pissa, eva, dora)"
        )
    tensors = adapter.params
    optimizer = optimizer_cls(list(tensors.values()), **({"lr": lr} | kwargs))

    def precondition(_optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if args[1:] or kwargs.get("closure") is not None:  # args[0] is the optimiser
            raise ValueError(  # error: optim-closure
                "riemannian_optimizer: step(closure) is refused: a closure recomputes the gradients after they were "
                "preconditioned; call loss.backward() then step()"
            )
        grads = {k: g for k, t in tensors.items() if (g := t.grad) is not None}
        with torch.no_grad():
            for k, g in riemannian_precondition(adapter, grads, reg=reg).items():
                grads[k].copy_(g)

    # A step pre-hook of this optimiser only (peft subclasses optimizer_cls to the same effect).
    optimizer.register_step_pre_hook(precondition)
    return optimizer


# ---------------------------------------------------------------------------------- LoRA-FA


def lorafa_project(
    adapter: AdapterLike, grads: Mapping[str, Tensor], *, delta: float = 1e-8, projection_dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """LoRA-FA (Zhang et al. 2023, arXiv 2308.03303) as peft's ``LoraFAOptimizer`` computes it:
    ``A`` frozen, ``B``'s gradient projected to the full-weight gradient's best fit,
    ``g_B ← (1/s²) · g_B (A Aᵀ + δ·I)⁺`` (``s``: the layer's scale). ``A``'s gradient comes back
    as zeros (leave ``A`` out of the optimiser: :func:`lorafa_optimizer` does). Other keys unchanged.

    ``projection_dtype``: the dtype of the projection's product; peft runs it under
    ``torch.autocast(dtype=torch.bfloat16)`` wherever bf16 is available (CPUs included), which is
    ``projection_dtype=torch.bfloat16`` on fp32 tensors (fp64 tensors are never autocast). ``None``
    (default): the gradient's own dtype.
    """
    _check_grads("lorafa_project", adapter, grads)
    params = adapter.params
    out = dict(grads)
    for pair in factor_pairs(adapter):
        if pair.a in grads:
            out[pair.a] = torch.zeros_like(grads[pair.a])
        if pair.b not in grads:
            continue
        a, g_b = params[pair.a].detach(), grads[pair.b]
        eye = torch.eye(a.shape[-2], device=a.device, dtype=a.dtype)
        inverse = torch.linalg.pinv(a @ a.mT + delta * eye)
        scale = pair.scale if not isinstance(pair.scale, Tensor) else pair.scale.to(g_b.dtype)[..., None, None]
        if projection_dtype is not None:
            projected = (1 / scale**2) * (g_b.to(projection_dtype) @ inverse.to(projection_dtype))
        else:
            projected = (1 / scale**2) * (g_b @ inverse)
        out[pair.b] = projected.to(g_b.dtype)
    return out


class LoraFA(torch.optim.Optimizer):
    """peft's ``LoraFAOptimizer`` over an adapter: transformers' AdamW (``eps`` inside the
    bias-corrected step, decoupled weight decay applied after the update) on every trainable
    tensor except the ``A`` factors, which stay frozen, with ``B``'s gradient first projected by
    :func:`lorafa_project`. Build it with :func:`lorafa_optimizer`."""

    def __init__(
        self,
        adapter: AdapterLike,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        projection_dtype: torch.dtype | None = None,
    ) -> None:
        frozen = {pair.a for pair in factor_pairs(adapter)}
        if not frozen:
            raise ValueError(  # error: lorafa-no-factor-pairs
                "lorafa_optimizer: the adapter has no (A, B) factor pair (a (r, d_in) and a (d_out, r) trainable tensor "
                "per layer): LoRA-FA freezes A and projects B's gradient (lora, pissa, eva, dora)"
            )
        names = [k for k in adapter.params if k not in frozen]
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "correct_bias": correct_bias}
        super().__init__([{"params": [adapter.params[k] for k in names], "names": names}], defaults)
        self.adapter, self.projection_dtype = adapter, projection_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            grads = {n: p.grad for p, n in zip(group["params"], group["names"], strict=True) if p.grad is not None}
            projected = lorafa_project(self.adapter, grads, projection_dtype=self.projection_dtype)
            beta1, beta2 = group["betas"]
            for p, name in zip(group["params"], group["names"], strict=True):
                if name not in projected:
                    continue
                grad, state = projected[name], self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
                step_size = group["lr"]
                if group["correct_bias"]:
                    step_size = step_size * math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
                p.addcdiv_(state["exp_avg"], denom, value=-step_size)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])
        return loss


def lorafa_optimizer(adapter: AdapterLike, *, lr: float, weight_decay: float = 0.0, **kwargs: Any) -> LoraFA:
    """:class:`LoraFA` over ``adapter.params`` (peft's ``create_lorafa_optimizer``; betas
    ``(0.9, 0.999)``, ``eps`` 1e-6 unless ``kwargs`` say otherwise). ``A`` is left out of the
    optimiser; the adapter is not changed (peft sets ``requires_grad=False`` on its ``lora_A``)."""
    leaf_adapters(adapter, "lorafa_optimizer(adapter)")
    return LoraFA(adapter, lr=lr, weight_decay=weight_decay, **kwargs)
