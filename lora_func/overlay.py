"""The parameter-dict overlays: ``merge_overlay``, ``overlay`` and ``overlay_mode``.

Each returns (or, for ``overlay_mode``, intercepts) the model's whole parameter dict: every
entry of ``base`` (detached tensors, no copies) with the adapted entries replaced, so
``functional_call`` never touches the model's own ``requires_grad=True`` tensors: backward
costs what the adapter costs, and the model's ``.grad`` stays ``None``. Each is a thin runner
over a :class:`lora_func.plan.Plan`: pass ``plan=`` to reuse one across a loop (it holds for
every ``with_params`` of the adapter it was built for).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from lora_func._lazy import AdaptedBias, AdaptedCalls, AdaptedWeight, _BiasEntry, _ModeEntry
from lora_func._layer_ops import LayerOp, has_kind_form, merged_weight
from lora_func.adapter import AdapterLike
from lora_func.checks import check_base
from lora_func.checks import check_finite as finite_or_raise
from lora_func.plan import Plan, adapter_tensors, check_plan_fits, overlay_plan
from lora_func.targeting import MERGED_ONLY, Target

__all__ = ["merge_overlay", "merged_only_params", "overlay", "overlay_mode"]


def checked_plan(base: Mapping[str, Tensor], adapter: AdapterLike, where: str, check_finite: bool, plan: Plan | None) -> Plan:
    """Everything a parameter-dict overlay checks before it computes anything: the base dict, the
    adapter's structure (a new plan, or ``plan``'s tensors check), and with ``check_finite`` the values."""
    check_base(base, where)
    if plan is None:
        plan, fresh = overlay_plan(base, adapter, where)
        if not fresh:
            plan.check_tensors(adapter, where)
    else:
        check_plan_fits(plan, adapter, base, where)
        plan.check_tensors(adapter, where)
    if check_finite:
        check_adapter_finite(adapter, where)
    return plan


def check_adapter_finite(adapter: AdapterLike, where: str) -> None:
    params, buffers = adapter_tensors(adapter)
    finite_or_raise({**params, **buffers}, f"{where}(check_finite=True): adapter tensors")


def merge_overlay(
    base: Mapping[str, Tensor], adapter: AdapterLike, *, check_finite: bool = False, plan: Plan | None = None
) -> dict[str, Tensor]:
    """``base`` with the merged weight (and bias, where the variant changes it) of every target.

    ``W_eff`` is computed in the adapter dtype from the base weight and cast to the base
    dtype. Tied names of a target (``tied="both"``) get the same merged tensor. ``adapter``
    may be composed (:func:`compose`) or combined (:func:`combine`).

    ``check_finite=True`` raises ``FloatingPointError`` naming the tensors, before anything is
    returned, when an adapter tensor or a merged weight or bias holds a NaN or inf (a diverged
    step, a bad checkpoint, a merge that overflows a half-precision base) instead of handing
    the model garbage. It reads values, so not inside ``torch.func.vmap``. ``plan``: a plan of
    this adapter's structure on this base (:func:`lora_func.make_plan`), skipping its checks.
    """
    plan = checked_plan(base, adapter, "merge_overlay", check_finite, plan)
    out = merged_overlay(plan, base, adapter)
    if check_finite:
        finite_or_raise({k: v for k, v in out.items() if v is not base[k]}, "merge_overlay(check_finite=True): merged weights")
    return out


def merged_overlay(plan: Plan, base: Mapping[str, Tensor], adapter: AdapterLike) -> dict[str, Tensor]:
    """:func:`merge_overlay` without its checks (``plan`` checked ``adapter`` on ``base``)."""
    out = dict(base)
    for key, op in plan.ops(adapter).items():
        _put_merged(out, plan.targets[key].target, op, base)
    return out


def _put_merged(out: dict[str, Tensor], t: Target, op: LayerOp, base: Mapping[str, Tensor]) -> None:
    """Put target ``t``'s merged weight (under every name of it) and changed bias into ``out``."""
    bias = base[t.bias_key] if t.bias_key is not None else None
    w_eff, b_eff = merged_weight(op, base[t.weight_key], bias, t.layout)
    for name in (t.weight_key, *t.tied_keys):
        out[name] = w_eff
    if op.changes_bias and t.bias_key is not None and b_eff is not None:
        out[t.bias_key] = b_eff


def overlay(
    base: Mapping[str, Tensor],
    adapter: AdapterLike,
    *,
    lazy_only: bool = False,
    check_finite: bool = False,
    training: bool = False,
    plan: Plan | None = None,
) -> dict[str, Tensor]:
    """``base`` with lazy stand-ins for the target weights (no merged weights built).

    Each stand-in computes ``base(x)`` plus the variant's activation form inside
    ``F.linear`` (nn.Linear) or ``addmm``/``matmul`` (GPT-2 Conv1D). Any other op on a
    stand-in (an embedding lookup through a tied weight, ...) gets the dense merged weight,
    or raises when ``lazy_only=True``. ``check_finite=True`` raises ``FloatingPointError`` naming
    the adapter tensors that hold a NaN or inf (no merged weight exists to check here).
    ``training=True``: a training op, where the adapter's ``dropout`` option and every variant's
    training-step path act (VeLoRA's compressed gradient, MonteCLoRA's sampling, Poly's relaxed
    mixture, ...; ``adapted_call`` passes ``model.training``): a parameter dict sees no module's
    training flag, so a training loop over ``functional_call`` passes it. ``plan``: as in
    :func:`merge_overlay`.
    """
    plan = checked_plan(base, adapter, "overlay", check_finite, plan)
    return lazy_overlay(plan, base, adapter, lazy_only=lazy_only, training=training)


def lazy_overlay(plan: Plan, base: Mapping[str, Tensor], adapter: AdapterLike, *, lazy_only: bool, training: bool) -> dict[str, Tensor]:
    """:func:`overlay` without its checks (``plan`` checked ``adapter`` on ``base``)."""
    out = dict(base)
    targets = plan.targets
    for key, op in plan.ops(adapter).items():
        t = targets[key].target
        bias = base[t.bias_key] if t.bias_key is not None else None
        if t.layout in MERGED_ONLY and not has_kind_form(op, t.layout):
            _put_merged(out, t, op, base)  # a convolution, a norm, experts: no low-rank path to intercept
            continue
        standin = AdaptedWeight(base[key], bias, op, layout=t.layout, lazy_only=lazy_only, name=key, training=training)
        for name in (key, *t.tied_keys):
            out[name] = standin
        if op.changes_bias and bias is not None and t.bias_key is not None:
            out[t.bias_key] = AdaptedBias(bias, standin, lazy_only=lazy_only, name=t.bias_key)
    return out


def merged_only_params(plan: Plan, base: Mapping[str, Tensor], adapter: AdapterLike) -> dict[str, Tensor]:
    """The merged weights (and changed biases) of the targets of a kind applied through the merged
    weight (``lora_func.targeting.MERGED_ONLY``: convs, norms, experts, and embeddings but where
    the variant has a gather form, ``Variant.kind_forms``), by name:
    what the module route puts in the parameter dict. (Under :func:`overlay_mode` every op on
    such a weight gets its merged weight.)"""
    out: dict[str, Tensor] = {}
    for key, op in plan.ops(adapter).items():
        t = plan.targets[key].target
        if t.layout in MERGED_ONLY and not has_kind_form(op, t.layout):
            _put_merged(out, t, op, base)
    return out


def overlay_mode(
    base: Mapping[str, Tensor],
    adapter: AdapterLike,
    *,
    lazy_only: bool = False,
    check_finite: bool = False,
    training: bool = False,
    plan: Plan | None = None,
) -> AdaptedCalls:
    """The lazy overlay as a torch-function mode over the model's own base tensors, for code
    that ``torch.compile`` traces (dynamo cannot create :func:`overlay`'s stand-ins)::

        with lora_func.overlay_mode(base, adapter):
            out = functional_call(model, base, args)

    While the ``with`` block runs, the layer's own op on a target weight of ``base`` (found by
    identity: pass the same ``base`` dict, or tensors from it, to ``functional_call``) takes
    the variant's low-rank path, any other op on a target weight gets the dense merged weight
    (or raises with ``lazy_only=True``), exactly as with :func:`overlay`. :func:`adapted_call`
    uses it by itself while compiling. In eager code prefer :func:`overlay`: the mode looks at
    the arguments of every torch call in the block, a Python cost per op that only a trace
    pays once. ``check_finite=True`` checks the adapter tensors as :func:`overlay` does.
    (Formerly ``overlay_calls``: it returns a mode, not calls.)
    """
    plan = checked_plan(base, adapter, "overlay_mode", check_finite, plan)
    entries: list[_ModeEntry | _BiasEntry] = []
    for key, op in plan.ops(adapter).items():
        t = plan.targets[key].target
        bias = base[t.bias_key] if t.bias_key is not None else None
        entry = _ModeEntry(base[key], bias, op, layout=t.layout, lazy_only=lazy_only, name=key, training=training)
        entries.append(entry)
        if op.changes_bias and bias is not None and t.bias_key is not None:
            entries.append(_BiasEntry(bias, entry, lazy_only=lazy_only, name=t.bias_key))
    return AdaptedCalls(entries)


"""Deprecated (removed in 0.2): :func:`overlay_mode` under its old name."""
