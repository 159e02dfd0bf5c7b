"""LoRA (Hu et al. 2021, arXiv 2106.09685), with the rsLoRA scale (arXiv 2312.03732).

Trainable ``lora_A (r, d_in)`` and ``lora_B (d_out, r)``;
``y = x Wᵀ + b + s · (x Aᵀ) Bᵀ``, ``W_eff = W + s·B A``, ``s = alpha/r`` (or
``alpha/sqrt(r)`` with ``use_rslora``). Init as peft: ``A ~ kaiming_uniform(a=√5)``
(or ``N(0, 1/r²)`` with ``init="gaussian"``), ``B = 0``; on an ``nn.Embedding`` peft's
``A = 0``, ``B ~ N(0, 1)``.

The LoRA family derives from this file (:func:`derived`): PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA,
MiCA, EVA and KaSA are LoRA with their own init (and, where they keep a residual, its buffer),
stored in peft's format as a ``LoraConfig`` marked by their ``init_lora_weights``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lora_func.variants import (
    LayerInfo,
    LowRank,
    Option,
    PeftFormat,
    PeftMethod,
    Slot,
    TensorDict,
    Variant,
    mapped,
    one_of,
)
from lora_func.variants._kernels import kaiming_uniform, lora_activation_form, lora_embedding_form, lora_scale, lora_weight_form
from lora_func.variants._options import dropout_option

INITS = ("kaiming", "gaussian", "orthogonal", "random")

# The options every variant of the family has, under peft's LoraConfig names.
OPTIONS = {"use_rslora": Option(False, peft="use_rslora"), "dropout": dropout_option("lora_dropout")}

# lora_A (r, d_in), lora_B (d_out, r); peft's lora.Embedding names them lora_embedding_A / _B.
TENSORS = {
    "lora_A": Slot(lambda i: (i.r, i.d_in), rank_axes=(0,), peft={"": "lora_A.weight", "embedding": "lora_embedding_A"}),
    "lora_B": Slot(lambda i: (i.d_out, i.r), rank_axes=(1,), peft={"": "lora_B.weight", "embedding": "lora_embedding_B"}),
}

# ------------------------------------------------------------------ peft's format (LoraConfig)

# LoraConfig fields lora_func has no equivalent for: any truthy value is refused.
# (layer_replication: read onto lora_func.replication.replicated, see load_peft)
PEFT_UNSUPPORTED_FIELDS = ("arrow_config", "trainable_token_indices", "modules_to_save", "megatron_config")
# LoRA inits that leave the base untouched: the checkpoint is a plain LoRA on the original base.
PLAIN_INITS = (True, False, "gaussian", "orthogonal")
# LoraConfig fields that make a checkpoint another variant's (each read by exactly one variant
# file): a plain LoRA checkpoint has none of them set (a field the config lacks reads as unset).
VARIANT_FIELDS = ("alora_invocation_tokens", "kasa_config", "lora_bias", "monteclora_config", "use_bdlora", "use_qalora", "velora_config")


def _unset(value: Any) -> bool:
    return not value


def _absent(value: Any) -> bool:
    return value is None


def plain_reads(**marks: Any) -> dict[str, Any]:
    """The ``PeftFormat.reads`` of a LoRA checkpoint with a plain init, no DoRA and none of
    :data:`VARIANT_FIELDS` set, with ``marks`` (a variant's own fields) replacing those entries.
    ``alora_invocation_tokens`` is unset only when absent: an empty list (which peft takes as no
    aLoRA) is an aLoRA on every token, read by ``alora``."""
    unset = dict.fromkeys(VARIANT_FIELDS, _unset) | {"alora_invocation_tokens": _absent}
    return {"use_dora": False, "init_lora_weights": PLAIN_INITS} | unset | marks


def _unread(config: Mapping[str, Any]) -> str:
    """Why no variant reads a LoraConfig: it combines variant fields, its BD-LoRA config is not
    one factor on every target, or an init changed peft's base weights."""
    combined = [field for field in ("use_dora", *VARIANT_FIELDS) if config.get(field)]
    if len(combined) > 1:
        return (
            f"it combines {combined}, each its own lora_func variant (read one at a time); retrain with one of them, or "
            f"merge the adapter in peft (merge_and_unload) and use the merged model"
        )
    if config.get("use_bdlora"):
        return (
            f"its use_bdlora={config['use_bdlora']!r} makes A block-diagonal on some targets and B (or nothing, "
            f"match_strict=false) on others, by module name; lora_func's bdlora has one block-diagonal factor on every "
            f"target of an adapter (compose two for both): merge the adapter in peft (merge_and_unload) instead"
        )
    return _converted_init(config)


def _converted_init(config: Mapping[str, Any]) -> str:
    init, use_dora = config.get("init_lora_weights", True), bool(config.get("use_dora", False))
    return (
        f"it was initialised with init_lora_weights={init!r}{' and use_dora' if use_dora else ''}: peft changed "
        f"its base weights for it, so the checkpoint is relative to a base lora_func does not have; save it in peft with "
        f"save_pretrained(..., path_initial_model_for_weight_conversion=<dir of the initial adapter>) to get a "
        f"plain LoRA on the original base"
    )


# Every variant that peft stores as a LoraConfig shares this method; the fixed fields are what a
# plain LoRA writes, and what a config that lacks them means.
PEFT_METHOD = PeftMethod(
    "LORA",
    {"bias": "none", "use_dora": False, "init_lora_weights": True, "eva_config": None},
    PEFT_UNSUPPORTED_FIELDS,
    rank=("r", "rank_pattern"),
    alpha="lora_alpha",
    unread=_unread,
)


def _reshape(kind: str, name: str, tensor: Tensor, shape: tuple[int, ...], to_peft: bool) -> Tensor:
    """A tensor in peft's shape on a target of ``kind`` with stored weight ``shape`` and back: on a
    conv, ``lora_A (r, in·prod(k)) <-> (r, in, *k)`` (a conv with the base kernel) and ``lora_B
    (out, r) <-> (out, r, 1, ...)`` (a 1x1 conv); on an expert parameter ``(E, ·, ·)``, peft's
    ``lora_A (r·E, d_in)`` (expert-major rows) and ``lora_B (d_out, r·E)`` (expert-minor
    columns). A tensor of another shape comes back unchanged (the loader's shape check names it)."""
    if kind == "conv":
        if to_peft:
            return tensor.reshape(tensor.shape[0], *shape[1:]) if name == "lora_A" else tensor.reshape(*tensor.shape, *[1] * (len(shape) - 2))
        fits = tuple(tensor.shape[1:]) == tuple(shape[1:]) if name == "lora_A" else tuple(tensor.shape[2:]) == (1,) * (len(shape) - 2)
        return tensor.flatten(1) if fits else tensor
    if kind == "experts":
        if to_peft:
            return tensor.reshape(-1, tensor.shape[-1]) if name == "lora_A" else tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)
        experts = shape[0]
        if tensor.dim() == 2 and name == "lora_A" and tensor.shape[0] % experts == 0:
            return tensor.reshape(experts, -1, tensor.shape[-1])
        if tensor.dim() == 2 and name == "lora_B" and tensor.shape[1] % experts == 0:
            return tensor.reshape(tensor.shape[0], -1, experts).permute(2, 0, 1)
    return tensor


PEFT = PeftFormat(
    PEFT_METHOD,
    reads=plain_reads(),
    reshape=_reshape,
)


def stored_as_lora(**changes: Any) -> PeftFormat:
    """A LoRA-family variant's peft format: LoRA's, with ``changes`` (its ``reads`` and
    ``writes``, a conversion)."""
    return dataclasses.replace(PEFT, reshape=None, **changes)


# The activation form is base(x) + s·(dropout(x) Aᵀ) Bᵀ (lora_activation_form).
LOW_RANK = LowRank("lora_A", "lora_B", lora_scale)


def init(
    weight: Tensor,
    bias: Tensor | None,
    info: LayerInfo,
    *,
    dtype: torch.dtype,
    generator: torch.Generator,
    calibration: Any = None,
) -> tuple[TensorDict, TensorDict]:
    """peft's LoRA init: ``A ~ kaiming_uniform(a=√5)`` (``N(0, 1/r²)`` with ``init="gaussian"``,
    :func:`orthogonal_init` with ``"orthogonal"``), ``B = 0``; on an embedding (kaiming or
    gaussian) peft's ``A = 0``, ``B ~ N(0, 1)``; a derived variant without the ``init`` option
    gets the kaiming one."""
    r, d_in, d_out = info.r, info.d_in, info.d_out
    chosen = dict(info.options).get("init", "kaiming")
    if info.kind == "embedding" and chosen in ("kaiming", "gaussian"):
        # peft's embedding init whatever init_lora_weights (an nn.Embedding's own): A = 0, B ~ N(0, 1)
        lora_b = torch.randn((d_out, r), generator=generator, dtype=torch.float32)
        return {"lora_A": torch.zeros((r, d_in), dtype=dtype, device=weight.device), "lora_B": lora_b.to(weight.device, dtype)}, {}
    if chosen == "random":
        return _random_init(weight, info, dtype=dtype, generator=generator)
    if chosen == "gaussian":
        lora_a = torch.randn((r, d_in), generator=generator, dtype=torch.float32) / r
    elif chosen == "orthogonal":
        return orthogonal_init(weight, info, dtype=dtype, generator=generator)
    else:
        lora_a = kaiming_uniform((r, d_in), a=math.sqrt(5), generator=generator)
    lora_b = torch.zeros((d_out, r), dtype=torch.float32)
    params = {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}
    return params, {}


def _random_init(weight: Tensor, info: LayerInfo, *, dtype: torch.dtype, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """peft's ``init_lora_weights=False`` (a debugging init: ``B A ≠ 0``, the adapter changes the
    model from the start): both factors as their layers' constructors draw them, ``A`` then ``B``:
    on an embedding ``N(0, 1)``, elsewhere the layers' ``kaiming_uniform(a=√5)`` (``B``'s fan-in is ``r``)."""
    r, d_in, d_out = info.r, info.d_in, info.d_out
    if info.kind == "embedding":
        lora_a = torch.randn((r, d_in), generator=generator, dtype=torch.float32)
        lora_b = torch.randn((d_out, r), generator=generator, dtype=torch.float32)
    else:
        lora_a = kaiming_uniform((r, d_in), a=math.sqrt(5), generator=generator)
        lora_b = kaiming_uniform((d_out, r), a=math.sqrt(5), generator=generator)
    return {"lora_A": lora_a.to(weight.device, dtype), "lora_B": lora_b.to(weight.device, dtype)}, {}


def orthogonal_init(weight: Tensor, info: LayerInfo, *, dtype: torch.dtype, generator: torch.Generator) -> tuple[TensorDict, TensorDict]:
    """peft's ``init_lora_weights="orthogonal"`` (its draws in its order): ``Q = qr(N(0, 1)^{r×r})``,
    ``A = (N^{d_in×r/2} Q[0::2])ᵀ / 10``, ``B = (N^{r/2×d_out})ᵀ Q[1::2] / 10``; ``B A = 0`` (the rows
    of ``Q`` are orthonormal) up to round-off, with both factors non-zero. ``r`` even."""
    r = info.r
    if isinstance(r, int) and r % 2:
        raise ValueError(f"lora option init='orthogonal' needs an even rank (A and B take alternate rows of one orthogonal matrix), got r={r}")  # error: lora-orthogonal-odd-r
    q, _ = torch.linalg.qr(torch.randn((r, r), generator=generator))
    lora_a = torch.randn((info.d_in, r // 2), generator=generator).mm(q[0::2, :]).T / 10.0
    lora_b = torch.randn((r // 2, info.d_out), generator=generator).T.mm(q[1::2, :]) / 10.0
    return {"lora_A": lora_a.contiguous().to(weight.device, dtype), "lora_B": lora_b.contiguous().to(weight.device, dtype)}, {}


VARIANT = Variant(
    name="lora",
    init=init,
    weight_form=lora_weight_form,
    activation_form=lora_activation_form,
    tensors=TENSORS,
    options={
        **OPTIONS,
        "init": Option("kaiming", one_of(*INITS), "init_lora_weights", mapped({"kaiming": True, "gaussian": "gaussian", "orthogonal": "orthogonal", "random": False})),
    },
    default_alpha=8.0,
    low_rank=LOW_RANK,
    # The merged path serves every kind; peft has LoRA on all of these (nn.Embedding, conv
    # layers, target_parameters) but norms. An embedding takes a gather, not a merged (V, d) table.
    kind_forms={
        "linear": None, "conv1d": None, "embedding": lora_embedding_form, "conv": None, "experts": None, "parameter": None, "mha": None,
    },
)


def derived(name: str, init: Any, **changes: Any) -> Variant:
    """A LoRA-family variant: LoRA's forms, tensors and options on ``nn.Linear`` / GPT-2
    ``Conv1D``, with its own ``name`` and ``init`` and ``changes`` (more options, a residual
    buffer, its own forms and traits)."""
    return dataclasses.replace(VARIANT, **{"name": name, "init": init, "options": OPTIONS, "kind_forms": {"linear": None, "conv1d": None}, **changes})
