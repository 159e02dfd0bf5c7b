"""Trainable tokens, peft's ``TrainableTokensConfig(token_indices=[...])``: only the listed rows of
an embedding table are trained, each replaced whole by a trainable copy (new tokens, or re-trained
existing ones), the rest of the table frozen.

On an ``nn.Embedding`` (``V`` tokens of ``d`` features; canonical view ``W (d, V)``): trainable
``trainable_tokens_delta (k, d)``, ``k`` the number of ``token_indices``; the looked-up table is
``W`` with row ``t_j`` replaced by ``delta_j`` (``W_eff[:, t_j] = delta_j``), applied as peft does,
through the whole merged table. On a ``nn.Linear`` or GPT-2 ``Conv1D`` (an output head: its rows
are tokens): ``delta (k, d_in)`` replaces the rows ``W[t_j, :]``, bias unchanged; applied
without the merged matrix, ``y + x (delta − W[t])ᵀ`` on the ``k`` outputs. Init as peft's
(``init_weights=True``): ``delta = W[t]``, so the adapter is exactly the base; ``False``:
``N(0, 1)`` draws. A frozen integer buffer holds the indices (``token_indices (k,)``, from the
option; peft keeps them in its config).

Tied weights (GPT-2's ``lm_head`` and ``wte``): ``AdapterSpec(..., tied="both")`` adapts the
shared table under both names, as peft ties the head's rows to the embedding's. peft's ``Linear``
form drops the head's bias (``F.linear(x, W)``); lora_func keeps it. The indices must be distinct
(peft's ``index_copy`` of a repeated index keeps one of the rows, unspecified which).
"""

from __future__ import annotations

from typing import Any

import torch
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
)

DELTA, INDICES = "trainable_tokens_delta", "token_indices"


def _rows(info: LayerInfo) -> tuple[int, int]:
    """``(tokens, features)`` of the layer: an embedding's ``(V, d)``, a head's ``(d_out, d_in)``."""
    return (info.d_in, info.d_out) if info.kind == "embedding" else (info.d_out, info.d_in)


def _distinct_indices(value: Any) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value) and len(set(value)) == len(value)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    tokens, features = _rows(info)
    chosen = info.option(INDICES)
    outside = sorted(t for t in chosen if t >= tokens)
    if outside:
        raise ValueError(  # error: trainable-tokens-index
            f"trainable_tokens: token_indices {outside[:5]} are outside the layer's {tokens} tokens; pass indices below "
            f"{tokens} (resize the embedding first for new tokens)"
        )
    index = torch.tensor(chosen, dtype=torch.int64, device=weight.device)
    rows = weight.T if info.kind == "embedding" else weight
    if info.option("init_weights"):
        delta = rows.index_select(0, index).detach().to(dtype).clone()
    else:
        delta = torch.randn((len(chosen), features), generator=generator).to(weight.device, dtype)
    return {DELTA: delta}, {INDICES: index}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    delta, index = params[DELTA], buffers[INDICES]
    if info.kind == "embedding":
        return weight.index_copy(1, index, delta.T.to(weight.dtype)), bias
    return weight.index_copy(0, index, delta.to(weight.dtype)), bias


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """``base(x)`` with the ``k`` token outputs moved to ``x delta_jᵀ + b_j``, as ``y + x (delta −
    W[t])ᵀ`` (exactly ``y`` at init) on ``(..., k)`` in the adapter dtype, rounded to the base's
    once; no ``(d_out, d_in)`` matrix built."""
    delta, index = params[DELTA], buffers[INDICES]
    y = base(x)
    change = delta - base.weight.index_select(0, index).to(delta.dtype)
    last = y.dim() - 1
    moved = y.index_select(last, index).to(delta.dtype) + x.to(delta.dtype) @ change.T
    return y.index_copy(last, index, moved.to(y.dtype))


VARIANT = Variant(
    name="trainable_tokens",
    init=init,
    weight_form=weight_form,
    activation_form=activation_form,
    tensors={
        DELTA: Slot(lambda i: (len(i.option(INDICES)), _rows(i)[1]), peft=DELTA),
        # from the option (peft's config holds the indices): re-created on load
        INDICES: Slot(lambda i: (len(i.option(INDICES)),), buffer=True, integer=True),
    },
    options={
        INDICES: Option((), Check(_distinct_indices, "must be distinct token indices >= 0"), INDICES),
        "init_weights": Option(True, FLAG, "init_weights"),
    },
    default_alpha=1.0,
    # the merged table on an embedding (a lookup, as peft's), the form above on an output head
    kind_forms={"embedding": None, "linear": None, "conv1d": None},
)
# peft's TrainableTokens layer reads the head's ``in_features``, which GPT-2 ``Conv1D`` has not:
# peft fails building it on our file, so save_peft refuses those layers (save-peft-conv1d)
PEFT = PeftFormat(PeftMethod("TRAINABLE_TOKENS", fixed={}, refused=(), fan_in_fan_out=False), conv1d=False)
