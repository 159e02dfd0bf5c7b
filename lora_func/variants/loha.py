"""LoHa, low-rank Hadamard product (FedPara: Hyeon-Woo, Ye-Bin, Oh, arXiv 2108.06098; the
LyCORIS form, Yeh et al., arXiv 2309.14859), following HF peft's ``tuners/loha/layer.py``.

Trainable ``hada_w1_a (d_out, r)``, ``hada_w1_b (r, d_in)``, ``hada_w2_a (d_out, r)``,
``hada_w2_b (r, d_in)``; with ``s = alpha / r``:

    ΔW = s · (W1a W1b) ⊙ (W2a W2b)     W_eff = W + ΔW,   bias unchanged

The Hadamard product of two rank-``r`` matrices has rank up to ``r²``: row by row,
``(W1a W1b) ⊙ (W2a W2b) = U V`` with ``U = W1a ⊙ᵣ W2a (d_out, r²)`` (the column ``(i, j)`` is
``W1a[:, i] ⊙ W2a[:, j]``, the face-splitting product) and ``V (r², d_in)`` the same over the
rows of ``W1b``, ``W2b``. The activation form is ``base(x) + s · (x Vᵀ) Uᵀ`` where that holds
less than the ``(d_out, d_in)`` update (``r² (n + d_in + d_out) < d_in d_out`` for ``n`` input
rows: large layers), else ``base(x) + x ΔWᵀ`` with ``ΔW`` built as peft builds it (the two
products recomputed in backward, not kept).

Init (``init="default"``, peft's ``init_weights=True``): ``W1a``, ``W1b``, ``W2a``
kaiming-uniform (``a = √5``), ``W2b = 0``, so ``ΔW = 0`` and the step-0 gradient reaches
``W2b`` only. ``init="random"`` (peft's ``False``): all four kaiming-uniform.

Training only, as peft (lazy path; the merged path has no dropout, as peft's merged layers):
``module_dropout`` skips the whole update with that probability, ``rank_dropout`` zeroes
output rows of the update and rescales the kept ones by the kept fraction (peft's draws, in
its order: :func:`lora_func.variants._lycoris.output_keep`). peft rounds the scale to fp32
(``torch.tensor(alpha / r)``); lora_func keeps it a Python float.

Conv kernels (``nn.Conv1d/2d/3d``, the ``"conv"`` kind; peft's ``Conv1d`` / ``Conv2d`` layers):
the kernel's canonical ``(d_out, c_in·K)`` view takes the Linear form as it is (``hada_w*_b``
``(r, c_in·K)``), or, with ``use_effective_conv2d`` on a kernel of more than one position,
peft's CP form: cores ``hada_t1``, ``hada_t2 (r, r, *kernel)`` (``(r, r, k, 1)`` on a Conv1d, as
peft), ``hada_w*_a (d_out, r)`` (peft stores them ``(r, d_out)``), ``hada_w*_b (r, c_in)``:

    ΔW[o, c, κ] = s · (Σ_ij T1[i,j,κ] W1a[o,i] W1b[j,c]) · (Σ_ij T2[i,j,κ] W2a[o,i] W2b[j,c])

(cores kaiming-uniform in both inits). A conv applies through its merged kernel (one
convolution with ``W + ΔW``: the update's activations would cost a second convolution), so the
training-only dropouts are refused there. ``use_effective_conv2d`` is ignored on Linear, as in
peft, and saved as it is.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from lora_func.variants._kernels import base_plus_low_rank, kaiming_uniform
from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, Slot, TensorDict, Variant, mapped, one_of
from lora_func.variants import _lycoris

INITS = ("default", "random")
NAMES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
CORES = ("hada_t1", "hada_t2")  # the CP form's, on conv kernels with use_effective_conv2d


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    _lycoris.check_conv("loha", info)
    r, d_in, d_out = info.r, info.d_in, info.d_out
    a = math.sqrt(5)
    if _lycoris.uses_cp(info):
        return {k: v.to(weight.device, dtype) for k, v in _cp_init(info, generator).items()}, {}
    params = {
        "hada_w1_a": kaiming_uniform((d_out, r), a=a, generator=generator),
        "hada_w1_b": kaiming_uniform((r, d_in), a=a, generator=generator),
        "hada_w2_a": kaiming_uniform((d_out, r), a=a, generator=generator),
        "hada_w2_b": (
            kaiming_uniform((r, d_in), a=a, generator=generator)
            if info.option("init") == "random"
            else torch.zeros((r, d_in), dtype=torch.float32)
        ),
    }
    return {k: v.to(weight.device, dtype) for k, v in params.items()}, {}


def _cp_init(info: LayerInfo, generator: torch.Generator) -> TensorDict:
    """peft's CP-form draws in its order: kaiming-uniform on its own shapes (``(r, d_out)``
    factors: fan-in ``d_out``), ``W2b`` zero by default, then both cores."""
    r, c_in, a = info.r, info.d_in // math.prod(info.kernel), math.sqrt(5)
    params = {
        "hada_w1_a": kaiming_uniform((r, info.d_out), a=a, generator=generator).T,
        "hada_w1_b": kaiming_uniform((r, c_in), a=a, generator=generator),
        "hada_w2_a": kaiming_uniform((r, info.d_out), a=a, generator=generator).T,
        "hada_w2_b": (
            kaiming_uniform((r, c_in), a=a, generator=generator)
            if info.option("init") == "random"
            else torch.zeros((r, c_in), dtype=torch.float32)
        ),
    }
    for core in ("hada_t1", "hada_t2"):
        params[core] = kaiming_uniform(_lycoris.core_shape(r, info.kernel), a=a, generator=generator)
    return {k: v.contiguous() for k, v in params.items()}


def scale(info: LayerInfo) -> float | Tensor:
    """``alpha / r`` (a member's own in a rank-padded stack: see ``padded_member``)."""
    return info.alpha / info.r


class _Hadamard(torch.autograd.Function):
    """``(W1a W1b) ⊙ (W2a W2b)`` that saves only the four factors and recomputes the two
    products in backward (peft's ``HadaWeight``): autograd would keep both ``(d_out, d_in)``
    products for the whole step."""

    generate_vmap_rule = True

    @staticmethod
    def forward(w1a: Tensor, w1b: Tensor, w2a: Tensor, w2b: Tensor) -> Tensor:
        return (w1a @ w1b) * (w2a @ w2b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        w1a, w1b, w2a, w2b = ctx.saved_tensors
        g1 = grad * (w2a @ w2b)
        g2 = grad * (w1a @ w1b)
        t = torch.Tensor.transpose
        return g1 @ t(w1b, -1, -2), t(w1a, -1, -2) @ g1, g2 @ t(w2b, -1, -2), t(w2a, -1, -2) @ g2


def delta_weight(params: TensorDict, info: LayerInfo) -> Tensor:
    """``ΔW = s · (W1a W1b) ⊙ (W2a W2b)``, ``(d_out, d_in)``; on a conv layer's CP form the two
    rebuilt kernels instead (module docstring)."""
    if "hada_t1" in params:
        w1 = _lycoris.cp_rebuild(params["hada_t1"], params["hada_w1_a"], params["hada_w1_b"])
        return w1 * _lycoris.cp_rebuild(params["hada_t2"], params["hada_w2_a"], params["hada_w2_b"]) * scale(info)
    factors = [params[n] for n in NAMES]
    if torch.compiler.is_compiling():
        # A trace plans its own saved tensors (and dynamo warns when it traces a custom Function).
        return (factors[0] @ factors[1]) * (factors[2] @ factors[3]) * scale(info)
    return _Hadamard.apply(*factors) * scale(info)


def face_splitting(params: TensorDict) -> tuple[Tensor, Tensor]:
    """``U (d_out, r²)``, ``V (r², d_in)`` with ``(W1a W1b) ⊙ (W2a W2b) = U V``."""
    w1a, w1b, w2a, w2b = (params[n] for n in NAMES)
    u = rearrange(w1a[:, :, None] * w2a[:, None, :], "o i j -> o (i j)")
    v = rearrange(w1b[:, None, :] * w2b[None, :, :], "i j d -> (i j) d")
    return u, v


def uses_face_splitting(r: int, d_in: int, d_out: int, rows: int) -> bool:
    """Whether the rank-``r²`` path holds less than the dense update: its ``(rows, r²)``
    activations and ``U``, ``V`` against the ``(d_out, d_in)`` update (both paths keep the
    input). Fewer multiplies too whenever it holds."""
    return r * r * (rows + d_in + d_out) < d_in * d_out


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return weight + delta_weight(params, info).to(weight.dtype), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    w1a = params["hada_w1_a"]
    keep = _lycoris.output_keep(base, info, dtype=w1a.dtype, device=w1a.device, rescale=True)
    xa = x.to(w1a.dtype)
    r = w1a.shape[-1]  # the stored (possibly padded) rank: static under vmap
    if uses_face_splitting(r, info.d_in, info.d_out, x.numel() // info.d_in):
        u, v = face_splitting(params)
        # The scale and any dropout ride on the (d_out, r²) factor, not on the activations.
        u = u * scale(info)
        if keep is not None:
            u = u * keep[:, None]
        return base_plus_low_rank(base, x, xa @ v.transpose(-1, -2), u)
    delta = delta_weight(params, info)
    if keep is not None:
        delta = delta * keep[:, None]
    # base(x) + x ΔWᵀ: the "low-rank" path at full width, one product.
    return base_plus_low_rank(base, x, xa, delta)


def peft_shapes(r: int, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
    """``hada_w1_a (d_out, r)``, ``hada_w1_b (r, d_in)``, the same for ``w2``."""
    return {"hada_w1_a": (d_out, r), "hada_w1_b": (r, d_in), "hada_w2_a": (d_out, r), "hada_w2_b": (r, d_in)}


def layer_shapes(info: LayerInfo) -> dict[str, tuple[int, ...]]:
    """One layer's tensors: :func:`peft_shapes`, or the CP form's on a conv kernel with ``use_effective_conv2d``."""
    if not _lycoris.uses_cp(info):
        return peft_shapes(info.r, info.d_in, info.d_out)
    r, c_in = info.r, info.d_in // math.prod(info.kernel)
    core = _lycoris.core_shape(r, info.kernel)
    return {"hada_w1_a": (info.d_out, r), "hada_w1_b": (r, c_in), "hada_w2_a": (info.d_out, r), "hada_w2_b": (r, c_in), "hada_t1": core, "hada_t2": core}


# The factors' rank axes: w*_a (d_out, r), w*_b (r, d_in), the CP cores (r, r, *kernel).
_AXES = {"hada_w1_a": (1,), "hada_w1_b": (0,), "hada_w2_a": (1,), "hada_w2_b": (0,), "hada_t1": (0, 1), "hada_t2": (0, 1)}

VARIANT = Variant(
    name="loha",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={name: Slot((lambda n: lambda i: layer_shapes(i).get(n))(name), rank_axes=axes, peft=name) for name, axes in _AXES.items()},
    options={**_lycoris.OPTIONS, "init": Option("default", one_of(*INITS), "init_weights", mapped({"default": True, "random": False}))},
    default_alpha=8.0,
    # nn.Conv1d/2d/3d through the merged kernel (peft's LoHa takes Conv1d and Conv2d), grouped
    # ones in their grouped kernel as peft.
    kind_forms={"linear": None, "conv1d": None, "conv": None, "grouped_conv": None},
)
# peft: LoHaConfig. Its LyCORIS tuners take nn.Linear / Conv1d / Conv2d only: GPT-2 Conv1D is
# refused. A CP layer (it holds the cores) stores its (d_out, r) factors as peft's (r, d_out).
PEFT = PeftFormat(
    _lycoris.method("LOHA"),
    conv1d=False,
    export=_lycoris.cp_export("loha", ("hada_w1_a", "hada_w2_a"), "hada_t1"),
    imported={core: core for core in CORES},
    convert_in=_lycoris.cp_convert_in(("hada_w1_a", "hada_w2_a"), "hada_t1"),
)
