"""Super-Tuning: a sparse support of the weight's own entries chosen by magnitude, optionally
plus a LoRA (the paper's "Supra" hybrid), following HF peft 0.21.2's ``tuners/supertuning``
(``Linear``).

Trainable ``supertuning_values (n,)`` at fixed flat positions ``supertuning_indices (n,)``
(int64, a buffer) of the row-major ``(d_out, d_in)`` weight, ``n = int(d_out·d_in·(1 −
sparsity))``: the ``n`` entries of largest ``|W|`` (``select_top=False``: smallest), in
``torch.topk``'s order, as peft. With ``lora_r`` (peft's ``r``) also ``supertuning_lora_A
(lora_r, d_in)`` and ``supertuning_lora_B (d_out, lora_r)``:

    ΔW.flat[idx_k] += v_k,   W_eff = W + ΔW + s·B A,   s = lora_alpha / lora_r,   bias unchanged

``lora_alpha`` ``None`` is peft's default ``2·lora_r``. The activation form is peft's forward:
the values added into a copy of ``W`` (base dtype) and one product, plus the LoRA's rank-``r``
path (the ``dropout`` option, peft's ``lora_dropout``, on its input in a training step).

Init as peft (``init="identity"``, peft's ``init_weights=True``): values 0, ``A``
kaiming-uniform (``a = √5``), ``B = 0``; ``init="random"``: values ``N(0, 1)``, ``B``
kaiming-uniform. The draws are peft's in its order (its ``nn.Linear`` constructors draw first).

peft's ``r`` may be null (no LoRA), which ``AdapterSpec``'s ``r`` cannot be: the LoRA's rank and
alpha are the options ``lora_r`` and ``lora_alpha``, and the spec's ``r`` and ``alpha`` are not
used. ``save_precomputed_indices=False`` leaves the positions out of peft's file; they are
recomputed from the base weight on load, as peft does. peft adapts ``nn.Linear`` only; lora_func
adapts GPT-2 ``Conv1D`` too (on the canonical ``(d_out, d_in)`` view; ``save_peft`` refuses it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lora_func.variants import (
    FLAG,
    BaseLayer,
    Check,
    LayerInfo,
    Option,
    PeftFormat,
    PeftMethod,
    Slot,
    TensorDict,
    Variant,
    is_finite_number,
    mapped,
    one_of,
    real,
)
from lora_func.variants._kernels import add_low_rank, kaiming_uniform, lowrank_input
from lora_func.variants._options import dropout_option
from lora_func.variants.peanut import skip_draws

INITS = ("identity", "random")


def size(info: LayerInfo) -> int:
    """``n = int(d_out·d_in·(1 − sparsity))``, peft's count of trainable entries."""
    return int(info.d_out * info.d_in * (1 - info.option("sparsity")))


def lora_scale(info: LayerInfo) -> float:
    """``lora_alpha / lora_r`` (``lora_alpha`` ``None``: peft's ``2·lora_r``, so 2)."""
    r, alpha = info.option("lora_r"), info.option("lora_alpha")
    return 2.0 if alpha is None else alpha / r


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    n = size(info)
    if n < 1:
        raise ValueError(  # error: supertuning-no-entries
            f"supertuning: sparsity={info.option('sparsity')} leaves no trainable entry of a {info.d_out}×{info.d_in} weight "
            f"(int({info.d_out * info.d_in}·(1 − sparsity)) = 0); lower sparsity to at most {1 - 1 / (info.d_out * info.d_in):.6g}, "
            f"or leave this layer out"
        )
    scores = weight.abs().flatten()  # (init runs without autograd)
    indices = torch.topk(scores, n, largest=info.option("select_top")).indices
    random = info.option("init") == "random"
    values = torch.randn(n, generator=generator) if random else torch.zeros(n)
    params = {"supertuning_values": values}
    r = info.option("lora_r")
    if r is not None:
        # peft: its nn.Linear constructors draw A and B once before A is drawn again
        skip_draws((r, info.d_in), generator)
        skip_draws((info.d_out, r), generator)
        params["supertuning_lora_A"] = kaiming_uniform((r, info.d_in), a=math.sqrt(5), generator=generator)
        params["supertuning_lora_B"] = kaiming_uniform((info.d_out, r), a=math.sqrt(5), generator=generator) if random else torch.zeros(info.d_out, r)
    return {k: v.to(weight.device, dtype) for k, v in params.items()}, {"supertuning_indices": indices}  # (int64, on W's device)


def _plus_values(weight: Tensor, params: TensorDict, buffers: TensorDict) -> Tensor:
    """``W`` with the values added at their flat positions, in ``W``'s dtype (peft's order)."""
    values = params["supertuning_values"].to(weight.dtype)
    return weight.reshape(-1).scatter_add(0, buffers["supertuning_indices"], values).reshape(weight.shape)


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    w_eff = _plus_values(weight, params, buffers)
    if info.option("lora_r") is not None:
        w_eff = w_eff + lora_scale(info) * params["supertuning_lora_B"] @ params["supertuning_lora_A"]  # (W in the adapter dtype)
    return w_eff, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """peft's forward: one product on ``W`` with the values added (base dtype), plus the LoRA path."""
    y = F.linear(x, _plus_values(base.weight, params, buffers), base.bias)
    if info.option("lora_r") is None:
        return y
    a = params["supertuning_lora_A"]
    h = (lowrank_input(x, base, info).to(a.dtype) @ a.T) * lora_scale(info)
    return add_low_rank(y, h, params["supertuning_lora_B"])


def check_options(options: Mapping[str, Any]) -> None:
    if options["lora_alpha"] is not None and options["lora_r"] is None:
        raise ValueError(  # error: supertuning-alpha-without-r
            f"supertuning option lora_alpha={options['lora_alpha']!r} scales the LoRA of the Supra hybrid, and lora_r is None "
            f"(no LoRA, as peft's r=None); give lora_r too, or leave lora_alpha out"
        )


def _lora(shape: Any) -> Any:
    """A LoRA factor's shape on a layer, ``None`` without ``lora_r``."""
    return lambda i: None if i.option("lora_r") is None else shape(i, i.option("lora_r"))


VARIANT = Variant(
    name="supertuning",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "supertuning_values": Slot(lambda i: (size(i),), peft="supertuning_values"),
        "supertuning_indices": Slot(
            lambda i: (size(i),), buffer=True, integer=True, peft="supertuning_indices", saved_if="save_precomputed_indices"
        ),
        "supertuning_lora_A": Slot(_lora(lambda i, r: (r, i.d_in)), peft="supertuning_lora_A.weight"),
        "supertuning_lora_B": Slot(_lora(lambda i, r: (i.d_out, r)), peft="supertuning_lora_B.weight"),
    },
    options={
        "sparsity": Option(0.99, real(0, 1), "sparsity"),
        "select_top": Option(True, FLAG, "select_top"),
        # peft's r and lora_alpha (null: no LoRA; 2·r), which AdapterSpec's r and alpha cannot hold
        "lora_r": Option(
            None, Check(lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), "must be None or an integer >= 1"), "r"
        ),
        "lora_alpha": Option(None, Check(lambda v: v is None or is_finite_number(v), "must be None (2·lora_r) or a finite number"), "lora_alpha"),
        "dropout": dropout_option("lora_dropout"),
        "init": Option("identity", one_of(*INITS), "init_weights", mapped({"identity": True, "random": False})),
        "save_precomputed_indices": Option(True, FLAG, "save_precomputed_indices"),
    },
    check=check_options,
    default_alpha=1.0,  # not used: the LoRA's scale is lora_alpha / lora_r
)
# peft: SupertuningConfig (no bias and no fan_in_fan_out field; nn.Linear only). No rank field:
# peft's r is the lora_r option (it may be null).
PEFT = PeftFormat(PeftMethod("SUPERTUNING", {}, fan_in_fan_out=False), conv1d=False)
