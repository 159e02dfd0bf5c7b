"""AdaLoRA (Zhang et al. 2023, arXiv 2303.10512): LoRA in an SVD-like form ``P Λ Q`` whose rank
budget an importance schedule reallocates during training.

Trainable ``lora_A (r, d_in)`` (Q, right singular vectors), ``lora_E (r, 1)`` (Λ, the singular
values, a column as peft stores it) and ``lora_B (d_out, r)`` (P, left singular vectors);
``W_eff = W + s · B (E ⊙ A)``, ``y = x Wᵀ + b + s · (x (E ⊙ A)ᵀ) Bᵀ``, bias unchanged, with
peft's scale ``s = alpha / (init_r + 1e-5)`` (peft's ``scaling / (ranknum + 1e-5)``; ``r`` is
``init_r``). Init as peft: ``E = 0``, ``A, B ~ N(0, 0.02²)``.

The rest of AdaLoRA is functions of the adapter, not state in it (:mod:`lora_func.rank_budget`):
the orthogonality penalty (peft's ``orth_reg_weight`` term) and the budget schedule, whose mask
zeroes entries of ``E``: a masked triplet stays in the tensors with ``E = 0``, as in peft during
training. The schedule's settings are options of the spec (``target_r``, ``tinit``, ``tfinal``,
``deltaT``, ``beta1``, ``beta2``, ``orth_reg_weight``, ``total_step``), so a saved adapter carries
them and ``save_peft`` writes peft's ``AdaLoraConfig``.

peft's format: ``AdaLoraConfig`` with ``init_r = r`` (peft ignores its ``r``; the checkpoint's rank
is ``init_r``, peft's defaults ``r=8``, ``init_r=12`` load). Once the schedule has masked, peft saves
a ``rank_pattern`` (per layer, one boolean per triplet) and each layer's tensors cut to its kept
triplets; ``load_peft`` pads them back to ``init_r`` with zero triplets (zero ``A`` row, ``E``, ``B``
column: no output and exactly zero gradient, as the triplets peft dropped; the kept ones in their
order, which the function does not depend on), so the scale stays peft's ``alpha / (init_r + 1e-5)``
(peft keeps ``ranknum = init_r`` when it resizes). ``save_peft`` writes the ``init_r`` tensors
without a ``rank_pattern``, which peft loads to the same function.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._kernels import base_plus_low_rank, lowrank_input
from lora_func.variants._conv import peft_conv_layers
from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftLayer, PeftMethod, Slot, TensorDict, Variant, real, whole
from lora_func.variants._options import dropout_option, mapped, nullable, one_of
from lora_func.variants.lora import PEFT_UNSUPPORTED_FIELDS

# The schedule's settings (peft's AdaLoraConfig fields and defaults), held as spec options.
SCHEDULE = {
    "target_r": Option(8, whole(0), "target_r", nullable(8)),
    "tinit": Option(0, whole(0), "tinit", nullable(0)),
    "tfinal": Option(0, whole(0), "tfinal", nullable(0)),
    "deltaT": Option(1, whole(1), "deltaT", nullable(1)),
    "beta1": Option(0.85, real(0, 1, closed="()"), "beta1", nullable(0.85)),
    "beta2": Option(0.85, real(0, 1, closed="()"), "beta2", nullable(0.85)),
    "orth_reg_weight": Option(0.5, real(0), "orth_reg_weight", nullable(0.5)),
    "total_step": Option(1, whole(1), "total_step", nullable(1)),
}


def scale(info: LayerInfo) -> float | Tensor:
    """peft's ``scaling / (ranknum + 1e-5)``: ``alpha / (r + 1e-5)``, ``r`` the initial rank (a
    member's own in a rank-padded stack)."""
    return info.alpha / (info.r + 1e-5)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, d_in, d_out = info.r, info.d_in, info.d_out
    if dict(info.options).get("init", "default") == "random":
        # peft's init_lora_weights=False (debugging: B A E ≠ 0 at init): its update_layer's draws
        # kept, A, E, B, then the ranknum draw it overwrites
        lora_a = torch.randn((r, d_in), generator=generator, dtype=torch.float32)
        lora_e = torch.randn((r, 1), generator=generator, dtype=torch.float32)
        lora_b = torch.randn((d_out, r), generator=generator, dtype=torch.float32)
        torch.randn(1, generator=generator)
        params = {"lora_A": lora_a, "lora_E": lora_e, "lora_B": lora_b}
        return {k: v.to(weight.device, dtype) for k, v in params.items()}, {}
    lora_a = 0.02 * torch.randn((r, d_in), generator=generator, dtype=torch.float32)
    lora_b = 0.02 * torch.randn((d_out, r), generator=generator, dtype=torch.float32)
    lora_e = torch.zeros((r, 1), dtype=torch.float32)
    params = {"lora_A": lora_a, "lora_E": lora_e, "lora_B": lora_b}
    return {k: v.to(weight.device, dtype) for k, v in params.items()}, {}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + scale(info) * (params["lora_B"] @ (params["lora_A"] * params["lora_E"])), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a = params["lora_A"] * params["lora_E"]
    h = (lowrank_input(x, base, info).to(a.dtype) @ a.T) * scale(info)
    return base_plus_low_rank(base, x, h, params["lora_B"])


def check_options(options: Mapping[str, Any]) -> None:
    if options["tinit"] >= options["total_step"] - options["tfinal"]:
        raise ValueError(  # error: adalora-options
            f"adalora options tinit={options['tinit']} >= total_step - tfinal = {options['total_step'] - options['tfinal']}: the "
            f"schedule has no budget phase; lower tinit or tfinal or raise total_step (peft's AdaLoraConfig)"
        )


def _pad_to_init_r(found: TensorDict, options: Mapping[str, Any]) -> TensorDict:
    """A layer that peft cut to its kept triplets (``rank_pattern``) back at ``init_r``: zero
    triplets after the kept ones (no output, exactly zero gradient)."""
    init_r = int(options["init_r"])
    missing = init_r - found["lora_A"].shape[0] if "lora_A" in found else 0
    if missing <= 0:
        return dict(found)
    pads = {"lora_A": (0, 0, 0, missing), "lora_E": (0, 0, 0, missing), "lora_B": (0, missing)}
    return {name: torch.nn.functional.pad(t, pads[name]) if name in pads else t for name, t in found.items()}


def _export(params: TensorDict, buffers: TensorDict, weight: Tensor | None, info: LayerInfo) -> PeftLayer:
    """The layer as it is, after checking that the config's ``init_r`` (an option) is its rank."""
    if info.option("init_r") != info.r:
        raise ValueError(  # error: adalora-r-init-r
            f"save_peft: adalora r={info.r} and init_r={info.option('init_r')} differ; peft's AdaLoraConfig stores the "
            f"initial rank as init_r: build the adapter with the same value for both (AdapterSpec('adalora', r=12, init_r=12))"
        )
    return PeftLayer(lambda: dict(params), r=info.r, alpha=info.alpha)


VARIANT = Variant(
    name="adalora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "lora_A": Slot(lambda i: (i.r, i.d_in), rank_axes=(0,), peft="lora_A"),
        "lora_E": Slot(lambda i: (i.r, 1), rank_axes=(0,), peft="lora_E"),
        "lora_B": Slot(lambda i: (i.d_out, i.r), rank_axes=(1,), peft="lora_B"),
    },
    # init_r is the tensors' rank: the writer stores it over this option (PeftMethod.rank), checked
    # equal in _export.
    options={
        "init_r": Option(8, whole(1), "init_r", nullable(8)),
        "dropout": dropout_option("lora_dropout"),
        # peft's init_lora_weights: True (its default) or False (its debugging init, all three random)
        "init": Option("default", one_of("default", "random"), "init_lora_weights", mapped({"default": True, "random": False})),
    } | SCHEDULE,
    check=check_options,
    default_alpha=8.0,
    kind_forms={"linear": None, "conv1d": None, "conv": None},
)
# peft: AdaLoraConfig; its rank is init_r (its r is ignored) and its rank_pattern holds booleans
# per triplet: every layer passes through _pad_to_init_r (a cut layer holds the same keys).
PEFT = PeftFormat(
    PeftMethod("ADALORA", refused=(*PEFT_UNSUPPORTED_FIELDS, "use_dora", "loftq_config"), rank=("init_r", None), alpha="lora_alpha"),
    # peft's AdaLoRA adapts nn.Conv2d, its tensors in the (out, in·K) view as here
    export=peft_conv_layers("ADALORA", (2,), export=_export),
    imported={"lora_A": "lora_A", "lora_E": "lora_E", "lora_B": "lora_B"},
    convert_in=_pad_to_init_r,
)
