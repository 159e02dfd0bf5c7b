"""An adapted call: ``adapted_call`` and ``adapted``, on either route, over one validated plan.

This module is the only place that calls ``torch.func.functional_call`` (under ``torch.compile``)
and builds :class:`lora_func._application.Application` s for one adapter: the overlay route (a
parameter dict of stand-ins or merged weights) or the module-call route (each target module's
``forward`` replaced, for the call, by the variant on whatever weight the module holds then:
quantized, FSDP2-gathered or plain). Every structural check is the plan's
(:mod:`lora_func.plan`), built once per structure and kept per model.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_func._application import Application, refuse_checkpointing_in_transform
from lora_func._model import base_params, check_base_params
from lora_func._routing import module_forward, module_replay
from lora_func._sharded import is_sharded, swapped_on
from lora_func._layer_ops import LayerCall, LayerOp, has_kind_form, merged_weight
from lora_func.adapter import AdapterLike, AdapterNode, leaves
from lora_func.checks import check_base, check_model
from lora_func.checks import check_finite as finite_or_raise
from lora_func.overlay import check_adapter_finite, lazy_overlay, merged_only_params, merged_overlay
from lora_func.plan import Plan, Route, adapter_tensors, build_plan, cached_plan, check_plan_fits, detached_base, plans_for, structure_key
from lora_func.prompts._apply import contains_prompt, prompt_adapted, prompt_call
from lora_func.quantized import QuantizedKind, frozen_call, frozen_forwards, kind_of_tensor
from lora_func.targeting import MERGED_ONLY, Target, canonical_weight
from lora_func.variants import BaseLayer

__all__ = ["adapted", "adapted_call", "make_plan"]


# ----------------------------------------------------------------------------- the module route


class _QuantizedLayer:
    """A quantized target as the activation form sees it (a ``BaseLayer``): calling it runs the
    layer's frozen op; ``weight`` is dequantized only if the form reads it (DoRA, HRA)."""

    __slots__ = ("_call", "_kind", "_module", "_weight", "bias", "training")

    def __init__(self, module: Any, kind: QuantizedKind) -> None:
        self._module, self._kind, self.bias, self.training = module, kind, module.bias, module.training
        self._call = frozen_call(module, kind)
        self._weight: Tensor | None = None

    @property
    def weight(self) -> Tensor:
        if self._weight is None:
            self._weight = self._kind.dequantize(self._module)
        return self._weight

    def __call__(self, x: Tensor) -> Tensor:
        return self._call(x)


def _module_call(target: Target, op: LayerOp, merged: bool) -> Any:
    """The module-call route's forward of one target: the variant on the tensor the module holds."""
    layout = module_forward(target.layout)

    def forward(module: Any, inner: Any, x: Tensor) -> Tensor:
        x_op, finish = layout.prepare(x, target.d_out)
        bias = getattr(module, "bias", None)  # an nn.Embedding has none
        if is_sharded(module.weight):
            raise RuntimeError(  # error: fsdp-weight-still-sharded
                f"{target.module} was called while its weight is still sharded (a DTensor): FSDP2 gathers a "
                f"module's weights in the forward of the fully_shard-ed module that owns them; call the model (or that "
                f"module), not {target.module} on its own, or fully_shard a module that contains it"
            )
        kind = kind_of_tensor(module.weight)
        if kind is not None and merged:
            # A dense merged weight for this call only, in the dtype the weight was quantized from.
            w_eff, b_eff = merged_weight(op, kind.dequantize(module), bias, target.layout)
            b = b_eff if op.changes_bias else bias
            y = layout.merged(x_op.to(w_eff.dtype), w_eff, None if b is None else b.to(w_eff.dtype))
            return finish(y.to(x.dtype))
        if kind is not None:
            return finish(op.activation(x_op, cast(BaseLayer, _QuantizedLayer(module, kind))))  # read-only: see _layer_ops
        weight = module.weight
        if merged:
            w_eff, b_eff = merged_weight(op, weight, bias, target.layout)
            return finish(layout.merged(x_op, w_eff, b_eff if op.changes_bias else bias))
        base = LayerCall(canonical_weight(weight, target.layout), bias, inner, module.training, module_replay(module))
        return finish(op.activation(x_op, base))

    return forward


def application(
    model: nn.Module, plan: Plan, base: Mapping[str, Tensor], adapter: AdapterLike, *, merged: bool, lazy_only: bool, whole_base: bool
) -> Application:
    """What an adapted call puts on ``model`` (see :mod:`lora_func._application`), by ``plan``.

    ``whole_base``: reparametrize every tensor with ``base`` (``adapted_call``: no ``.grad`` on
    the model) or only the adapted entries (``adapted``: the model keeps its own tensors)."""
    refuse_checkpointing_in_transform(model)
    modules = plan.modules(model)
    forwards: dict[str, Any] = {}
    params: Mapping[str, Tensor]
    if plan.route == "overlay":
        params = merged_overlay(plan, base, adapter) if merged else lazy_overlay(plan, base, adapter, lazy_only=lazy_only, training=model.training)
    else:
        # The kinds applied through their merged weight (embeddings, convs, norms, experts) go in
        # the parameter dict on this route too; the module calls adapt Linear / Conv1D layers.
        params = {**base, **merged_only_params(plan, base, adapter)}
        forwards = {
            t.module: _module_call(t, op, merged)
            for key, op in plan.ops(adapter).items()
            if (t := plan.targets[key].target).layout not in MERGED_ONLY or has_kind_form(op, t.layout)
        }
    if not whole_base:
        params = {name: tensor for name, tensor in params.items() if tensor is not base[name]}
    params = swapped_on(params, modules, plan.fsdp, "adapted_call")
    forwards = {**frozen_forwards(model, exclude=forwards, modules=modules), **forwards}
    return Application(model, params, forwards, trainable=tuple(adapter_tensors(adapter)[0].values()), modules=modules)


# ----------------------------------------------------------------------------- the plan of a call


def make_plan(
    model: nn.Module,
    adapter: AdapterLike,
    *,
    base: Mapping[str, Tensor] | None = None,
    route: Route = "auto",
    where: str = "make_plan",
) -> Plan:
    """The validated plan of ``adapter``'s structure on ``model`` (public as :func:`lora_func.make_plan`).

    Every structural check of an adapted call runs here, once: the base dict (``base``, default
    ``base_params(model)``) against the model's names, the adapter's targets against the model
    (names, shapes, layouts, ties, quantized and sharded weights) and ``route`` (``"auto"``,
    ``"overlay"``, ``"module"``). The plan reads no tensor values, so it holds for every
    ``adapter.with_params(...)``: pass it as ``plan=`` to :func:`adapted_call`,
    :func:`lora_func.overlay` or :func:`lora_func.merge_overlay` across a training loop (those
    then check only the adapter tensors' shapes, devices and dtypes). ``adapted_call`` finds the
    plan of an adapter it saw before by itself (a per-model cache, by structure)."""
    check_model(model, where)
    if base is None:
        base = base_params(model)
    else:
        check_base(base, where)
        check_base_params(model, base)
    return build_plan(base, adapter, model=model, route=route, where=where)


def _call_plan(
    model: nn.Module, base: Mapping[str, Tensor], given: bool, adapter: AdapterLike, route: Route, where: str, plan: Plan | None
) -> Plan:
    """The plan of this call: ``plan`` (checked to fit), the model's cached one, or a new one."""
    if plan is not None:
        check_plan_fits(plan, adapter, base, where, model=model)
        plan.check_tensors(adapter, where)
        return plan
    fresh: list[Plan] = []

    def build() -> Plan:
        if given:
            check_base_params(model, base)
        fresh.append(build_plan(base, adapter, model=model, route=route, where=where))
        return fresh[0]

    found = cached_plan(model, base, adapter, route=route, build=build)
    if not fresh:
        found.check_tensors(adapter, where)
    return found


class _Memo:
    """A plan's last lazy application, kept for the next inference call with the same base dict,
    adapter tensors and options: valid while the dict holds the same names and tensor objects,
    and the adapter the same tensors at the same versions (no in-place write since). Kept beside
    the plan (:data:`_LAST`), never in it: a plan is an immutable description."""

    __slots__ = ("key", "keys", "parts", "tensors", "values", "versions")

    def __init__(self, key: tuple, base: Mapping[str, Tensor], adapter: AdapterLike, application: Application) -> None:
        # Not the model: the plan that holds this memo is held weakly by the model.
        self.key, self.parts = key, (application.params, application.forwards, application.trainable, application.modules)

        self.keys, self.values = list(base), tuple(base.values())
        self.tensors = _tensors(adapter)
        self.versions = [t._version for t in self.tensors]

    def valid(self, key: tuple, base: Mapping[str, Tensor], adapter: AdapterLike) -> bool:
        tensors = _tensors(adapter)
        return (
            key == self.key
            and _same_objects(self.values, tuple(base.values()))
            and list(base) == self.keys
            and _same_objects(self.tensors, tensors)
            and [t._version for t in tensors] == self.versions
        )


# plan -> its last lazy application; the plans are held weakly by their models, so each memo goes
# with its plan.
_LAST: weakref.WeakKeyDictionary[Plan, _Memo] = weakref.WeakKeyDictionary()


def _tensors(adapter: AdapterLike) -> tuple[Tensor, ...]:
    params, buffers = adapter_tensors(adapter)
    return (*params.values(), *buffers.values())


def _same_objects(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _memo_key(model: nn.Module, base: Any, merged: bool, lazy_only: bool, check_finite: bool, route: str) -> tuple | None:
    """The options under which this call may reuse its plan's last application, or ``None`` when
    it may not: only eager inference (no grad, no transform, no trace) of the lazy path with a
    reused base dict (merged weights and ``check_finite`` checks read values, which in-place writes change)."""
    if base is None or merged or check_finite or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return None
    return (lazy_only, route, model.training)


def _memoised(model: nn.Module, key: tuple, base: Mapping[str, Tensor], adapter: AdapterLike, plan: Plan | None) -> Application | None:
    candidates = [plan] if plan is not None else plans_for(model)
    for candidate in candidates:
        memo = _LAST.get(candidate)
        if (
            memo is not None
            and memo.valid(key, base, adapter)
            and structure_key(adapter) == candidate.structure
            and candidate.model_unchanged(model)
        ):
            params, forwards, trainable, modules = memo.parts
            return Application(model, params, forwards, trainable, modules)
    return None


# ----------------------------------------------------------------------------- the public calls


def adapted_call(
    model: nn.Module,
    adapter: AdapterLike,
    *args: Any,
    merged: bool = False,
    base: Mapping[str, Tensor] | None = None,
    lazy_only: bool = False,
    check_finite: bool = False,
    route: Route = "auto",
    plan: Plan | None = None,
    **kwargs: Any,
) -> Any:
    """``model(*args, **kwargs)`` with ``adapter`` applied, the model untouched.

    Same as ``functional_call(model, (merge_overlay if merged else overlay)(base, adapter),
    args, kwargs)``, and it also works with activation checkpointing (HF gradient checkpointing,
    reentrant or not, and ``torch.utils.checkpoint`` around blocks of your own): a region that
    backward recomputes gets the adapter again for the recompute. Pass ``base=base_params(model)``
    to reuse one base dict across calls.

    ``route`` says where the adapter meets a target: ``"overlay"`` replaces the target weights
    in the parameter dict (stand-ins or merged weights; the canonical path for plain
    ``nn.Linear``/``Conv1D``), ``"module"`` applies the variant at the target module's call to
    whatever weight the module holds then (for layers whose weight a parameter dict cannot
    replace; it refuses tied targets). ``"auto"`` (default) picks the overlay for plain layers,
    the module route for quantized targets and on a model sharded by FSDP2 (``fully_shard``:
    the adapter meets each target after FSDP2's all-gather; the base must be frozen; see
    docs/scaling.md). On plain layers both give the same outputs and gradients.

    The checks run once per adapter structure (:func:`lora_func.make_plan`; the plan of an
    adapter seen before is found by structure, ``with_params`` keeps it); ``plan=`` passes one
    explicitly.

    Under ``torch.compile`` the lazy path (``merged=False``) runs as a torch-function mode
    (:func:`overlay_mode`) instead of stand-in tensors, which dynamo cannot create: same
    outputs and gradients, ``fullgraph=True`` works, and new adapter values reuse the compiled
    graph. A hand-written ``functional_call(model, overlay(...))`` does not
    compile, nor survive checkpointing: call ``adapted_call`` (or use ``merge_overlay``) there.

    ``check_finite=True``: see :func:`merge_overlay` and :func:`overlay` (eager code only: it
    reads values). ``lazy_only=True``: see :func:`overlay`.

    ``merged`` defaults follow one rule across the package: ``False`` (the lazy path) for a call
    that may be differentiated (``adapted_call``, ``ensemble_call``, ``mixed_call``, the
    overlays), ``True`` only for :func:`adapted`, a block of many gradient-free calls
    (generation), where building the merged weights once is cheaper than the low-rank path on
    every call.
    """
    where = "adapted_call"
    check_model(model, where)
    if contains_prompt(adapter):  # an input-level adapter (lora_func.prompts), alone or composed with weight-level ones
        return prompt_call(model, adapter, args, kwargs, base=base, call_weights=lambda weights, *a, **k: adapted_call(
            model, weights, *a, merged=merged, base=base, lazy_only=lazy_only, check_finite=check_finite, route=route, plan=plan, **k))
    memo_key = _memo_key(model, base, merged, lazy_only, check_finite, route)
    if memo_key is not None and base is not None:
        reused = _memoised(model, memo_key, base, adapter, plan)
        if reused is not None:
            return reused(*args, **kwargs)
    given = base
    if base is None:
        base = base_params(model)
    else:
        check_base(base, where)
    plan = _call_plan(model, base, given is not None, adapter, route, where, plan)
    if given is not None:
        # A dict from named_parameters() holds the model's requires_grad tensors: backward
        # would fill their .grad.
        base = detached_base(base)
    if check_finite:
        check_adapter_finite(adapter, where)
    if plan.route == "overlay" and torch.compiler.is_compiling():
        # Dynamo cannot trace the creation of the lazy stand-ins; the same lazy path as a
        # torch-function mode over the base tensors traces with fullgraph=True. Checkpointed
        # regions are dynamo's own (it traces them, the adapter's ops included), so no
        # Application re-applies anything at recompute.
        from lora_func.overlay import merge_overlay, overlay_mode

        if merged:
            params = merge_overlay(base, adapter, check_finite=check_finite, plan=plan)
            return torch.func.functional_call(model, params, args, kwargs, tie_weights=True, strict=False)
        with overlay_mode(base, adapter, lazy_only=lazy_only, training=model.training, plan=plan):
            return torch.func.functional_call(model, dict(base), args, kwargs, tie_weights=True, strict=False)
    applied = application(model, plan, base, adapter, merged=merged, lazy_only=lazy_only, whole_base=True)
    if check_finite and merged and plan.route == "overlay":
        finite_or_raise({k: v for k, v in applied.params.items() if v is not base[k]}, "merge_overlay(check_finite=True): merged weights")
    if memo_key is not None and given is not None:
        _LAST[plan] = _Memo(memo_key, given, adapter, applied)
    return applied(*args, **kwargs)


@contextlib.contextmanager
def adapted(
    model: nn.Module, adapter: AdapterLike, *, merged: bool | None = None, lazy_only: bool = False, route: Route = "auto"
) -> Iterator[nn.Module]:
    """Within the ``with`` block, ``model``'s adapted tensors are swapped for the overlay's;
    on exit (also on error) the model's own tensors are put back, untouched.

    For stateful APIs that call the model many times, e.g. ``model.generate``::

        with torch.no_grad(), lora_func.adapted(model, adapter):
            tokens = model.generate(input_ids, max_new_tokens=20)

    ``merged=True`` (the default, ``None``, except for an adapter with a variant that has no
    merged weight: Lily, Arrow, whose default is the lazy route) computes the merged weights
    once for the whole block (fast for generation; the package's rule for ``merged``'s default
    is in :func:`adapted_call`);
    ``merged=False`` uses the lazy stand-ins (``lazy_only``: as in :func:`overlay`). Only the
    adapted entries are swapped. ``route``: as in :func:`adapted_call`. Not for training (use :func:`adapted_call`
    or ``functional_call`` under ``torch.func.grad``), and not thread-safe: other users of
    ``model`` see the adapter while the block runs.
    """
    where = "adapted"
    if contains_prompt(adapter):  # an input-level adapter (lora_func.prompts), alone or composed with weight-level ones
        with prompt_adapted(model, adapter, lambda weights: adapted(model, weights, merged=merged, lazy_only=lazy_only, route=route)):
            yield model
        return
    if merged is None:  # merged weights, unless a variant has none (Variant.merges)
        merged = all(leaf.variant.merges for _, leaf in leaves(adapter)) if isinstance(adapter, AdapterNode) else True
    base = base_params(model)
    plan = _call_plan(model, base, False, adapter, route, where, None)
    applied = application(model, plan, base, adapter, merged=merged, lazy_only=lazy_only, whole_base=False)
    with applied.applied():
        yield model
