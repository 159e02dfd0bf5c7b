"""Lily, Low-Rank Interconnected Adaptation across Layers (Zhong et al. 2024, arXiv 2407.09946),
following HF peft 0.21's ``tuners/lily/{model,layer}.py``.

Per target, ``A (r, d_in)`` projects the input and a per-layer router ``R (num_B, r)`` mixes
``num_B`` up-projections ``B (num_B, r, d_out)``; the mixing weights are the router's softmax
averaged over *every token of the call*:

    h = x Aᵀ   (..., r),   p = mean over the call's tokens of softmax(h Rᵀ)   (num_B,)
    y = x Wᵀ + b + scaling · h (Σ_e p_e B_e)

Sharing (peft's ``_post_injection_hook``): the targets are grouped by (the target name that
matched them, weight shape), a regex ``targets`` being one name; within a group every layer reads
the group's one ``B``, and each ``stride_A`` consecutive layers read their block's first
layer's ``A``; the router is the layer's own. ``A`` and ``B`` are grouped shared tensors
(``Variant.groups``): ``"<shared>.lily_B@<g>"``, ``"<shared>.lily_A@<g>_<block>"``, ``g`` the
group's index in module order.

Because ``p`` depends on the call's tokens, Lily has no merged weight (the
``no_merged_weight`` trait; peft refuses to merge it too): it runs by its activation form. In a
batched call the mean is over every token of the batch (padding included), as in peft; under
``vmap`` over examples (per-example gradients) each example's mean is over its own tokens: the
model run on that example alone.

Init (peft's, in peft's order of draws per layer: the three ``nn.Linear`` constructors' kaiming
draws of ``A``, ``B`` and the router, then ``reset_lily_parameters``' ``A`` and router):
``A``, ``R`` kaiming-uniform (a=√5), ``B = 0`` (``init="random"``, peft's ``init_weights=False``:
kaiming-uniform on peft's ``(num_B·r, d_out)`` layout). A layer that is not its group's (block's)
first draws its ``B`` (``A``) too, and the draw is dropped, as peft's ties drop it.

peft format (``LilyConfig``): per layer ``lily_A.weight``, ``lily_B.weight`` ``(num_B·r, d_out)``,
``lily_router.weight``; peft writes the shared ``A`` / ``B`` under every layer that reads them,
and ``load_peft`` takes the group's last layer's copy (what peft's ``load_state_dict`` leaves in
the tied module). peft's Lily is ``nn.Linear`` only: ``save_peft`` refuses GPT-2 ``Conv1D``
targets (lora_func adapts them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, LayerInfo, Option, PeftFormat, PeftLayer, PeftMethod, Slot, TensorDict, Variant, mapped, one_of, real, whole
from lora_func.variants._contract import refuse_merge
from lora_func.variants._kernels import kaiming_uniform

INITS = ("zero", "random")


def _matched(module: str, targets: str | tuple[str, ...]) -> str:
    """The target name that selected ``module`` (peft's ``matched_suffix``): a regex ``targets``
    is one name; of several names ending the module's, the longest."""
    if isinstance(targets, str):
        return targets
    found = [t for t in targets if module.endswith(t)]
    return max(found, key=lambda t: (len(t), t)) if found else module


def groups(targets: str | tuple[str, ...], infos: Mapping[str, LayerInfo]) -> dict[str, dict[str, str]]:
    """Each layer's ``B`` group (its (target name, shape)'s index in module order) and ``A`` block
    (``<group>_<index in the group // stride_A>``)."""
    index: dict[tuple[str, int, int], int] = {}
    seen: dict[tuple[str, int, int], int] = {}
    out = {}
    for module, info in infos.items():
        key = (_matched(module, targets), info.d_out, info.d_in)
        g = index.setdefault(key, len(index))
        i = seen[key] = seen.get(key, -1) + 1
        out[module] = {"lily_B": str(g), "lily_A": f"{g}_{i // int(info.option('stride_A'))}"}
    return out


def init(
    weight: Tensor, bias: Tensor | None, info: LayerInfo, *, dtype: torch.dtype, generator: torch.Generator, calibration: Any = None
) -> tuple[TensorDict, TensorDict]:
    """One layer's ``lily_A``, ``lily_B`` and ``lily_router`` with peft's draws in peft's order
    (the core keeps the group's first ``A`` / ``B``: ``Variant.groups``)."""
    r, num_b, d_in, d_out = int(info.r), int(info.option("num_B")), info.d_in, info.d_out
    a5 = math.sqrt(5)
    # nn.Linear's own constructors (A, B, router), then reset_lily_parameters (A, router[, B]).
    for shape in ((r, d_in), (num_b * r, d_out), (num_b, r)):
        kaiming_uniform(shape, a=a5, generator=generator)
    lora_a = kaiming_uniform((r, d_in), a=a5, generator=generator)
    router = kaiming_uniform((num_b, r), a=a5, generator=generator)
    if info.option("init") == "random":
        lora_b = kaiming_uniform((num_b * r, d_out), a=a5, generator=generator)
    else:
        lora_b = torch.zeros((num_b * r, d_out))
    params = {"lily_A": lora_a, "lily_B": lora_b.reshape(num_b, r, d_out), "lily_router": router}
    return {k: v.to(weight.device, dtype) for k, v in params.items()}, {}


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """peft's ``Linear.forward``: ``base(x) + scaling · h (Σ_e p_e B_e)``, ``p`` the router's
    softmax averaged over every token of ``x``."""
    lily_a, lily_b, router = params["lily_A"], params["lily_B"], params["lily_router"]
    y = base(x)
    hidden = x.to(lily_a.dtype) @ lily_a.transpose(-1, -2)
    probabilities = torch.softmax(hidden @ router.transpose(-1, -2), dim=-1)
    mixing = probabilities.reshape(-1, probabilities.shape[-1]).mean(dim=0)
    combined = torch.einsum("e,eio->io", mixing, lily_b)
    delta = (hidden @ combined) * float(info.option("scaling"))
    return y + delta.to(y.dtype)


def weight_form(params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo) -> tuple[Tensor, Tensor | None]:
    return refuse_merge("lily")  # the mixing weights come from each call's tokens


def _export(params: TensorDict, buffers: TensorDict, weight: Tensor | None, info: LayerInfo) -> PeftLayer:
    """A layer as peft stores it: ``lily_B`` in peft's ``(num_B·r, d_out)`` layout."""
    return PeftLayer(
        lambda: {
            "lily_A": params["lily_A"],
            "lily_B_flat": params["lily_B"].reshape(-1, params["lily_B"].shape[-1]),
            "lily_router": params["lily_router"],
        },
        r=int(info.r),
    )


def _convert_in(found: TensorDict, options: Mapping[str, Any]) -> TensorDict:
    """peft's ``lily_B.weight (num_B·r, d_out)`` as ``lily_B (num_B, r, d_out)``."""
    out = dict(found)
    if "lily_B_flat" in out:
        flat = out.pop("lily_B_flat")
        out["lily_B"] = flat.reshape(int(options["num_B"]), -1, flat.shape[-1])
    return out


VARIANT = Variant(
    name="lily",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "lily_A": Slot(lambda i: (int(i.r), i.d_in), rank_axes=(0,), shared=True),
        "lily_B": Slot(lambda i: (int(i.option("num_B")), int(i.r), i.d_out), rank_axes=(1,), shared=True),
        "lily_router": Slot(lambda i: (int(i.option("num_B")), int(i.r)), rank_axes=(1,), peft="lily_router.weight"),
    },
    options={
        "stride_A": Option(1, whole(1), "stride_A"),
        "num_B": Option(2, whole(1), "num_B"),
        "scaling": Option(1.0, real(), "scaling"),
        "init": Option("zero", one_of(*INITS), "init_weights", mapped({"zero": True, "random": False})),
    },
    default_alpha=1.0,
    traits=frozenset({"no_merged_weight"}),
    groups=groups,
)
PEFT = PeftFormat(
    PeftMethod("LILY", fixed={}, rank=("r", None), fan_in_fan_out=False),  # (LilyConfig has no bias field)
    conv1d=False,
    export=_export,
    imported={"lily_A.weight": "lily_A", "lily_B.weight": "lily_B_flat"},
    convert_in=_convert_in,
)
