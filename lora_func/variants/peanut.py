"""PEANuT, a weight-aware nonlinear adapter (Zhong et al., arXiv 2410.01870), following HF peft
0.21.2's ``tuners/peanut/layer.py`` (``Linear``).

A small network reads the frozen weight and writes the update. Trainable ``peanut_A (r, d_out)``
(it reads ``W``'s output axis), ``depth`` encoders and decoders ``(r, r)`` each
(``peanut_encoders_<i>``, ``peanut_decoders_<i>``) and ``peanut_B (d_out, r)``; ``σ`` the
``act_fn`` (transformers' ``ACT2FN``, as peft), ``s`` the ``scaling`` option:

    h_0 = σ(Wᵀ Aᵀ) (d_in, r);   h_{i+1} = σ(h_i E_iᵀ)   (i < depth, keeping h_i);
    then for i < depth: h ← σ(h D_iᵀ) + h_{depth−1−i};   ΔW = s·B hᵀ,   W_eff = W + ΔW

The update depends on ``W`` nonlinearly but has rank ``r`` (``B hᵀ``), so the activation form is
``base(x) + s·(x h) Bᵀ``: the ``(d_in, r)`` network output and a rank-``r`` product, no
``(d_out, d_in)`` ``ΔW`` (peft builds it and a second dense product).

Init as peft (``init="identity"``, peft's ``init_weights=True``): ``A``, the encoders and the
decoders kaiming-uniform (``a = √5``), ``B = 0``; ``init="random"`` (``False``): ``B``
kaiming-uniform too. The draws are peft's, in its order: peft builds each ``nn.Linear`` (which
draws once) before drawing again, so the generator skips those first draws.

``depth`` is at most :data:`MAX_DEPTH` (one tensor per encoder and decoder, peft's keys
``peanut_encoders.<i>.weight``). peft adapts ``nn.Linear`` only; lora_func adapts GPT-2
``Conv1D`` too (``save_peft`` refuses it). ``alpha`` is not used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.activations import ACT2FN

from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, real, whole
from lora_func.variants._kernels import base_plus_product, kaiming_uniform

MAX_DEPTH = 8
INITS = ("identity", "random")


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """transformers' ``ACT2FN[name]`` (peft's activation; ``ACT2FN`` builds a new module at every
    lookup), one instance per name. A plain dict: dynamo does not trace ``functools.cache``."""
    if name not in _ACTIVATIONS:
        _ACTIVATIONS[name] = ACT2FN[name]
    return _ACTIVATIONS[name]


def _hidden_layer(kind: str, i: int) -> Slot:
    """The ``i``-th encoder or decoder ``(r, r)``: held where ``i < depth``."""
    return Slot(lambda info: (info.r, info.r) if i < info.option("depth") else None, rank_axes=(0, 1), peft=f"peanut_{kind}.{i}.weight")


def skip_draws(shape: tuple[int, ...], generator: torch.Generator) -> None:
    """Advance ``generator`` past one uniform draw of ``shape`` (float32, CPU): a draw peft makes
    and overwrites (an ``nn.Linear``'s own init when it is built)."""
    torch.empty(shape, dtype=torch.float32).uniform_(generator=generator)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, d_out, depth = info.r, info.d_out, info.option("depth")
    shapes = {"peanut_A": (r, d_out)}
    shapes |= {f"peanut_encoders_{i}": (r, r) for i in range(depth)}
    shapes |= {f"peanut_decoders_{i}": (r, r) for i in range(depth)}
    # peft: every nn.Linear draws once when built (A, encoders, decoders, B), then reset draws again
    for shape in [*shapes.values(), (d_out, r)]:
        skip_draws(shape, generator)
    params = {name: kaiming_uniform(shape, a=math.sqrt(5), generator=generator) for name, shape in shapes.items()}
    if info.option("init") == "random":
        params["peanut_B"] = kaiming_uniform((d_out, r), a=math.sqrt(5), generator=generator)
    else:
        params["peanut_B"] = torch.zeros(d_out, r)
    return {name: t.to(weight.device, dtype) for name, t in params.items()}, {}


def hidden(params: TensorDict, weight: Tensor, info: LayerInfo) -> Tensor:
    """The network's output ``h (d_in, r)`` on ``W (d_out, d_in)``, in ``peanut_A``'s dtype."""
    act, a = activation(info.option("act_fn")), params["peanut_A"]
    h = act(weight.T.to(a.dtype) @ a.T)
    depth = info.option("depth")
    kept = []
    for i in range(depth):
        kept.append(h)
        h = act(h @ params[f"peanut_encoders_{i}"].T)
    for i in range(depth):
        h = act(h @ params[f"peanut_decoders_{i}"].T) + kept[depth - 1 - i]
    return h


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    # (W arrives in the adapter dtype, the network's)
    return weight + info.option("scaling") * params["peanut_B"] @ hidden(params, weight, info).T, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    # LoRA's kernel for base(x) + (x Aᵀ) Bᵀ with A = s·hᵀ (on a bf16 base: bf16 products, no fp32 copy of x)
    h = hidden(params, base.weight, info)
    return base_plus_product(base, x, info.option("scaling") * h.T, params["peanut_B"])


VARIANT = Variant(
    name="peanut",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "peanut_A": Slot(lambda i: (i.r, i.d_out), rank_axes=(0,), peft="peanut_A.weight"),
        **{f"peanut_encoders_{i}": _hidden_layer("encoders", i) for i in range(MAX_DEPTH)},
        **{f"peanut_decoders_{i}": _hidden_layer("decoders", i) for i in range(MAX_DEPTH)},
        "peanut_B": Slot(lambda i: (i.d_out, i.r), rank_axes=(1,), peft="peanut_B.weight"),
    },
    options={
        "depth": Option(0, whole(0, MAX_DEPTH + 1), "depth"),
        "act_fn": Option("relu", one_of(*sorted(ACT2FN)), "act_fn"),
        "scaling": Option(1.0, real(), "scaling"),
        "init": Option("identity", one_of(*INITS), "init_weights", mapped({"identity": True, "random": False})),
    },
    default_alpha=1.0,  # not used: the scale is the scaling option
)
# peft: PeanutConfig (no bias, no fan_in_fan_out, no rank_pattern; nn.Linear only).
PEFT = PeftFormat(PeftMethod("PEANUT", {}, rank=("r", None), fan_in_fan_out=False), conv1d=False)
