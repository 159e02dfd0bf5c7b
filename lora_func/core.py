"""init_adapter, the two overlays and adapted_call (what reads the model is in :mod:`lora_func._model`).

This module is the only place that calls ``torch.func.functional_call``. Overlays return the
model's whole parameter dict (every entry detached, no copies) with the adapted entries
replaced, so ``functional_call`` never touches the model's own ``requires_grad=True``
tensors: backward costs what the adapter costs, and the model's ``.grad`` stays ``None``.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lora_func._application import Application, refuse_checkpointing_in_transform
from lora_func._lazy import AdaptedBias, AdaptedCalls, AdaptedWeight, _BiasEntry, _ModeEntry
from lora_func._routing import module_forward
from lora_func._model import base_params, check_params, fresh_layer, layer_info, shared_init, variant_init
from lora_func._sharded import is_fsdp_model, is_sharded, sharded_keys, swapped_on
from lora_func._steps import LayerCall, LayerStep, VariantStep, merged_weight
from lora_func.quantized import QuantizedKind, frozen_call, frozen_forwards, kind_of_tensor, logical_shape
from lora_func.adapter import Adapter, AdapterLayer, AdapterLike, AdapterNode, leaf_adapters, target_weight_keys, walk
from lora_func.calibration import layer_input_batches
from lora_func.checks import (
    check_adapter_placement,
    check_base,
    check_finite,
    check_float_targets,
    check_layouts,
    check_model,
    detached_base,
)
from lora_func.spec import AdapterSpec
from lora_func.targeting import Target, canonical_weight, close_names, find_targets
from lora_func.variants import get_variant

__all__ = [
    "adapted",
    "adapted_call",
    "init_adapter",
    "merge_overlay",
    "overlay",
    "overlay_calls",
]


def _default_generator() -> torch.Generator:
    # Seeded from the global RNG so that torch.manual_seed reproduces it and two calls give
    # two different adapters (an ensemble must not silently be K copies of one init).
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    return torch.Generator().manual_seed(seed)


def init_adapter(
    model: nn.Module,
    spec: AdapterSpec,
    *,
    generator: torch.Generator | None = None,
    calibration: Any = None,
) -> Adapter:
    """Build the adapter tensors of ``spec`` for every target of ``model``.

    Reads the model, never writes it. ``generator`` is a CPU ``torch.Generator`` (random
    draws happen on the CPU, then move to each weight's device, so an init is the same on
    any device); ``None`` seeds a new one from the global RNG. ``calibration`` is passed to
    data-driven variants. Returns an :class:`Adapter` whose params are leaf tensors with
    ``requires_grad=True``.
    """
    check_model(model, "init_adapter")
    if not isinstance(spec, AdapterSpec):
        raise TypeError(f"init_adapter expects an AdapterSpec, got {type(spec).__name__}")  # error: init-not-spec
    variant = get_variant(spec.variant)
    if variant.calibrate is not None and calibration is not None and (
        isinstance(calibration, (str, bytes, Mapping, Tensor)) or not isinstance(calibration, Iterable)
    ):
        # Before the generator draws its seed: a refused call leaves the global RNG alone.
        raise TypeError(  # error: init-calibration-type
            f"init_adapter: calibration must be an iterable of batches (dicts with 'input_ids'), got "
            f"{type(calibration).__name__}; e.g. calibration=[{{'input_ids': ids}}] or a DataLoader"
        )
    targets = find_targets(model, spec)
    if variant.uses_rank:
        too_big = [f"{t.module} (d_in={t.d_in}, d_out={t.d_out})" for t in targets if spec.r > min(t.d_in, t.d_out)]
        if too_big:
            raise ValueError(  # error: init-rank-too-big
                f"r={spec.r} exceeds min(d_in, d_out) of target(s) {sorted(too_big)}; lower r or leave them out"
            )
    modules = dict(model.named_modules())
    quantized = {t.module: kind for t in targets if (kind := kind_of_tensor(modules[t.module].weight)) is not None}
    # Checked once here for every variant: integer weights of no registered quantized kind.
    non_float = sorted(
        f"{t.weight_key} is {modules[t.module].weight.dtype}"
        for t in targets
        if t.module not in quantized and not modules[t.module].weight.is_floating_point()
    )
    if non_float:
        raise TypeError(  # error: init-non-float
            f"{spec.variant} needs a floating-point base weight, but {', '.join(non_float)}; dequantize the "
            f"layer to float32/bfloat16/float16 first, or leave it out of the targets"
        )
    if quantized and variant.replaces_weight:
        raise ValueError(  # error: quantized-replaces-weight
            f"{spec.variant} replaces the base weight by a dense residual fixed at init, and targets "
            f"{sorted(quantized)[:4]}{' ...' if len(quantized) > 4 else ''} are quantized (the quantized weight would go "
            f"unused and the residual would take full precision memory): build the adapter on the float model and "
            f"quantize its residual (peft's practice for PiSSA with QLoRA), or pick a variant that keeps the base"
        )
    generator = _default_generator() if generator is None else generator
    infos = {t.module: layer_info(spec, t) for t in targets}
    payloads: dict[str, Any] = dict.fromkeys(infos, calibration)
    if variant.calibrate is not None:
        if calibration is None:
            raise ValueError(  # error: init-needs-calibration
                f"variant {spec.variant!r} is data-driven: pass calibration=<iterable of batches with "
                f"'input_ids' and optionally 'attention_mask' and 'labels'>"
            )
        fitted = variant.calibrate(layer_input_batches(model, targets, calibration), infos, generator=generator)
        targets = [t for t in targets if t.module in fitted]
        infos = {m: fitted[m][0] for m in infos if m in fitted}
        payloads = {m: fitted[m][1] for m in infos}
    # Tensors every layer reads (Variant.shared_init), drawn before the layers' own.
    device = modules[targets[0].module].weight.device if targets else torch.device("cpu")
    params, buffers, shared = shared_init(variant, spec, infos, device=device, generator=generator)
    layers = []
    for target in targets:
        # One target at a time: a sharded target's whole weight is gathered for its init only (a
        # collective: every rank runs this loop in the same order).
        info = infos[target.module]
        init = variant_init(variant, spec, modules[target.module], target, info, generator=generator, calibration=payloads[target.module])
        layer, layer_params, layer_buffers = fresh_layer(variant, target, info, *init)
        params.update({f"{target.module}.{name}": tensor for name, tensor in layer_params.items()})
        buffers.update({f"{target.module}.{name}": tensor for name, tensor in layer_buffers.items()})
        layers.append(layer)
    return Adapter(params, buffers, spec, layers, shared=shared)


def _check(base: Mapping[str, Tensor], adapter: AdapterLike, *, quantized_ok: bool = False) -> None:
    """Validate every node of ``adapter`` against ``base`` before anything is computed; a
    parameter-dict overlay (``quantized_ok=False``) cannot replace a quantized target."""
    if not isinstance(adapter, AdapterNode):
        raise TypeError(  # error: overlay-not-adapter
            f"expected an Adapter, Composed or Combined, got {type(adapter).__name__}; build one with "
            f"lora_func.init_adapter(model, spec) (or lora_func.load)"
        )
    _check_weights(adapter)
    for leaf in leaf_adapters(adapter):
        _check_leaf(base, leaf)
    quantized = _quantized_targets(base, adapter)
    if quantized and not quantized_ok:
        raise ValueError(  # error: quantized-overlay
            f"target(s) {quantized} hold quantized weights, which a parameter dict cannot replace (the layer runs "
            f"its own op on them): use lora_func.adapted_call or lora_func.adapted (they adapt quantized targets at "
            f"the module's call, route='module'), or lora_func.merged_state_dict(..., dtype=...) for a dense export"
        )
    sharded = sorted(target_weight_keys(adapter) & sharded_keys(base))
    if sharded and not quantized_ok:
        raise ValueError(  # error: fsdp-parameter-dict
            f"target(s) {sharded[:4]}{' ...' if len(sharded) > 4 else ''} are sharded by FSDP2 (DTensor), which a "
            f"parameter dict cannot replace (FSDP2 installs its gathered weight at the module's call): use "
            f"lora_func.adapted_call or lora_func.adapted, which adapt them at the module's call (route='module')"
        )


def _quantized_targets(base: Mapping[str, Tensor], adapter: AdapterLike) -> list[str]:
    return sorted(key for key in target_weight_keys(adapter) if kind_of_tensor(base[key]) is not None)


def _check_weights(adapter: AdapterLike) -> None:
    """Every combinator's own tensors (``Combined.weights``) have their unstacked shape."""
    for _, node in walk(adapter):
        own = node.own_params()
        for name, shape in node.own_shapes().items():
            got = tuple(own[name].shape)
            if got != shape:
                hint = "it is stacked: call it under torch.func.vmap" if len(got) > len(shape) else f"keep {name} at shape {shape}"
                raise ValueError(f"{node.tag} adapter {name} have shape {got}, expected {shape}; {hint}")  # error: combine-weights-shape


def _check_leaf(base: Mapping[str, Tensor], adapter: Adapter) -> None:
    missing = sorted({layer.target.weight_key for layer in adapter.layers} - set(base))
    if missing:
        raise KeyError(  # error: overlay-missing-targets
            f"adapter targets {missing} are not tensors of this model (built for another model?); "
            f"close names: {close_names(missing, base) or 'none'}"
        )
    wrong = []
    plan = _layer_plan(adapter.layers)
    for t, stored, _params, _buffers in plan:
        if logical_shape(base[t.weight_key]) != stored:
            wrong.append(f"{t.weight_key}: adapter built for {stored}, model has {logical_shape(base[t.weight_key])}")
    if wrong:
        raise ValueError(f"adapter does not fit this model's target shapes: {sorted(wrong)}")  # error: overlay-target-shape
    for t, _stored, param_keys, buffer_keys in plan:
        for flat, keys in ((adapter.params, param_keys), (adapter.buffers, buffer_keys)):
            for _name, key, shape in keys:
                got = tuple(flat[key].shape)
                if got != shape:
                    hint = (
                        "this adapter is stacked: call it under torch.func.vmap, or pick one with take()/unstack()"
                        if got[len(got) - len(shape) :] == shape
                        else "was it built with another spec?"
                    )
                    raise ValueError(f"adapter tensor {key} has shape {got}, expected {shape}; {hint}")  # error: overlay-tensor-shape


_LayerPlan = tuple[tuple[Target, tuple[int, int], tuple[tuple[str, str, tuple[int, ...]], ...], tuple[tuple[str, str, tuple[int, ...]], ...]], ...]
# id(layers) -> (layers, plan). The layers tuple of an adapter is shared by every adapter that
# with_params/with_buffers/detach derive from it (a training loop's new adapter each step), and
# it is immutable; the entry holds it, so its id cannot be reused while the entry lives.
_LAYER_PLANS: dict[int, tuple[tuple[AdapterLayer, ...], _LayerPlan]] = {}
_LAYER_PLANS_MAX = 64


def _layer_plan(layers: tuple[AdapterLayer, ...]) -> _LayerPlan:
    """Per layer of an adapter: its target, the stored weight shape it fits, and for each param
    and buffer ``(short name, flat key, shape)``. Static per ``layers`` tuple, so built once:
    formatting the flat keys of every tensor on every call was most of the per-call cost of
    checking and splitting an adapter (224 targets of a Llama-8B all-linear adapter)."""
    compiling = torch.compiler.is_compiling()  # a trace runs this once; dynamo cannot trace the lookup
    hit = None if compiling else _LAYER_PLANS.get(id(layers))
    if hit is not None and hit[0] is layers:
        return hit[1]
    plan = tuple(
        (
            layer.target,
            (layer.target.d_out, layer.target.d_in) if layer.target.layout == "linear" else (layer.target.d_in, layer.target.d_out),
            tuple((name, f"{layer.target.module}.{name}", shape) for name, shape in layer.param_shapes),
            tuple((name, f"{layer.target.module}.{name}", shape) for name, shape in layer.buffer_shapes),
        )
        for layer in layers
    )
    if compiling:
        return plan
    if len(_LAYER_PLANS) >= _LAYER_PLANS_MAX:
        _LAYER_PLANS.pop(next(iter(_LAYER_PLANS)))
    _LAYER_PLANS[id(layers)] = (layers, plan)
    return plan


def _layer_steps(adapter: AdapterLike) -> dict[str, tuple[Target, LayerStep]]:
    """What to apply to each target weight key, in the model's names: a leaf's variant steps,
    and at each combinator the steps of its parts on a layer combined by ``layer_step``."""
    if not adapter.parts:  # a leaf Adapter
        out: dict[str, tuple[Target, LayerStep]] = {}
        variant, dtype, flat_params, flat_buffers = adapter.variant, adapter.spec.dtype, adapter.params, adapter.buffers
        shared_params, shared_buffers = adapter.shared_tensors()  # every layer reads them (one leaf each)
        for layer, (t, _stored, param_keys, buffer_keys) in zip(adapter.layers, _layer_plan(adapter.layers), strict=True):
            params = shared_params | {name: flat_params[key] for name, key, _ in param_keys}
            buffers = shared_buffers | {name: flat_buffers[key] for name, key, _ in buffer_keys}
            out[t.weight_key] = (t, VariantStep(variant, params, buffers, layer.info, dtype))
        return out
    per_part = [_layer_steps(part) for part in adapter.parts]
    out = {}
    for key in dict.fromkeys(key for steps in per_part for key in steps):
        present = [k for k, steps in enumerate(per_part) if key in steps]
        target = per_part[present[0]][key][0]
        out[key] = (target, adapter.layer_step([per_part[k][key][1] for k in present], present))
    return out


def _check_adapter_finite(adapter: AdapterLike, where: str) -> None:
    check_finite({**adapter.params, **adapter.buffers}, f"{where}(safe=True): adapter tensors")


def _check_overlay_arguments(base: Any, adapter: AdapterLike, where: str, safe: bool) -> None:
    """Everything a parameter-dict overlay checks before it computes anything."""
    check_base(base, where)
    _check(base, adapter)
    check_adapter_placement(base, adapter, where)
    check_float_targets(base, adapter, where)
    if safe:
        _check_adapter_finite(adapter, where)


def merge_overlay(base: Mapping[str, Tensor], adapter: AdapterLike, *, safe: bool = False) -> dict[str, Tensor]:
    """``base`` with the merged weight (and bias, where the variant changes it) of every target.

    ``W_eff`` is computed in the adapter dtype from the base weight and cast to the base
    dtype. Tied names of a target (``tied="both"``) get the same merged tensor. ``adapter``
    may be composed (:func:`compose`) or combined (:func:`combine`).

    ``safe=True`` raises ``FloatingPointError`` naming the tensors, before anything is
    returned, when an adapter tensor or a merged weight or bias holds a NaN or inf (a diverged
    step, a bad checkpoint, a merge that overflows a half-precision base) instead of handing
    the model garbage. It reads values, so not inside ``torch.func.vmap``.
    """
    _check_overlay_arguments(base, adapter, "merge_overlay", safe)
    out = dict(base)
    merged: dict[str, Tensor] = {}
    for key, (t, step) in _layer_steps(adapter).items():
        bias = base[t.bias_key] if t.bias_key is not None else None
        w_eff, b_eff = merged_weight(step, base[key], bias, t.layout)
        for name in (key, *t.tied_keys):
            out[name] = w_eff
        merged[key] = w_eff
        if step.changes_bias and t.bias_key is not None:
            out[t.bias_key] = merged[t.bias_key] = b_eff  # type: ignore[assignment]
    if safe:
        check_finite(merged, "merge_overlay(safe=True): merged weights")
    return out


def overlay(
    base: Mapping[str, Tensor], adapter: AdapterLike, *, strict: bool = False, safe: bool = False, training: bool = False
) -> dict[str, Tensor]:
    """``base`` with lazy stand-ins for the target weights (no merged weights built).

    Each stand-in computes ``base(x)`` plus the variant's activation form inside
    ``F.linear`` (nn.Linear) or ``addmm``/``matmul`` (GPT-2 Conv1D). Any other op on a
    stand-in (an embedding lookup through a tied weight, ...) gets the dense merged weight,
    or raises when ``strict=True``. ``safe=True`` raises ``FloatingPointError`` naming the
    adapter tensors that hold a NaN or inf (no merged weight exists to check here).
    ``training=True``: a training step, where the adapter's ``dropout`` option acts
    (``adapted_call`` passes ``model.training``).
    """
    _check_overlay_arguments(base, adapter, "overlay", safe)
    out = dict(base)
    for key, (t, step) in _layer_steps(adapter).items():
        bias = base[t.bias_key] if t.bias_key is not None else None
        standin = AdaptedWeight(base[key], bias, step, layout=t.layout, strict=strict, name=key, training=training)
        for name in (key, *t.tied_keys):
            out[name] = standin
        if step.changes_bias and bias is not None:
            out[t.bias_key] = AdaptedBias(bias, standin, strict=strict, name=t.bias_key)  # type: ignore[index]
    return out


def overlay_calls(
    base: Mapping[str, Tensor], adapter: AdapterLike, *, strict: bool = False, safe: bool = False, training: bool = False
) -> AdaptedCalls:
    """The lazy overlay as a torch-function mode over the model's own base tensors, for code
    that ``torch.compile`` traces (dynamo cannot create :func:`overlay`'s stand-ins)::

        with lora_func.overlay_calls(base, adapter):
            out = functional_call(model, base, args)

    While the ``with`` block runs, the layer's own op on a target weight of ``base`` (found by
    identity: pass the same ``base`` dict, or tensors from it, to ``functional_call``) takes
    the variant's low-rank path, any other op on a target weight gets the dense merged weight
    (or raises with ``strict=True``), exactly as with :func:`overlay`. :func:`adapted_call`
    uses it by itself while compiling. In eager code prefer :func:`overlay`: the mode looks at
    the arguments of every torch call in the block, a Python cost per op that only a trace
    pays once. ``safe=True`` checks the adapter tensors as :func:`overlay` does.
    """
    check_base(base, "overlay_calls")
    _check(base, adapter)
    check_adapter_placement(base, adapter, "overlay_calls")
    check_float_targets(base, adapter, "overlay_calls")
    if safe:
        _check_adapter_finite(adapter, "overlay_calls")
    entries: list[_ModeEntry | _BiasEntry] = []
    for key, (t, step) in _layer_steps(adapter).items():
        bias = base[t.bias_key] if t.bias_key is not None else None
        entry = _ModeEntry(base[key], bias, step, layout=t.layout, strict=strict, name=key, training=training)
        entries.append(entry)
        if step.changes_bias and bias is not None:
            entries.append(_BiasEntry(bias, entry, strict=strict, name=t.bias_key))  # type: ignore[arg-type]
    return AdaptedCalls(entries)


ROUTES = ("auto", "overlay", "module")


class _QuantizedLayer:
    """A quantized target as the activation form sees it (a ``BaseLayer``): calling it runs the
    layer's frozen op; ``weight`` is dequantized only if the form reads it (DoRA, HRA)."""

    __slots__ = ("_call", "_kind", "_module", "_weight", "bias", "training")

    def __init__(self, module: nn.Module, kind: QuantizedKind) -> None:
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


def _module_call(target: Target, step: LayerStep, merged: bool) -> Any:
    """The module-call route's forward of one target: the variant on the tensor the module holds."""
    layout = module_forward(target.layout)

    def forward(module: nn.Module, inner: Any, x: Tensor) -> Tensor:
        x_op, finish = layout.prepare(x, target.d_out)
        bias = module.bias
        if is_sharded(module.weight):
            raise RuntimeError(  # error: fsdp-weight-still-sharded
                f"{target.module} was called while its weight is still sharded (a DTensor): FSDP2 gathers a "
                f"module's weights in the forward of the fully_shard-ed module that owns them; call the model (or that "
                f"module), not {target.module} on its own, or fully_shard a module that contains it"
            )
        kind = kind_of_tensor(module.weight)
        if kind is not None and merged:
            # A dense merged weight for this call only, in the dtype the weight was quantized from.
            w_eff, b_eff = merged_weight(step, kind.dequantize(module), bias, target.layout)
            b = b_eff if step.changes_bias else bias
            y = layout.merged(x_op.to(w_eff.dtype), w_eff, None if b is None else b.to(w_eff.dtype))
            return finish(y.to(x.dtype))
        if kind is not None:
            return finish(step.activation(x_op, _QuantizedLayer(module, kind)))
        weight = module.weight
        if merged:
            w_eff, b_eff = merged_weight(step, weight, bias, target.layout)
            return finish(layout.merged(x_op, w_eff, b_eff if step.changes_bias else bias))
        return finish(step.activation(x_op, LayerCall(canonical_weight(weight, target.layout), bias, inner, module.training)))

    return forward


def _module_forwards(adapter: AdapterLike, *, merged: bool) -> dict[str, Any]:
    steps = _layer_steps(adapter)
    tied = sorted(f"{key} (also {', '.join(t.tied_keys)})" for key, (t, _) in steps.items() if t.tied_keys)
    if tied:
        raise ValueError(  # error: route-module-tied
            f"route='module' adapts a target at its module's call, but target weight(s) {tied} are also used "
            f"elsewhere under another name, which would see the base weight; use route='overlay' for tied targets"
        )
    return {t.module: _module_call(t, step, merged) for t, step in steps.values()}


def _resolve_route(route: str, base: Mapping[str, Tensor], adapter: AdapterLike, fsdp: bool = False) -> str:
    """``fsdp``: the model has a ``fully_shard``-ed module (see :mod:`lora_func._sharded`)."""
    if route not in ROUTES:
        raise ValueError(  # error: route-unknown
            f"route={route!r} is not one of {list(ROUTES)}; route='auto' picks the overlay for plain layers and the "
            f"module-call route for quantized ones and for models sharded by FSDP2"
        )
    if fsdp and route == "overlay":
        raise ValueError(  # error: fsdp-overlay-route
            "route='overlay' on a model sharded by FSDP2 (fully_shard): FSDP2 installs its gathered weights at each "
            "module's call over anything a parameter dict put there, so the adapter would be silently ignored; use "
            "route='auto' or route='module' (the adapter is applied at each target's call, after FSDP2's all-gather)"
        )
    if fsdp:
        return "module"
    if route != "auto":
        return route
    try:
        quantized = _quantized_targets(base, adapter)
    except (KeyError, AttributeError, TypeError):
        return "overlay"  # not an adapter of this model: the overlay's checks say what is wrong
    return "module" if quantized else "overlay"


def _application(
    model: nn.Module,
    base: Mapping[str, Tensor],
    adapter: AdapterLike,
    *,
    merged: bool,
    route: str,
    strict: bool,
    safe: bool,
    whole_base: bool,
    modules: Mapping[str, nn.Module] | None = None,
    fsdp: bool | None = None,
) -> Application:
    """What an adapted call puts on ``model`` (see :mod:`lora_func._application`).

    ``whole_base``: reparametrize every tensor with ``base`` (``adapted_call``: no ``.grad`` on
    the model) or only the adapted entries (``adapted``: the model keeps its own tensors)."""
    modules = dict(model.named_modules()) if modules is None else modules
    fsdp = is_fsdp_model(modules) if fsdp is None else fsdp
    route = _resolve_route(route, base, adapter, fsdp)
    refuse_checkpointing_in_transform(model)
    if route == "overlay":
        params = merge_overlay(base, adapter, safe=safe) if merged else overlay(base, adapter, strict=strict, safe=safe, training=model.training)
        forwards: dict[str, Any] = {}
    else:
        _check(base, adapter, quantized_ok=True)
        check_adapter_placement(base, adapter, "adapted_call")
        if safe:
            _check_adapter_finite(adapter, "adapted_call")
        params, forwards = dict(base), _module_forwards(adapter, merged=merged)
    if not whole_base:
        params = {name: tensor for name, tensor in params.items() if tensor is not base[name]}
    params = swapped_on(params, modules, fsdp, "adapted_call")
    forwards = {**frozen_forwards(model, exclude=forwards, modules=modules), **forwards}
    return Application(model, params, forwards, trainable=tuple(adapter.params.values()), modules=modules)


def _module_tree(model: nn.Module) -> list[Any]:
    """Every submodule of ``model`` with its class and its numbers of parameters and buffers:
    the structure an adapted call was validated against (a walk, but no names built). The model
    itself is left out: what keeps this list must not keep the model alive."""
    out: list[Any] = [type(model), len(model._parameters), len(model._buffers)]
    stack = [child for child in model._modules.values() if child is not None]
    while stack:
        module = stack.pop()
        out += (module, type(module), len(module._parameters), len(module._buffers))
        stack.extend(child for child in module._modules.values() if child is not None)
    return out


def _same_objects(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


class _Reusable:
    """A validated lazy application, kept for the next inference call with the same base dict,
    adapter and options: valid while the dict holds the same names and tensor objects, the
    adapter the same tensors at the same versions (no in-place write since), and the model the
    same modules with as many parameters and buffers each. It holds no reference to the model
    (the weak key of :data:`_REUSABLE`): deleting the model frees it."""

    __slots__ = ("key", "keys", "model_tree", "parts", "tensors", "values", "versions")

    def __init__(self, key: tuple, model: nn.Module, base: Mapping[str, Tensor], adapter: AdapterLike, application: Application) -> None:
        self.key = key
        self.parts = (application.params, application.forwards, application.trainable, application.modules)
        self.keys, self.values = list(base), tuple(base.values())
        self.tensors = (*adapter.params.values(), *adapter.buffers.values())
        self.versions = [t._version for t in self.tensors]
        self.model_tree = _module_tree(model)

    def valid(self, model: nn.Module, base: Mapping[str, Tensor], adapter: AdapterLike) -> bool:
        return (
            _same_objects(self.values, tuple(base.values()))
            and list(base) == self.keys
            and _same_objects(self.tensors, (*adapter.params.values(), *adapter.buffers.values()))
            and [t._version for t in self.tensors] == self.versions
            and _module_tree(model) == self.model_tree
        )

    def application(self, model: nn.Module) -> Application:
        params, forwards, trainable, modules = self.parts
        return Application(model, params, forwards, trainable, modules)


# The last reusable application of each model (one: a new adapter or base dict replaces it).
_REUSABLE: weakref.WeakKeyDictionary[nn.Module, _Reusable] = weakref.WeakKeyDictionary()


def _reuse_key(model: nn.Module, base: Any, adapter: AdapterLike, merged: bool, strict: bool, safe: bool, route: str) -> tuple | None:
    """The key under which this call may reuse a validated application, or ``None`` when it may
    not: only eager inference (no grad, no transform, no trace) of the lazy path with a reused
    base dict (merged weights and ``safe`` checks read values, which in-place writes change)."""
    if base is None or merged or safe or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return None
    return (id(base), id(adapter), strict, route, model.training)


def adapted_call(
    model: nn.Module,
    adapter: AdapterLike,
    *args: Any,
    merged: bool = False,
    base: Mapping[str, Tensor] | None = None,
    strict: bool = False,
    safe: bool = False,
    route: str = "auto",
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

    Under ``torch.compile`` the lazy path (``merged=False``) runs as a torch-function mode
    (:func:`overlay_calls`) instead of stand-in tensors, which dynamo cannot create: same
    outputs and gradients, ``fullgraph=True`` works, and new adapter values reuse the compiled
    graph. A hand-written ``functional_call(model, overlay(...))`` does not
    compile, nor survive checkpointing: call ``adapted_call`` (or use ``merge_overlay``) there.

    ``safe=True``: see :func:`merge_overlay` and :func:`overlay` (eager code only: it reads values).
    """
    check_model(model, "adapted_call")
    reuse_key = _reuse_key(model, base, adapter, merged, strict, safe, route)
    if reuse_key is not None:
        reusable = _REUSABLE.get(model)
        if reusable is not None and reusable.key == reuse_key and reusable.valid(model, base, adapter):  # type: ignore[arg-type]
            return reusable.application(model)(*args, **kwargs)
    given = base
    if base is None:
        base = base_params(model)
    else:
        check_base(base, "adapted_call")
        check_params(model, base)
        # A dict from named_parameters() holds the model's requires_grad tensors: backward
        # would fill their .grad.
        base = detached_base(base)
    modules = dict(model.named_modules())  # one walk of the model per call, shared by the steps below
    check_layouts(model, adapter, "adapted_call", modules)
    fsdp = is_fsdp_model(modules)
    route = _resolve_route(route, base, adapter, fsdp)  # once: _application takes it as is
    if route == "overlay" and torch.compiler.is_compiling():
        # Dynamo cannot trace the creation of the lazy stand-ins; the same lazy path as a
        # torch-function mode over the base tensors traces with fullgraph=True. Checkpointed
        # regions are dynamo's own (it traces them, the adapter's ops included), so no
        # Application re-applies anything at recompute.
        if merged:
            return torch.func.functional_call(model, merge_overlay(base, adapter, safe=safe), args, kwargs, tie_weights=True, strict=False)
        with overlay_calls(base, adapter, strict=strict, safe=safe, training=model.training):
            return torch.func.functional_call(model, dict(base), args, kwargs, tie_weights=True, strict=False)
    application = _application(
        model, base, adapter, merged=merged, route=route, strict=strict, safe=safe, whole_base=True, modules=modules, fsdp=fsdp
    )
    if reuse_key is not None:
        _REUSABLE[model] = _Reusable(reuse_key, model, given, adapter, application)  # type: ignore[arg-type]
    return application(*args, **kwargs)


@contextlib.contextmanager
def adapted(
    model: nn.Module, adapter: AdapterLike, *, merged: bool = True, strict: bool = False, route: str = "auto"
) -> Iterator[nn.Module]:
    """Within the ``with`` block, ``model``'s adapted tensors are swapped for the overlay's;
    on exit (also on error) the model's own tensors are put back, untouched.

    For stateful APIs that call the model many times, e.g. ``model.generate``::

        with torch.no_grad(), lora_func.adapted(model, adapter):
            tokens = model.generate(input_ids, max_new_tokens=20)

    ``merged=True`` (default) computes the merged weights once for the whole block (fast for
    generation); ``merged=False`` uses the lazy stand-ins. Only the adapted entries are
    swapped. ``route``: as in :func:`adapted_call`. Not for training (use :func:`adapted_call`
    or ``functional_call`` under ``torch.func.grad``), and not thread-safe: other users of
    ``model`` see the adapter while the block runs.
    """
    base = base_params(model)
    check_layouts(model, adapter, "adapted")
    application = _application(model, base, adapter, merged=merged, route=route, strict=strict, safe=False, whole_base=False)
    with application.applied():
        yield model
