"""GLoRA, generalized LoRA (Chavan et al. 2023, arXiv 2306.07967), following HF peft 0.21's
``tuners/glora/layer.py`` (``GloraLinear``).

Five trained paths, each one of ``lora`` / ``vector`` / ``constant`` / ``none`` (options
``config_A_B``, ``config_C``, ``config_D_E``, peft's names):

    W_eff = W + W ⊙ A + B,   b_eff = b + b ⊙ D + E + W C

``lora``: ``A = Xd Xu`` with ``Xd (d_out, r)``, ``Xu (r, d_in)`` (``C = Xd Xu`` with ``Xd (d_in,
r)``, ``Xu (r, 1)``); ``vector``: a column ``(d_out, 1)`` broadcast over the inputs (``C``: ``(d_in,
1)``; ``D``, ``E``: ``(d_out,)``); ``constant``: one number ``(1,)``; ``none``: zero, no tensor.
``C``, ``D`` and ``E`` exist only on a layer with a bias (peft's); ``C`` takes no ``constant``,
``D``/``E`` no ``lora``. No scale: ``alpha`` is not used.

The activation form adds ``x (W ⊙ A + B)ᵀ + (b ⊙ D + E + W C)`` to the base output: ``W ⊙ A``
is a Hadamard product with the frozen weight, so the update is a dense ``(d_out, d_in)`` matrix
(as peft's, which builds ``W_eff`` and runs the layer twice); the weight form returns ``W_eff``.

Init (``init="zero"``, peft's ``init_weights=True``): every ``Xu ~ kaiming_uniform(a=√5)``, every
``Xd``, vector and constant zero (no change at init). ``init="random"`` (``init_weights=False``):
``Xd`` and the vectors kaiming-uniform too, constants ``N(0, 0.02²)``. Drawn from the generator
in peft's order (per layer: A's ``Xu``, ``Xd``, then B, C, D, E), so a generator seeded as peft's
global RNG gives peft's numbers.

peft stores ``glora_A.Xd`` / ``.Xu`` / ``.X``, ... and, for a ``none`` path (or ``C``, ``D``, ``E`` on
a layer without a bias), its zero buffer ``glora_<P>.zeros`` (``W``-sized for ``A``/``B``):
``save_peft`` writes them as peft does, ``load_peft`` reads and drops them.

Differences from peft: GPT-2 ``Conv1D`` is supported (peft's GLoRA takes ``nn.Linear`` only, so
``save_peft`` refuses it there); peft's ``bias="all"|"glora_only"`` is refused on load, as for
every variant.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftLayer, PeftMethod, Slot, TensorDict, Variant, mapped, one_of
from lora_func.variants._kernels import half_product_applies, kaiming_uniform

INITS = ("zero", "random")
PATHS = "ABCDE"


def _forms(info: LayerInfo) -> dict[str, str]:
    """Each path's form on this layer: ``{"A": "lora", ..., "E": "none"}`` (C, D, E only with a bias)."""
    a_b, c, d_e = info.option("config_A_B"), info.option("config_C"), info.option("config_D_E")
    if not info.has_bias:
        c = d_e = "none"
    return {"A": a_b, "B": a_b, "C": c, "D": d_e, "E": d_e}


def _lora_shapes(path: str, info: LayerInfo) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(Xd, Xu)`` shapes of a ``lora`` path: A/B ``(d_out, r), (r, d_in)``, C ``(d_in, r), (r, 1)``."""
    rows, cols = (info.d_in, 1) if path == "C" else (info.d_out, info.d_in)
    return (rows, info.r), (info.r, cols)


def _vector_shape(path: str, info: LayerInfo) -> tuple[int, ...]:
    return {"A": (info.d_out, 1), "B": (info.d_out, 1), "C": (info.d_in, 1)}.get(path, (info.d_out,))


def _slot_shape(path: str, part: str, info: LayerInfo) -> tuple[int, ...] | None:
    form = _forms(info)[path]
    if part in ("Xd", "Xu"):
        return _lora_shapes(path, info)[part == "Xu"] if form == "lora" else None
    return {"vector": _vector_shape(path, info), "constant": (1,)}.get(form)


def _slot(path: str, part: str) -> Slot:
    rank_axes = {"Xd": (1,), "Xu": (0,)}.get(part, ())
    return Slot(lambda i: _slot_shape(path, part, i), rank_axes=rank_axes, peft=f"glora_{path}.{part}")


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    random = info.option("init") == "random"
    params: TensorDict = {}
    for path, form in _forms(info).items():
        if form == "lora":
            down, up = _lora_shapes(path, info)
            params[f"glora_{path}_Xu"] = kaiming_uniform(up, a=math.sqrt(5), generator=generator)
            params[f"glora_{path}_Xd"] = kaiming_uniform(down, a=math.sqrt(5), generator=generator) if random else torch.zeros(down)
        elif form == "vector":
            shape = _vector_shape(path, info)
            # peft draws a 1-D vector as a (1, n) row (fan_in n), a column (n, 1) as it is (fan_in 1)
            draw = (1, shape[0]) if len(shape) == 1 else shape
            params[f"glora_{path}_X"] = kaiming_uniform(draw, a=math.sqrt(5), generator=generator).reshape(shape) if random else torch.zeros(shape)
        elif form == "constant":
            # nn.init.normal_ as peft (a scaled randn rounds differently)
            params[f"glora_{path}_X"] = torch.nn.init.normal_(torch.empty(1), 0.0, 0.02, generator=generator) if random else torch.zeros(1)
    return {k: v.to(weight.device, dtype) for k, v in params.items()}, {}


def _path(params: TensorDict, path: str) -> Tensor | None:
    """The path's value: ``Xd Xu``, a vector, a ``(1,)`` constant (all broadcast), or ``None``."""
    if f"glora_{path}_Xd" in params:
        return params[f"glora_{path}_Xd"] @ params[f"glora_{path}_Xu"]
    return params.get(f"glora_{path}_X")


def weight_update(params: TensorDict, weight: Tensor) -> Tensor | None:
    """``W ⊙ A + B`` ``(d_out, d_in)`` (``None`` with ``config_A_B="none"``), in the wider of the
    weight's and the adapter's dtypes."""
    a, b = _path(params, "A"), _path(params, "B")
    if a is None or b is None:
        return None
    return weight * a + b


def bias_update(params: TensorDict, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """``b ⊙ D + E + W C`` ``(d_out,)`` (``None`` without a bias or without any of the three)."""
    if bias is None:
        return None
    c, d, e = (_path(params, p) for p in "CDE")
    wc = None
    if c is not None:
        wide = torch.promote_types(weight.dtype, c.dtype)  # both operands: an fp64 base under an fp32 adapter too
        wc = (weight.to(wide) @ c.to(wide)).squeeze(-1)
    parts = [t for t in (None if d is None else bias * d, e, wc) if t is not None]
    if not parts:
        return None
    out = parts[0]
    for t in parts[1:]:
        out = out + t
    return out


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    delta_w, delta_b = weight_update(params, weight), bias_update(params, weight, bias)
    return weight if delta_w is None else weight + delta_w, bias if delta_b is None or bias is None else bias + delta_b


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    y = base(x)
    delta_w = weight_update(params, base.weight)
    delta_b = bias_update(params, base.weight, base.bias)
    if delta_w is not None and half_product_applies(base, x, delta_w):
        # bf16 base: the (n, ·) product on bf16 operands (fp32 accumulation), as peft's bf16 W_eff
        # and LoRA's bf16 path; the (d_out, d_in) update itself is computed in the adapter dtype
        out = y + x @ delta_w.to(x.dtype).transpose(-1, -2)
        return out if delta_b is None else out + delta_b.to(out.dtype)
    out = y
    if delta_w is not None:
        # y + x ΔWᵀ in the wider dtype by promotion (no upcast copy of y), cast back below
        out = out + x.to(delta_w.dtype) @ delta_w.transpose(-1, -2)
    if delta_b is not None:
        out = out + delta_b
    return out.to(y.dtype)


def _peft_zeros(info: LayerInfo) -> dict[str, tuple[int, ...]]:
    """The zero buffers peft writes for this layer's ``none`` paths: name -> shape."""
    shapes = {"A": (info.d_out, info.d_in), "B": (info.d_out, info.d_in), "C": (info.d_in, 1), "D": (info.d_out,), "E": (info.d_out,)}
    return {f"glora_{p}_zeros": shapes[p] for p, form in _forms(info).items() if form == "none"}


def _export(params: TensorDict, buffers: TensorDict, weight: Tensor | None, info: LayerInfo) -> PeftLayer:
    """The layer as peft writes it: its tensors and the zero buffer of each ``none`` path."""

    def tensors() -> TensorDict:
        like = next(iter(params.values()), torch.empty(0))
        return dict(params) | {name: torch.zeros(shape, dtype=like.dtype, device=like.device) for name, shape in _peft_zeros(info).items()}

    return PeftLayer(tensors, r=info.r)


def _drop_zeros(tensors: TensorDict, options: Mapping[str, Any]) -> TensorDict:
    """A checkpoint's layer without peft's zero buffers (its ``none`` paths, which add nothing)."""
    return {name: t for name, t in tensors.items() if not name.endswith("_zeros")}


VARIANT = Variant(
    name="glora",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # Xd / Xu of the paths that can be low-rank (A, B, C), X of every path
    tensors={f"glora_{p}_{part}": _slot(p, part) for p in PATHS for part in ("Xd", "Xu", "X") if part == "X" or p in "ABC"},
    options={
        "config_A_B": Option("lora", one_of("lora", "vector", "constant", "none"), "config_A_B"),
        "config_C": Option("lora", one_of("lora", "vector", "none"), "config_C"),
        "config_D_E": Option("constant", one_of("vector", "constant", "none"), "config_D_E"),
        "init": Option("zero", one_of(*INITS), "init_weights", mapped({"zero": True, "random": False})),
    },
    default_alpha=1.0,
    traits=frozenset({"changes_bias"}),
)
# peft: GloraConfig, one r for every layer, no alpha and no fan_in_fan_out; nn.Linear only.
PEFT = PeftFormat(
    PeftMethod("GLORA", rank=("r", None), fan_in_fan_out=False),
    conv1d=False,
    export=_export,
    imported={f"glora_{p}.zeros": f"glora_{p}_zeros" for p in PATHS},
    convert_in=_drop_zeros,
)
