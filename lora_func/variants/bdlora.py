"""BD-LoRA (block-diagonal LoRA), peft's ``LoraConfig(use_bdlora=BdLoraConfig(...))``: LoRA whose
``A`` or ``B`` is block-diagonal with ``nblocks`` blocks, so that a tensor-parallel server can
apply each shard's part of the adapter without gathering it (a row-sharded layer with ``A``
block-diagonal, a column-sharded one with ``B``).

``side="a"``: ``lora_A (r, d_in/k)`` holds the ``k`` diagonal blocks of ``A (r, d_in)`` stacked
(block ``i`` maps input chunk ``i`` to rank chunk ``i``; peft's ``BlockDiagonalLinear``),
``lora_B (d_out, r)`` whole. ``side="b"``: ``lora_A (r, d_in)`` whole, ``lora_B (d_out, r/k)`` the
``k`` blocks of ``B (d_out, r)``. ``W_eff = W + s·B A`` with the whole block-diagonal matrices,
bias unchanged, ``s = alpha/r`` (``alpha/√r`` with ``use_rslora``); ``k`` divides ``r`` and the
block-diagonal factor's feature size. Init as peft's (its draws in its order): LoRA's ``A``
(kaiming-uniform ``a=√5``, drawn and, on side ``a``, replaced by the block-diagonal draw
kaiming-uniform ``a=0`` of fan-in ``d_in/k``), ``B = 0``.

One block-diagonal factor per adapter: peft picks it per target by module name
(``target_modules_bd_a`` / ``_bd_b``), which a variant's per-layer facts (``LayerInfo``) do not
carry; the usual serving layout (q, k, v, up, gate one way, o and down the other) is the
composition of two ``bdlora`` adapters. ``save_peft`` writes ``target_modules_bd_a=[""]`` (or
``_bd_b``), peft's pattern that every target name contains; ``load_peft`` reads a checkpoint
whose every target has the same factor block-diagonal (one list set, ``match_strict``). The
factors' rank axes hold the blocks, so adapters of different ranks do not stack (one rank does).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import BaseLayer, Codec, LayerInfo, Option, Slot, TensorDict, lora, one_of, whole
from lora_func.variants._kernels import kaiming_uniform, lora_activation_form, lora_weight_form


def block_diagonal(blocks: Tensor, nblocks: int) -> Tensor:
    """``blocks (p, q)``, ``k = nblocks`` blocks of ``p/k`` rows stacked, as the block-diagonal
    ``(p, k·q)`` matrix (peft's ``weight_as_blockdiagonal_matrix``)."""
    p, q = blocks.shape
    eye = torch.eye(nblocks, dtype=blocks.dtype, device=blocks.device)
    return (blocks.reshape(nblocks, p // nblocks, 1, q) * eye[:, None, :, None]).reshape(p, nblocks * q)


def _whole(params: TensorDict, info: LayerInfo) -> TensorDict:
    """The layer's factors as LoRA's whole ``A (r, d_in)`` and ``B (d_out, r)``."""
    k, side = info.option("nblocks"), info.option("side")
    a, b = params["lora_A"], params["lora_B"]
    return {"lora_A": block_diagonal(a, k) if side == "a" else a, "lora_B": block_diagonal(b, k) if side == "b" else b}


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    r, k, side = info.r, info.option("nblocks"), info.option("side")
    split = info.d_in if side == "a" else info.d_out
    if isinstance(r, int) and (r % k or split % k):
        raise ValueError(  # error: bdlora-blocks
            f"bdlora: nblocks={k} must divide r={r} and the block-diagonal factor's {'d_in' if side == 'a' else 'd_out'}={split}; "
            f"pick nblocks dividing both (peft's BlockDiagonalLinear needs it too)"
        )
    lora_a = kaiming_uniform((r, info.d_in), a=math.sqrt(5), generator=generator)  # LoRA's A, peft's first draw
    if side == "a":
        lora_a = kaiming_uniform((r, info.d_in // k), a=0.0, generator=generator)  # peft's BlockDiagonalLinear draw
    lora_b = torch.zeros((info.d_out, r // k if side == "b" else r))
    return {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}, {}


def weight_form(
    params: TensorDict, buffers: TensorDict, weight: Tensor, bias: Tensor | None, info: LayerInfo
) -> tuple[Tensor, Tensor | None]:
    return lora_weight_form(_whole(params, info), buffers, weight, bias, info)


def activation_form(params: TensorDict, buffers: TensorDict, x: Tensor, base: BaseLayer, info: LayerInfo) -> Tensor:
    """LoRA's form on the whole factors (an ``(r, d)``-sized block-diagonal matrix built per call):
    the low-rank path costs what LoRA's does."""
    return lora_activation_form(_whole(params, info), buffers, x, base, info)


def _side_to_peft(side: str) -> dict[str, Any]:
    # "" is in every module name: peft's substring match puts every target on that side.
    return {"target_modules_bd_a": [""] if side == "a" else None, "target_modules_bd_b": [""] if side == "b" else None, "match_strict": True}


def _side_from_peft(config: Any) -> Any:
    if config is None:  # peft writes null when BD-LoRA is off: the default
        return "a"
    if not isinstance(config, dict):
        return config  # refused by the option's check, naming the field
    return "a" if config.get("target_modules_bd_a") else "b"


def uniform_bdlora(config: Any) -> bool:
    """A ``use_bdlora`` config that makes one factor block-diagonal on every target: one pattern
    list set and ``match_strict`` (peft then refused any target the list does not match)."""
    return (
        isinstance(config, dict)
        and bool(config.get("target_modules_bd_a")) != bool(config.get("target_modules_bd_b"))
        and config.get("match_strict", True) is True
    )


VARIANT = lora.derived(
    "bdlora",
    init,
    weight_form=weight_form,
    activation_form=activation_form,
    # the rank axes hold the blocks (a zero-padded rank would shift them): no rank axes
    tensors={
        "lora_A": Slot(lambda i: (i.r, i.d_in // i.option("nblocks") if i.option("side") == "a" else i.d_in), peft="lora_A.weight"),
        "lora_B": Slot(lambda i: (i.d_out, i.r // i.option("nblocks") if i.option("side") == "b" else i.r), peft="lora_B.weight"),
    },
    # "side" first: its codec writes use_bdlora whole, nblocks then goes into it
    options={
        "side": Option("a", one_of("a", "b"), "use_bdlora", Codec(_side_to_peft, _side_from_peft)),
        "nblocks": Option(1, whole(1, why="the number of diagonal blocks: the tensor-parallel degree of serving"), "use_bdlora.nblocks"),
        **lora.OPTIONS,
    },
    low_rank=None,  # compact factors: not the LowRank (r, d_in) / (d_out, r) pair
)
# peft's BD-LoRA reads `in_features` of the base layer, which GPT-2 Conv1D has not: it cannot build one there.
PEFT = lora.stored_as_lora(reads=lora.plain_reads(use_bdlora=uniform_bdlora), conv1d=False)
