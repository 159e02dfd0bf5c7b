"""What LoHa and LoKr share (HF peft's ``tuners/lycoris_utils.py`` and their layers): the
LyCORIS options (with their peft config fields), the two training-only dropouts, and the conv
kernels' CP (Tucker) form of ``use_effective_conv2d``.

Not a variant (the name starts with ``_``). Shapes: ``d_out`` is the layer's output size; on a
conv target (``info.kernel`` non-empty) ``d_in = c_in · K`` with ``K = prod(kernel)``, the
canonical view's columns ordered ``(channel, kernel position)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants._contract import BaseLayer, LayerInfo, TensorDict
from lora_func.variants._options import FLAG, Option, real
from lora_func.variants._peft import PeftLayer, PeftMethod

# The options both variants take, with peft's defaults and names.
OPTIONS = {
    "rank_dropout": Option(0.0, real(0, 1, why="the probability of dropping an output row of the update in a training step"), "rank_dropout"),
    "module_dropout": Option(0.0, real(0, 1, why="the probability of dropping the whole update in a training step"), "module_dropout"),
    "use_effective_conv2d": Option(False, FLAG, "use_effective_conv2d"),
}


def method(peft_type: str) -> PeftMethod:
    """peft's LoHa or LoKr: per-layer ranks and alphas (``alpha``), no bias field."""
    return PeftMethod(peft_type, {}, rank=("r", "rank_pattern"), alpha="alpha")


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


# ------------------------------------------------------------------------------- conv kernels


def uses_cp(info: LayerInfo) -> bool:
    """peft's effective-conv form: ``use_effective_conv2d`` on a conv kernel of more than one
    position (peft turns it off for 1x1 and size-1 kernels, and it means nothing on Linear)."""
    return bool(info.option("use_effective_conv2d")) and math.prod(info.kernel) > 1


def core_shape(r: int, kernel: tuple[int, ...]) -> tuple[int, ...]:
    """The CP core ``(r, r, *kernel)``; ``(r, r, k, 1)`` for a Conv1d's ``(k,)``, as peft stores it."""
    return (r, r, *kernel, 1) if len(kernel) == 1 else (r, r, *kernel)


def cp_rebuild(core: Tensor, w_a: Tensor, w_b: Tensor) -> Tensor:
    """``(d, c·K)`` canonical kernel of the CP form: ``Σ_ij core[i, j, κ] w_a[d, i] w_b[j, c]`` at
    column ``c·K + κ``; ``core (r, r, *kernel)``, ``w_a (d, r)``, ``w_b (r, c)`` (peft's
    ``make_weight_cp`` with its ``(r, d)`` factor transposed)."""
    return torch.einsum("ijk,di,jc->dck", core.flatten(2), w_a, w_b).flatten(1)


def check_conv(variant: str, info: LayerInfo) -> None:
    """Refuse the training-only dropouts on a conv target: a conv applies through its merged
    kernel, where no dropout acts."""
    if info.kernel and (info.option("rank_dropout") or info.option("module_dropout")):
        raise ValueError(  # error: lycoris-conv-dropout
            f"{variant} on a conv layer (kernel {info.kernel}) applies through its merged kernel, where "
            f"rank_dropout={info.option('rank_dropout')} and module_dropout={info.option('module_dropout')} cannot act; "
            f"set both to 0 or leave the conv layers out of the targets"
        )


def cp_export(variant: str, factors: tuple[str, ...], core: str) -> Any:
    """``PeftFormat.export`` of a variant with a CP form: a CP layer's ``factors`` (stored ``(d, r)``
    here, the rank axis last as in the other forms) transposed to peft's ``(r, d)``. A 3-D kernel
    is refused: peft's LyCORIS tuners adapt ``nn.Conv1d`` / ``nn.Conv2d`` only."""

    def export(params: TensorDict, buffers: TensorDict, weight: Tensor | None, info: LayerInfo) -> PeftLayer:
        if len(info.kernel) > 2:
            raise ValueError(  # error: save-peft-lycoris-conv3d
                f"save_peft: peft's {variant} adapts nn.Conv1d and nn.Conv2d layers only, not a kernel of size "
                f"{info.kernel} (nn.Conv3d); save the adapter with lora_func.save instead"
            )
        cp = core in params
        return PeftLayer(
            lambda: {n: t.transpose(0, 1).contiguous() if cp and n in factors else t for n, t in params.items()}, r=info.r, alpha=info.alpha
        )

    return export


def cp_convert_in(factors: tuple[str, ...], core: str) -> Any:
    """``PeftFormat.convert_in``: a peft CP layer's ``(r, d)`` factors to lora_func's ``(d, r)``
    (the loader calls it on the layers that hold the core, the entry's ``imported`` name)."""

    def convert_in(found: TensorDict, options: Mapping[str, Any]) -> TensorDict:
        return {n: t.transpose(0, 1) if core in found and n in factors and t.dim() == 2 else t for n, t in found.items()}

    return convert_in
