"""What LoHa and LoKr share (HF peft's ``tuners/lycoris_utils.py`` and their layers): the
LyCORIS options, their checks and peft config fields, and the two training-only dropouts.

Not a variant (the name starts with ``_``). Shapes: ``d_out`` is the layer's output size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._contract import BaseLayer, LayerInfo, is_finite_number

# The options both variants take, with peft's defaults.
OPTIONS: dict[str, Any] = {"rank_dropout": 0.0, "module_dropout": 0.0, "use_effective_conv2d": False}


def check_options(variant: str, options: Mapping[str, Any], inits: tuple[str, ...]) -> None:
    """The dropout probabilities in ``[0, 1)`` and ``init`` one of ``inits``."""
    for name in ("rank_dropout", "module_dropout"):
        p = options[name]
        if not 0.0 <= p < 1.0:
            raise ValueError(  # error: lycoris-dropout
                f"{variant} option {name}={p!r} must be in [0, 1) (peft's {name}: the probability of dropping "
                f"{'an output row of the update' if name == 'rank_dropout' else 'the whole update'} in a training step)"
            )
    if options["init"] not in inits:
        raise ValueError(f"{variant} option init={options['init']!r} is not one of {list(inits)}")  # error: lycoris-init


def peft_checks() -> dict[str, Any]:
    """Validity of the LyCORIS config fields the entries read."""
    return {
        "rank_dropout": lambda v: is_finite_number(v) and 0 <= v < 1,
        "module_dropout": lambda v: is_finite_number(v) and 0 <= v < 1,
        "use_effective_conv2d": lambda v: isinstance(v, bool),
    }


def peft_config(options: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields both write."""
    return {
        "rank_dropout": float(options["rank_dropout"]),
        "module_dropout": float(options["module_dropout"]),
        "use_effective_conv2d": bool(options["use_effective_conv2d"]),
    }


def peft_reads(config: Mapping[str, Any]) -> dict[str, Any]:
    """The options both read."""
    return {
        "rank_dropout": float(config.get("rank_dropout") or 0.0),
        "module_dropout": float(config.get("module_dropout") or 0.0),
        "use_effective_conv2d": bool(config.get("use_effective_conv2d", False)),
    }


def output_keep(
    base: BaseLayer, info: LayerInfo, *, dtype: torch.dtype, device: torch.device, rescale: bool
) -> Tensor | None:
    """In a training step with a dropout set, the ``(d_out,)`` factor the update's output rows
    are multiplied by; ``None`` otherwise (inference, or both probabilities 0).

    peft's draws, in peft's order, from the global CPU generator (under ``vmap`` they follow
    ``randomness=``): ``torch.rand(1) > module_dropout`` keeps the whole update (no rescale),
    then ``torch.rand(d_out) > rank_dropout`` keeps each
    output row (drawn on the CPU, as peft, then moved to ``device``), divided by the kept fraction where ``rescale`` (LoHa always; LoKr with
    ``rank_dropout_scale``). The mask is in ``dtype`` as peft builds it (the adapter dtype for
    LoHa, fp32 for LoKr). Every row dropped leaves the update zero (peft divides by 0: NaN).

    peft draws the row mask only when the update is kept; here it is drawn whatever the first
    draw says (no branch on a value: the function stays pure under ``vmap`` and
    ``torch.compile``). So a seeded step equals peft's with either dropout alone, and with both
    until a layer's update is dropped; the distribution is peft's in every case.
    """
    options = dict(info.options)
    module_p, rank_p = options["module_dropout"], options["rank_dropout"]
    if not getattr(base, "training", False) or not (module_p or rank_p):
        return None
    keep = (torch.rand(1) > module_p).to(dtype)
    if rank_p:
        rows = (torch.rand(info.d_out) > rank_p).to(dtype)
        if rescale:
            rows = rows / rows.mean().clamp(min=1.0 / info.d_out)
        keep = keep * rows
    return keep.to(device)
