"""LoKr, low-rank Kronecker product (KronA: Edalati et al., arXiv 2212.10650; the LyCORIS
form, Yeh et al., arXiv 2309.14859), following HF peft's ``tuners/lokr/layer.py``.

The layer's sizes are factored as peft's ``factorization``: ``d_out = l·k``, ``d_in = m·n``
(``l ≤ k``, ``m ≤ n``, near the square root, or ``decompose_factor`` as one factor where it
divides). With ``s = alpha / r``:

    ΔW = s · W1 ⊗ W2,   W1 (l, m),   W2 (k, n),   W_eff = W + ΔW,   bias unchanged

``W2`` is stored factored, ``lokr_w2_a (k, r) @ lokr_w2_b (r, n)``, when ``r < max(k, n)/2``,
else whole as ``lokr_w2``; ``W1`` is whole (``lokr_w1``) unless ``decompose_both`` and
``r < max(l, m)/2`` (then ``lokr_w1_a (l, r) @ lokr_w1_b (r, m)``). So which tensors a layer
has depends on its sizes and rank, exactly as in peft.

Activation form, the Kronecker identity ``(W1 ⊗ W2) x = vec(W1 X W2ᵀ)`` with ``X = x`` seen as
``(m, n)``: two small products per row (``m n k + l m k`` multiplies, and with ``W2`` factored
``X W2ᵀ = (X W2bᵀ) W2aᵀ``), never the ``(d_out, d_in)`` update, while its ``(rows, m, k)``
intermediate is smaller than that update (``rows · m · k < d_out · d_in``: large layers);
else the dense update, built once as peft does. The weight form builds ``torch.kron(W1, W2)``.

Init (peft's): ``init="default"`` (``init_weights=True``): ``W1`` (or ``W1a``) zero, the rest
kaiming-uniform (``a = √5``); ``init="lycoris"``: ``W2`` (or ``W2b``) zero, the rest
kaiming-uniform; ``init="random"`` (``False``): all kaiming-uniform. The first two are the
identity at init.

Training only, as peft (lazy path): ``module_dropout`` skips the update, ``rank_dropout``
zeroes output rows of it, rescaled by the kept fraction only with ``rank_dropout_scale``
(:func:`lora_func.variants._lycoris.output_keep`). ``use_effective_conv2d`` (conv kernels
only) is ignored on Linear and Conv1D, as in peft.

Conv kernels (``nn.Conv1d/2d/3d``, the ``"conv"`` kind; peft's ``Conv1d`` / ``Conv2d`` layers):
the channels are factored (``d_out = l·k``, ``c_in = m·n``) and ``W2`` carries the kernel's
``K = prod(kernel)`` positions: ``W2 (k, n·K)`` in the canonical ``(d_out, c_in·K)`` view, so
``ΔW = s · W1 ⊗ W2`` as on Linear. Whole, ``lokr_w2`` is peft's ``(k, n, *kernel)``; factored,
``lokr_w2_b (r, n·K)``; with ``use_effective_conv2d`` (kernel of more than one position, ``W2``
factored) peft's CP form ``W2[·, c, κ] = Σ_ij T2[i,j,κ] W2a[·,i] W2b[j,c]`` with ``lokr_t2 (r, r,
*kernel)`` (``(r, r, k, 1)`` on a Conv1d), ``lokr_w2_a (k, r)`` (peft: ``(r, k)``), ``lokr_w2_b
(r, n)``. On a Conv1d with a whole ``W2`` peft's ``torch.kron`` of a 2-D ``W1`` with the 3-D
``W2`` lays the update out otherwise, ``ΔW[p·l + i, q·m·K + j·K + κ] = s · W1[i, j] W2[p, q, κ]``:
lora_func computes that layout, so peft's checkpoints load exactly. A conv applies through its
merged kernel; the training-only dropouts are refused there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from lora_func.variants._kernels import kaiming_uniform
from lora_func.variants import BaseLayer, Check, LayerInfo, Option, PeftFormat, Slot, TensorDict, Variant, mapped, one_of
from lora_func.variants import _lycoris

INITS = ("default", "lycoris", "random")
NAMES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """peft's ``factorization``: ``(m, n)`` with ``m·n = dimension``, ``m ≤ n``; ``m = factor``
    where ``factor > 0`` divides ``dimension``, else the pair found by peft's search near the
    square root (``m`` at most ``factor`` where ``factor > 0``)."""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    if factor == -1:
        factor = dimension
    m, n = 1, dimension
    length = m + n
    while m < n:
        new_m = m + 1
        while dimension % new_m != 0:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > length or new_m > factor:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


def layout(
    r: int, d_in: int, d_out: int, options: Mapping[str, Any], kernel: tuple[int, ...] = ()
) -> dict[str, tuple[int, ...]]:
    """The tensors of one layer and their shapes, as peft's ``update_layer`` decides them; on a
    conv ``kernel`` the channels ``d_in // prod(kernel)`` are factored (module docstring)."""
    size = math.prod(kernel)
    out_l, out_k = factorization(d_out, options["decompose_factor"])
    in_m, in_n = factorization(d_in // size, options["decompose_factor"])
    shapes: dict[str, tuple[int, ...]] = {}
    if options["decompose_both"] and r < max(out_l, in_m) / 2:
        shapes |= {"lokr_w1_a": (out_l, r), "lokr_w1_b": (r, in_m)}
    else:
        shapes["lokr_w1"] = (out_l, in_m)
    if r >= max(out_k, in_n) / 2:
        shapes["lokr_w2"] = (out_k, in_n * size)
    elif size > 1 and options["use_effective_conv2d"]:
        shapes |= {"lokr_w2_a": (out_k, r), "lokr_w2_b": (r, in_n), "lokr_t2": _lycoris.core_shape(r, kernel)}
    else:
        shapes |= {"lokr_w2_a": (out_k, r), "lokr_w2_b": (r, in_n * size)}
    return shapes


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    _lycoris.check_conv("lokr", info)
    options = dict(info.options)
    how = options["init"]
    # peft's zero tensor: W1 (or W1a) by default, W2 (or W2b) the LyCORIS way, none at random.
    zero = {"default": ("lokr_w1", "lokr_w1_a"), "lycoris": ("lokr_w2", "lokr_w2_b"), "random": ()}[how]
    params = {}
    shapes = layout(info.r, info.d_in, info.d_out, options, info.kernel)
    for name, shape in shapes.items():  # peft's order: W1 (or W1a, W1b), W2 (or W2a, W2b), the core
        if name in zero:
            params[name] = torch.zeros(shape, dtype=torch.float32)
        elif name == "lokr_w2_a" and "lokr_t2" in shapes:  # peft's (r, k): fan-in k
            params[name] = kaiming_uniform(shape[::-1], a=math.sqrt(5), generator=generator).T.contiguous()
        else:
            params[name] = kaiming_uniform(shape, a=math.sqrt(5), generator=generator)
    return {k: v.to(weight.device, dtype) for k, v in params.items()}, {}


def factor(params: TensorDict, which: str) -> Tensor:
    """``W1`` or ``W2`` (``which`` is ``"w1"`` / ``"w2"``), whole: stored, ``a @ b``, or the CP
    form's ``W2 (k, n·K)`` on a conv kernel."""
    whole = params.get(f"lokr_{which}")
    if whole is not None:
        return whole
    if which == "w2" and "lokr_t2" in params:
        return _lycoris.cp_rebuild(params["lokr_t2"], params["lokr_w2_a"], params["lokr_w2_b"])
    return params[f"lokr_{which}_a"] @ params[f"lokr_{which}_b"]


def w2_rows(params: TensorDict) -> int:
    """``k``, the rows of ``W2`` (static)."""
    return params["lokr_w2"].shape[-2] if "lokr_w2" in params else params["lokr_w2_a"].shape[-2]


def delta_weight(params: TensorDict, info: LayerInfo) -> Tensor:
    """``ΔW = s · W1 ⊗ W2``, ``(d_out, d_in)``; peft's other layout on a Conv1d with a whole ``W2``
    (module docstring)."""
    w1, w2 = factor(params, "w1"), factor(params, "w2")
    if len(info.kernel) == 1 and "lokr_w2" in params:
        kernel_w2 = rearrange(w2, "p (q s) -> p q s", s=info.kernel[0])
        delta = rearrange(torch.einsum("ij,pqs->piqjs", w1, kernel_w2), "p i q j s -> (p i) (q j s)")
    else:
        delta = torch.kron(w1, w2)
    return delta * (info.alpha / info.r)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + delta_weight(params, info).to(weight.dtype), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    w1 = factor(params, "w1")  # (l, m): tiny, built whole even when factored
    m = w1.shape[-1]
    keep = _lycoris.output_keep(
        base, info, dtype=torch.float32, device=w1.device, rescale=bool(info.option("rank_dropout_scale"))
    )
    y = base(x)
    xa = x.to(w1.dtype)
    if x.numel() // info.d_in * m * w2_rows(params) >= info.d_in * info.d_out:
        # Many rows on a small layer: the (rows, m, k) intermediate would outweigh the dense
        # update, which is then built once (as peft does) and applied in one product.
        delta_w = delta_weight(params, info)
        if keep is not None:
            delta_w = delta_w * keep[:, None].to(delta_w.dtype)
        return y + (xa @ delta_w.transpose(-1, -2)).to(y.dtype)
    xs = rearrange(xa, "... (m n) -> ... m n", m=m)
    if "lokr_w2" in params:
        t = xs @ params["lokr_w2"].transpose(-1, -2)  # X W2ᵀ: (..., m, k)
    else:
        t = (xs @ params["lokr_w2_b"].transpose(-1, -2)) @ params["lokr_w2_a"].transpose(-1, -2)
    # The scale rides on the (l, m) factor: W1 X W2ᵀ, then (l, k) -> l·k outputs, row-major as kron.
    delta = rearrange((w1 * (info.alpha / info.r)) @ t, "... l k -> ... (l k)")
    if keep is not None:
        delta = delta * keep.to(delta.dtype)
    return y + delta.to(y.dtype)


def _reshape(kind: str, name: str, tensor: Tensor, shape: tuple[int, ...], to_peft: bool) -> Tensor:
    """A whole ``W2`` on a conv is peft's ``(k, n, *kernel)``."""
    if kind not in ("conv", "grouped_conv") or name != "lokr_w2":
        return tensor
    return tensor.reshape(tensor.shape[0], -1, *shape[2:]) if to_peft else tensor.flatten(1)


_AXES = {"lokr_w1": (), "lokr_w1_a": (1,), "lokr_w1_b": (0,), "lokr_w2": (), "lokr_w2_a": (1,), "lokr_w2_b": (0,), "lokr_t2": (0, 1)}

# -1: each size factored near its square root; else the preferred factor
FACTOR = Check(lambda v: isinstance(v, int) and not isinstance(v, bool) and (v == -1 or v >= 1), "must be -1 (factor each size near its square root) or a positive integer (the preferred factor)")


VARIANT = Variant(
    name="lokr",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    # a layer holds the factors its sizes and rank call for (layout)
    tensors={
        name: Slot((lambda n: lambda i: layout(i.r, i.d_in, i.d_out, dict(i.options), i.kernel).get(n))(name), rank_axes=axes, peft=name)
        for name, axes in _AXES.items()
    },
    options={
        **_lycoris.OPTIONS,
        "init": Option("default", one_of(*INITS), "init_weights", mapped({"default": True, "lycoris": "lycoris", "random": False})),
        "decompose_both": Option(False, peft="decompose_both"),
        "decompose_factor": Option(-1, FACTOR, "decompose_factor"),
        "rank_dropout_scale": Option(False, peft="rank_dropout_scale"),
    },
    default_alpha=8.0,
    # nn.Conv1d/2d/3d through the merged kernel (peft's LoKr takes Conv1d and Conv2d), grouped
    # ones in their grouped kernel as peft.
    kind_forms={"linear": None, "conv1d": None, "conv": None, "grouped_conv": None},
)
# peft: LoKrConfig. Its LyCORIS tuners take nn.Linear / Conv1d / Conv2d only.
PEFT = PeftFormat(
    _lycoris.method("LOKR"),
    conv1d=False,
    export=_lycoris.cp_export("lokr", ("lokr_w2_a",), "lokr_t2"),
    imported={"lokr_t2": "lokr_t2"},
    convert_in=_lycoris.cp_convert_in(("lokr_w2_a",), "lokr_t2"),
    reshape=_reshape,
)
