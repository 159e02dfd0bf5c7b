"""Building an adapter: :func:`init_adapter` (what reads the model is in :mod:`lora_func._model`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lora_func._model import fresh_layer, grouped_shared, layer_info, layer_infos, shared_init, shared_view, target_weights, variant_init
from lora_func.adapter import Adapter
from lora_func.calibration import layer_gradient_batches, layer_input_batches
from lora_func.checks import check_model
from lora_func.quantized import kind_of_tensor
from lora_func.spec import AdapterSpec
from lora_func.targeting import find_targets
from lora_func.variants import LayerInfo, get_variant

__all__ = ["init_adapter"]


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
    if variant.calibration is not None and calibration is not None and (
        isinstance(calibration, (str, bytes, Mapping, Tensor)) or not isinstance(calibration, Iterable)
    ):
        # Before the generator draws its seed: a refused call leaves the global RNG alone.
        raise TypeError(  # error: init-calibration-type
            f"init_adapter: calibration must be an iterable of batches (dicts with 'input_ids'), got "
            f"{type(calibration).__name__}; e.g. calibration=[{{'input_ids': ids}}] or a DataLoader"
        )
    targets = find_targets(model, spec)
    if "rank_within_layer" in variant.traits:
        too_big = [f"{t.module} (d_in={t.d_in}, d_out={t.d_out})" for t in targets if spec.r > min(t.d_in, t.d_out)]
        if too_big:
            raise ValueError(  # error: init-rank-too-big
                f"r={spec.r} exceeds min(d_in, d_out) of target(s) {sorted(too_big)}: {spec.variant} takes r directions of each "
                f"target's weight; lower r or leave them out"
            )
    modules = dict(model.named_modules())
    # The target weights (an expert parameter is its module's attribute of that name).
    weights = {t.module: getattr(modules[t.owner], t.weight_key.rpartition(".")[2]) for t in targets}
    quantized = {t.module: kind for t in targets if (kind := kind_of_tensor(weights[t.module])) is not None}
    # Checked once here for every variant: integer weights of no registered quantized kind.
    non_float = sorted(
        f"{t.weight_key} is {weights[t.module].dtype}"
        for t in targets
        if t.module not in quantized and not weights[t.module].is_floating_point()
    )
    if non_float:
        raise TypeError(  # error: init-non-float
            f"{spec.variant} needs a floating-point base weight, but {', '.join(non_float)}; dequantize the "
            f"layer to float32/bfloat16/float16 first, or leave it out of the targets"
        )
    if quantized and variant.replaces_weight:
        raise ValueError(  # error: quantized-replaces-weight
            f"{spec.variant} replaces the base weight by a full-precision tensor of its own (PiSSA: the residual; "
            f"FRoD: U (S + diag λ) Vᵀ; LN tuning: the layer's copy), and targets "
            f"{sorted(quantized)[:4]}{' ...' if len(quantized) > 4 else ''} are quantized (the quantized weight would go "
            f"unused and the replacement would take full-precision memory): build the adapter on the float model "
            f"(for PiSSA, quantize its residual: peft's practice with QLoRA), or pick a variant that keeps the base"
        )
    generator = _default_generator() if generator is None else generator
    infos = layer_infos(variant, spec, {t.module: layer_info(spec, t) for t in targets})
    payloads: dict[str, Any] = dict.fromkeys(infos, calibration)
    if variant.calibration is not None:
        if calibration is None:
            raise ValueError(  # error: init-needs-calibration
                f"variant {spec.variant!r} is data-driven: pass calibration=<iterable of batches with "
                f"'input_ids' and optionally 'attention_mask' and 'labels'>"
            )
        source = layer_gradient_batches if variant.calibration.on == "gradients" else layer_input_batches
        fitted = variant.calibration.fit(source(model, targets, calibration), infos, generator=generator)
        targets = [t for t in targets if t.module in fitted]
        infos = {m: fitted[m][0] for m in infos if m in fitted}
        payloads = {m: fitted[m][1] for m in infos}
    # Each layer's position among the targets and the adapter's layout (LayerInfo.numbered).
    infos = LayerInfo.numbered(infos)
    # Tensors every layer reads (Variant.shared_init), drawn before the layers' own.
    device = weights[targets[0].module].device if targets else torch.device("cpu")
    # (a shared_from_weights variant's are built from every target's base weight)
    params, buffers, shared = shared_init(
        variant, spec, infos, device=device, generator=generator, weights=target_weights(model, targets, spec) if variant.shared_from_weights else None
    )
    groups = variant.layer_groups(spec.targets, infos)
    grouped: tuple[dict[str, Tensor], dict[str, Tensor]] = ({}, {})
    layers = []
    for target in targets:
        # One target at a time: a sharded target's whole weight is gathered for its init only (a
        # collective: every rank runs this loop in the same order).
        info = infos[target.module]
        view = shared_view(params | buffers, groups[target.module]) if variant.shared_from_weights else None
        init = variant_init(
            variant, spec, modules[target.owner], target, info, generator=generator, calibration=payloads[target.module], shared=view
        )
        # Tensors shared within a group (Variant.groups): every layer's init makes one, as
        # peft's layers do before peft ties them; the group's first layer's is kept.
        init_params, init_buffers = (
            {n: t for n, t in found.items() if n not in groups[target.module]} for found in init[:2]
        )
        for found, kept in zip(init[:2], grouped, strict=True):
            for name, key in groups[target.module].items():
                if name in found and not variant.shared_from_weights:  # (those are shared_init's)
                    kept.setdefault(f"{name}@{key}", found[name])
        layer, layer_params, layer_buffers = fresh_layer(variant, target, info, init_params, init_buffers, init[2])
        params.update({f"{target.module}.{name}": tensor for name, tensor in layer_params.items()})
        buffers.update({f"{target.module}.{name}": tensor for name, tensor in layer_buffers.items()})
        layers.append(layer)
    if grouped[0] or grouped[1]:
        params, buffers, shared = grouped_shared(params, buffers, shared, *grouped)
    return Adapter(params, buffers, spec, layers, shared=shared)
