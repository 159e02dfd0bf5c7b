"""The model side: what lora_func reads from a model, in one place.

Its parameters as a detached dict (:func:`base_params`), the check of a parameter dict against
it (:func:`check_base_params`), weight fingerprints, the whole float weight of one target (gathered
when FSDP2 shards it, dequantized when it is quantized), and a variant's init on one target
(:func:`variant_init`: :func:`lora_func.init_adapter` and both loaders run it). Nothing here
writes to a model.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from lora_func._sharded import full_tensor, is_sharded
from lora_func.adapter import SHARED, AdapterLayer, SharedTensors
from lora_func.checks import check_model
from lora_func.quantized import kind_of_tensor
from lora_func.spec import AdapterSpec
from lora_func.targeting import CONV_LAYOUTS, Target, canonical_weight, close_names, kind_of_layout
from lora_func.variants import LayerInfo, TensorDict, Variant, group_view

__all__ = [
    "adapter_layer",
    "base_params",
    "check_base_params",
    "fresh_layer",
    "layer_info",
    "layer_infos",
    "numbered_layers",
    "target_weight",
    "variant_init",
    "weight_fingerprint",
]


def base_params(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer of ``model`` by name, detached, sharing storage (no copies).

    Tied names map to one tensor object, as ``functional_call(tie_weights=True)`` requires. A
    quantized weight (:mod:`lora_func.quantized`) is kept as the object the layer holds: its
    layer's op needs the quantization state that a detached view would lose (it is frozen).
    """
    check_model(model, "base_params")
    detached: dict[int, Tensor] = {}
    out: dict[str, Tensor] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(tensor) not in detached:
            detached[id(tensor)] = tensor if kind_of_tensor(tensor) is not None else tensor.detach()
        out[name] = detached[id(tensor)]
    return out


def check_base_params(model: nn.Module, params: Mapping[str, Tensor]) -> None:
    """Raise ``KeyError`` unless ``params`` names exactly the model's parameters and buffers.

    ``functional_call(strict=False)`` silently ignores a mistyped key; this lists the
    offending keys sorted, with the model's close names.
    """
    # One walk of the modules (named_parameters and named_buffers would walk them twice): the
    # same names, tied ones included (remove_duplicate=False), None entries skipped as they do.
    names = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules(remove_duplicate=False)
        for group in (module._parameters, module._buffers)
        for name, tensor in group.items()
        if tensor is not None
    }
    unexpected = sorted(set(params) - names)
    missing = sorted(names - set(params))
    if unexpected:
        raise KeyError(  # error: params-unexpected
            f"{unexpected} are not parameters or buffers of {type(model).__name__}; "
            f"close names: {close_names(unexpected, names) or 'none'}"
        )
    if missing:
        raise KeyError(  # error: params-missing
            f"parameter dict lacks {missing[:10]}{' ...' if len(missing) > 10 else ''} "
            f"({len(missing)} missing); build it from lora_func.base_params(model)"
        )


def weight_fingerprint(weight: Tensor) -> str:
    """A digest of a tensor's dtype, shape and bytes (sha256, first 16 hex digits); a quantized
    tensor subclass by the bytes of its inner tensors (its own ops may not view its bytes); a
    weight sharded by FSDP2 as the whole weight (gathered: every rank must call this)."""
    digest = hashlib.sha256()
    _digest_into(digest, weight)
    return digest.hexdigest()[:16]


def _digest_into(digest: Any, tensor: Tensor) -> None:
    if is_sharded(tensor):
        tensor = full_tensor(tensor)  # the whole weight's digest, the same as unsharded (a collective)
    if type(tensor) not in (Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        digest.update(f"{type(tensor).__name__}{tuple(tensor.shape)}".encode())
        for name in names:
            _digest_into(digest, getattr(tensor, name))
        return
    data = tensor.detach().as_subclass(Tensor).to("cpu").contiguous()
    digest.update(f"{data.dtype}{tuple(data.shape)}".encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")


def target_weight(module: nn.Module, target: Target) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(W, b, stored)`` of one target as a variant's init reads them: ``W`` canonical
    ``(d_out, d_in)`` in a float dtype, ``b`` ``(d_out,)`` or ``None``, ``stored`` the weight as
    the layer holds it (what its fingerprint digests). Whole tensors when FSDP2 shards them (a
    collective: every rank calls this for the same targets in the same order); ``W``
    dequantized when the layer is quantized. Detached: call it under ``torch.no_grad()``."""
    weight = cast(Tensor, getattr(module, target.weight_key.rpartition(".")[2]))  # an expert parameter's own name
    bias = full_tensor(cast(Tensor, getattr(module, target.bias_key.rpartition(".")[2])).detach()) if target.bias_key is not None else None
    kind = kind_of_tensor(weight)
    if kind is not None:
        return kind.dequantize(module), bias, weight
    stored = full_tensor(weight.detach())
    return canonical_weight(stored, target.layout), bias, stored


def layer_info(spec: AdapterSpec, target: Target, *, r: int | None = None, alpha: float | None = None) -> LayerInfo:
    """The static per-layer info of ``spec`` on one target; ``r`` / ``alpha`` override the
    spec's for this layer (a peft checkpoint's ``rank_pattern`` / ``alpha_pattern``).

    An ``nn.MultiheadAttention``'s out_proj (layout ``"mha_out"``) gets twice the alpha: peft 0.21
    merges its update twice on every call (the attention's ``merge`` adds it, then calls the
    out_proj's own ``merge``, which adds it again), so peft's checkpoints mean ``W + 2·s·B A``
    there, and the attention's alpha is what they store."""
    alpha = spec.alpha if alpha is None else alpha
    return LayerInfo(
        d_in=target.d_in,
        d_out=target.d_out,
        r=spec.r if r is None else r,
        alpha=2 * alpha if target.layout == "mha_out" else alpha,
        has_bias=target.bias_key is not None,
        options=spec.options,
        kernel=target.shape[2:] if target.layout in CONV_LAYOUTS else (),
        kind=kind_of_layout(target.layout),
    )


def layer_infos(variant: Variant, spec: AdapterSpec, infos: Mapping[str, LayerInfo]) -> dict[str, LayerInfo]:
    """``infos`` (module name -> ``LayerInfo``) with each layer's rank from the variant's
    ``layer_ranks`` (one budget spread over the layers), or unchanged without one."""
    if variant.layer_ranks is None:
        return dict(infos)
    ranks = variant.layer_ranks(spec.r, infos)
    return {module: dataclasses.replace(info, r=int(ranks[module])) for module, info in infos.items()}


def numbered_layers(layers: tuple[AdapterLayer, ...]) -> tuple[AdapterLayer, ...]:
    """``layers`` (one adapter's, in module order) with each info's position among them and the
    adapter's layout set (:meth:`LayerInfo.numbered`), as :func:`lora_func.init_adapter` sets them."""
    infos = LayerInfo.numbered({str(i): layer.info for i, layer in enumerate(layers)})
    return tuple(dataclasses.replace(layer, info=info) for layer, info in zip(layers, infos.values(), strict=True))


def adapter_layer(target: Target, info: LayerInfo, params: TensorDict, buffers: TensorDict, fingerprint: str | None) -> AdapterLayer:
    """The static description of one target's adapter tensors (short name -> tensor)."""
    return AdapterLayer(
        target=target,
        info=info,
        param_shapes=tuple((n, tuple(t.shape)) for n, t in params.items()),
        buffer_shapes=tuple((n, tuple(t.shape)) for n, t in buffers.items()),
        base_fingerprint=fingerprint,
    )


def variant_init(
    variant: Variant,
    spec: AdapterSpec,
    module: nn.Module,
    target: Target,
    info: LayerInfo,
    *,
    generator: torch.Generator,
    calibration: Any = None,
    shared: TensorDict | None = None,
) -> tuple[TensorDict, TensorDict, Tensor]:
    """``variant``'s init on one target of the model: ``(params, buffers, stored weight)``, the
    tensors keyed by short names (``"lora_A"``) as the variant returns them. ``shared``: the
    layer's view of the shared tensors, passed to a ``shared_from_weights`` variant's init. A
    variant's own ``TypeError``/``ValueError`` comes back naming the variant and the module."""
    extra = {"shared": shared} if variant.shared_from_weights else {}
    with torch.no_grad():
        weight, bias, stored = target_weight(module, target)
        if weight.is_meta and (variant.records_base or variant.calibration is not None):
            # On the meta device every adapter is shapes only (LoRA's, DoRA's); one derived from
            # the weight's exact values (a residual, a fingerprint) or from data cannot be.
            _check_weight_values(spec, target, weight)
        try:
            if target.experts is not None:
                params, buffers = _per_expert_init(variant, weight, info, dtype=spec.dtype, generator=generator, calibration=calibration)
            else:
                params, buffers = variant.init(weight, bias, info, dtype=spec.dtype, generator=generator, calibration=calibration, **extra)
        except (TypeError, ValueError) as err:
            _check_weight_values(spec, target, weight)  # a broken base explains it better than the variant
            raise type(err)(f"{spec.variant} cannot adapt {target.module}: {err}") from err  # error: init-layer-failed
        except (RuntimeError, NotImplementedError):  # torch's own (an SVD that fails, a meta tensor's data)
            _check_weight_values(spec, target, weight)
            raise
        if not weight.is_meta:
            bad = sorted(name for name, t in {**params, **buffers}.items() if not bool(torch.isfinite(t).all()))
            if bad:
                _check_weight_values(spec, target, weight)
                raise ValueError(  # error: init-non-finite
                    f"{spec.variant} cannot adapt {target.module}: its init produced non-finite {bad} (NaN or inf) from a "
                    f"finite weight, in dtype {spec.dtype}; build the adapter in a wider dtype (AdapterSpec(dtype=torch.float32)) "
                    f"or leave this module out of targets"
                )
    return params, buffers, stored


def _per_expert_init(
    variant: Variant, weight: Tensor, info: LayerInfo, *, dtype: torch.dtype, generator: torch.Generator, calibration: Any
) -> tuple[TensorDict, TensorDict]:
    """``variant``'s init on each expert's ``(d_out, d_in)`` matrix of ``weight (E, d_out, d_in)``,
    in expert order from one generator, stacked on a leading expert axis."""
    inits = [variant.init(w, None, info, dtype=dtype, generator=generator, calibration=calibration) for w in weight.unbind(0)]
    params = {name: torch.stack([p[name] for p, _ in inits]) for name in inits[0][0]}
    buffers = {name: torch.stack([b[name] for _, b in inits]) for name in inits[0][1]}
    return params, buffers


def _check_weight_values(spec: AdapterSpec, target: Target, weight: Tensor) -> None:
    """Raise the error that names the base as the cause, when it is one: a weight on the meta
    device (no values to read) or holding NaN/inf (an SVD fails, norms come out NaN)."""
    if weight.is_meta:
        raise ValueError(  # error: init-meta-weight
            f"{spec.variant} cannot adapt {target.module}: its init reads the weight's values, and the model is on the "
            f"meta device (shapes only, no data); materialise the model first (from_pretrained, or to_empty() and "
            f"load_state_dict), then call init_adapter"
        )
    finite = torch.isfinite(weight)
    if not bool(finite.all()):
        raise ValueError(  # error: init-non-finite-weight
            f"{spec.variant} cannot adapt {target.module}: its weight holds {int((~finite).sum())} non-finite values "
            f"(NaN or inf), and {spec.variant}'s init reads the weight; fix or reload the model's weights, or leave "
            f"{target.module} out of targets"
        )


def fresh_layer(
    variant: Variant, target: Target, info: LayerInfo, params: TensorDict, buffers: TensorDict, stored: Tensor
) -> tuple[AdapterLayer, TensorDict, TensorDict]:
    """A new adapter on one target from :func:`variant_init`'s ``(params, buffers, stored)``:
    ``(layer, params, buffers)``, the tensors contiguous (so that a save/load round trip
    reproduces the same kernels and bits), params leaf tensors with ``requires_grad=True``, the
    layer with the base's fingerprint for a variant that records its base."""
    with torch.no_grad():
        params = {name: tensor.detach().contiguous().requires_grad_(True) for name, tensor in params.items()}
        buffers = {name: tensor.detach().contiguous() for name, tensor in buffers.items()}
        fingerprint = weight_fingerprint(stored) if variant.records_base else None
    return adapter_layer(target, info, params, buffers, fingerprint), params, buffers


def shared_init(
    variant: Variant,
    spec: AdapterSpec,
    infos: Mapping[str, LayerInfo],
    *,
    device: torch.device,
    generator: torch.Generator,
    weights: Mapping[str, Tensor] | None = None,
) -> tuple[TensorDict, TensorDict, SharedTensors | None]:
    """The tensors an adapter of ``variant`` shares across its layers (``Variant.shared_init``),
    keyed as in the adapter (``"<shared>.<name>"``), params leaf tensors requiring grad, and
    their static description; ``({}, {}, None)`` for a variant without shared tensors.
    ``weights``: every target's base weight (:func:`target_weights`), for a
    ``shared_from_weights`` variant."""
    if variant.shared_init is None:
        return {}, {}, None
    extra: dict[str, Any] = {}
    if variant.shared_from_weights:
        assert weights is not None, "a shared_from_weights variant's shared tensors are built from the weights"
        extra["weights"] = weights
    with torch.no_grad():
        try:
            params, buffers = variant.shared_init(infos, dtype=spec.dtype, device=device, generator=generator, **extra)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{spec.variant} cannot build its shared tensors: {err}") from err  # error: init-shared-failed
        params = {n: t.detach().contiguous().requires_grad_(True) for n, t in params.items()}
        buffers = {n: t.detach().contiguous() for n, t in buffers.items()}
    shared = SharedTensors(
        param_shapes=tuple((n, tuple(t.shape)) for n, t in params.items()),
        buffer_shapes=tuple((n, tuple(t.shape)) for n, t in buffers.items()),
    )
    return dict(zip(shared.param_keys(), params.values(), strict=True)), dict(zip(shared.buffer_keys(), buffers.values(), strict=True)), shared



def target_weights(model: nn.Module, targets: Sequence[Target], spec: AdapterSpec) -> dict[str, Tensor]:
    """Every target's base weight ``(d_out, d_in)`` as its init reads it (:func:`target_weight`),
    by module name in ``targets``' order: what a ``shared_from_weights`` variant's shared tensors
    are built from (whole weights where FSDP2 shards them: a collective, every rank calls it).
    A weight on the meta device or holding NaN/inf is refused naming its module (it would make
    every layer of its group's shared tensors unusable)."""
    modules = dict(model.named_modules())
    out = {}
    with torch.no_grad():
        for t in targets:
            weight = out[t.module] = target_weight(modules[t.owner], t)[0]
            if weight.is_meta or not bool(torch.isfinite(weight).all()):
                _check_weight_values(spec, t, weight)
    return out


def shared_view(shared: Mapping[str, Tensor], groups: Mapping[str, str]) -> TensorDict:
    """One layer's view (``group_view``) of an adapter's shared tensors keyed
    ``"<shared>.<name>"``: what a ``shared_from_weights`` variant's ``init`` gets."""
    return group_view({k.removeprefix(f"{SHARED}."): v for k, v in shared.items() if k.startswith(f"{SHARED}.")}, groups)


def grouped_shared(
    params: TensorDict, buffers: TensorDict, shared: SharedTensors | None, grouped_params: TensorDict, grouped_buffers: TensorDict
) -> tuple[TensorDict, TensorDict, SharedTensors]:
    """``params`` / ``buffers`` (an adapter's flat tensors, with ``shared`` their shared ones'
    description) with the grouped shared tensors (``Variant.groups``: ``"<name>@<group key>"`` ->
    tensor) added under ``"<shared>.<name>@<group key>"``: params leaf tensors requiring grad."""
    with torch.no_grad():
        grouped_params = {n: t.detach().contiguous().requires_grad_(True) for n, t in grouped_params.items()}
        grouped_buffers = {n: t.detach().contiguous() for n, t in grouped_buffers.items()}
    old = shared if shared is not None else SharedTensors(param_shapes=(), buffer_shapes=())
    out = SharedTensors(
        param_shapes=old.param_shapes + tuple((n, tuple(t.shape)) for n, t in grouped_params.items()),
        buffer_shapes=old.buffer_shapes + tuple((n, tuple(t.shape)) for n, t in grouped_buffers.items()),
    )
    params = params | {f"{SHARED}.{n}": t for n, t in grouped_params.items()}
    buffers = buffers | {f"{SHARED}.{n}": t for n, t in grouped_buffers.items()}
    return params, buffers, out
