"""A test-only variant with a trainable tensor shared across layers (Tied-LoRA, Renduchintala et
al. 2023: one ``A`` for every layer, a ``B`` per layer), registered for a test with
:func:`registered_tied` and written against the public contract only.

``W_eff = W + (alpha / r) B_l A[:, :d_in]``; ``tied_A (r, max d_in)`` is one trainable leaf
(``"<shared>.tied_A"``), so its gradient is the sum over the layers that read it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import pytest
import torch
from torch import Tensor

from lora_func import variants
from lora_func.variants import BaseLayer, LayerInfo, Slot, TensorDict, Variant

NAME = "tied_lora"


def shared_init(infos: Mapping[str, LayerInfo], *, dtype, device, generator) -> tuple[TensorDict, TensorDict]:
    if len({info.r for info in infos.values()}) > 1:
        raise ValueError(f"tied_lora needs one rank for every layer, got {sorted({i.r for i in infos.values()})}")
    r, d_in = next(iter(infos.values())).r, max(info.d_in for info in infos.values())
    a = torch.empty(r, d_in)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return {"tied_A": a.to(device, dtype)}, {}


def init(weight: Tensor, bias, info: LayerInfo, *, dtype, generator, calibration=None):
    return {"tied_B": torch.zeros(info.d_out, info.r, device=weight.device, dtype=dtype)}, {}


def weight_form(params: TensorDict, buffers: TensorDict, weight: Tensor, bias, info: LayerInfo):
    a = (params | buffers)["tied_A"][:, : info.d_in]  # a param here, a buffer in FROZEN
    return weight + info.alpha / info.r * params["tied_B"] @ a, bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    a = (params | buffers)["tied_A"][:, : info.d_in]
    y = base(x)
    return (y.to(a.dtype) + ((x.to(a.dtype) @ a.T) * (info.alpha / info.r)) @ params["tied_B"].T).to(y.dtype)


TIED = Variant(
    name=NAME,
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        "tied_B": Slot(lambda i: (i.d_out, i.r), rank_axes=(1,)),
        "tied_A": Slot(lambda i: (i.r, max(d_in for d_in, _, _ in i.layout or ((i.d_in, 0, 0),))), rank_axes=(0,), shared=True),
    },
    shared_init=shared_init,
)


def _frozen_shared_init(infos: Mapping[str, LayerInfo], **kwargs) -> tuple[TensorDict, TensorDict]:
    params, _ = shared_init(infos, **kwargs)
    return {}, params


# The same with A frozen: a shared buffer (rebuilt by shared_init on a trainable_only load).
FROZEN = dataclasses.replace(
    TIED, name="tied_frozen", shared_init=_frozen_shared_init, tensors={**TIED.tensors, "tied_A": dataclasses.replace(TIED.tensors["tied_A"], buffer=True)}
)


def tied_w_eff(p, buffers, W, bias, info):
    """The contract row's oracle: written from the formula above, float64."""
    return W + info.alpha / info.r * p["tied_B"] @ p["tied_A"][:, : W.shape[1]], bias


@pytest.fixture
def registered_tied(monkeypatch):
    monkeypatch.setitem(variants._discover(), NAME, TIED)
    yield TIED
