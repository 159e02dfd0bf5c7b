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

from lora_func.variants._kernels import base_plus_low_rank, check_dropout, lowrank_input
from lora_func.variants import BaseLayer, LayerInfo, PeftFormat, PeftLayer, PeftMethod, TensorDict, Variant, is_finite_number
from lora_func.variants.lora import PEFT_UNSUPPORTED_FIELDS

# The schedule's settings (peft's AdaLoraConfig fields and defaults), held as spec options.
SCHEDULE = {"target_r": 8, "tinit": 0, "tfinal": 0, "deltaT": 1, "beta1": 0.85, "beta2": 0.85, "orth_reg_weight": 0.5, "total_step": 1}


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
    check_dropout("adalora", options)
    ints = ("init_r", "target_r", "tinit", "tfinal", "deltaT", "total_step")
    bad = [f"{k}={options[k]!r}" for k in ints if isinstance(options[k], bool) or not isinstance(options[k], int) or options[k] < 0]
    bad += [f"{k}={options[k]!r}" for k in ("beta1", "beta2") if not (is_finite_number(options[k]) and 0 < options[k] < 1)]
    if not (is_finite_number(options["orth_reg_weight"]) and options["orth_reg_weight"] >= 0):
        bad.append(f"orth_reg_weight={options['orth_reg_weight']!r}")
    bad += [f"{k}={options[k]!r}" for k in ("init_r", "deltaT", "total_step") if not bad and options[k] == 0]
    if not bad and options["tinit"] >= options["total_step"] - options["tfinal"]:
        bad.append(f"tinit={options['tinit']} >= total_step - tfinal = {options['total_step'] - options['tfinal']} (no budget phase)")
    if bad:
        raise ValueError(  # error: adalora-options
            f"adalora options {bad} are invalid: target_r, tinit, tfinal are ints >= 0, init_r, deltaT and total_step ints >= 1 "
            f"with tinit < total_step - tfinal, beta1/beta2 in (0, 1), orth_reg_weight >= 0 (peft's AdaLoraConfig)"
        )


# --------------------------------------------------------------------- peft's AdaLoraConfig

def _is_rank_pattern(value: Any) -> bool:
    """peft's AdaLoRA ``rank_pattern``: ``None`` or ``{name: [bool per triplet]}``."""
    return value is None or (
        isinstance(value, dict) and all(isinstance(v, list) and all(isinstance(b, bool) for b in v) for v in value.values())
    )


PEFT_METHOD = PeftMethod(
    "ADALORA",
    {"bias": "none"},
    (*PEFT_UNSUPPORTED_FIELDS, "use_dora", "loftq_config"),
    rank_of=("lora_A", 0),
    alpha=True,
    checks={
        "lora_dropout": lambda v: v is None or (is_finite_number(v) and 0 <= v < 1),
        "init_r": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "rank_pattern": _is_rank_pattern,
        **{k: (lambda v: v is None or is_finite_number(v)) for k in SCHEDULE},
    },
    # peft's rank is init_r (its r is ignored); its rank_pattern holds booleans, read by _pad_to_init_r
    rank_fields=("init_r", None),
)


def _peft_config(options: Mapping[str, Any]) -> dict[str, Any]:
    # init_r is the tensors' rank: the writer stores it (rank_fields) over this option, checked equal in _export.
    return {"lora_dropout": float(options.get("dropout", 0.0)), "init_r": int(options["init_r"])} | {k: options[k] for k in SCHEDULE}


def _peft_reads(config: Mapping[str, Any], module: str) -> dict[str, Any] | None:
    read = {k: config.get(k, default) for k, default in SCHEDULE.items()}
    read["total_step"] = read["total_step"] or 1  # peft requires it > 0 when training; None in some saved configs
    return read | {"dropout": float(config.get("lora_dropout") or 0.0), "init_r": int(config.get("init_r", 12))}


def _pad_to_init_r(found: TensorDict, config: Mapping[str, Any]) -> TensorDict:
    """A layer that peft cut to its kept triplets (``rank_pattern``) back at ``init_r``: zero
    triplets after the kept ones (no output, exactly zero gradient)."""
    init_r = int(config.get("init_r", 12))
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
    options={"init_r": 8, "dropout": 0.0} | SCHEDULE,
    default_alpha=8.0,
    rank_axes={"lora_A": 0, "lora_E": 0, "lora_B": 1},
    check_options=check_options,
    peft=PeftFormat(
        PEFT_METHOD,
        {"lora_A": "lora_A", "lora_E": "lora_E", "lora_B": "lora_B"},
        lambda r, d_in, d_out: {"lora_A": (r, d_in), "lora_E": (r, 1), "lora_B": (d_out, r)},
        _peft_config,
        _peft_reads,
        export=_export,
        # every layer passes through _pad_to_init_r (the same names: a cut layer holds the same keys)
        imported={"lora_A": "lora_A", "lora_E": "lora_E", "lora_B": "lora_B"},
        convert_in=_pad_to_init_r,
    ),
)
