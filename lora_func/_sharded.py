"""Bases sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): what lora_func must know.

FSDP2 turns each managed parameter into a ``DTensor`` holding this rank's shard, and around
each sharded module's forward it all-gathers the shards into a plain unsharded parameter,
installs it on the module for the call, and frees it afterwards (``reshard_after_forward``),
gathering again in backward. So:

- a parameter dict cannot stand in for a managed weight: FSDP2's pre-forward hook installs its
  gathered weight over whatever was put there, and swapping its parameters (sharded, or
  unsharded between forward and backward with ``reshard_after_forward=False``) and putting them
  back later undoes its own swaps. So on a model with any ``fully_shard``-ed module lora_func
  reparametrizes no parameter at all and adapts every target at the module's call (route
  ``"module"``), where the module holds the gathered weight;
- anything that needs a target's whole weight outside a forward (``init_adapter``'s DoRA
  norms, PiSSA's SVD, fingerprints) gathers it with ``full_tensor()``, a collective that every
  rank must reach in the same order -- one target at a time, so no more than one whole weight
  is held at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

__all__ = ["check_sharded_frozen", "full_tensor", "is_fsdp_model", "is_sharded", "sharded_keys", "swapped_on"]


_UNRESOLVED = object()
_TYPES: dict[str, Any] = {"DTensor": _UNRESOLVED, "FSDPModule": _UNRESOLVED}


def _distributed_type(name: str) -> type | None:
    """``torch.distributed``'s ``DTensor`` or ``FSDPModule`` (``None`` without distributed support),
    imported once: ``is_sharded`` runs at every target call of the module route. A plain dict,
    not ``functools.cache``, which dynamo refuses to trace under ``torch.compile``."""
    found = _TYPES[name]
    if found is _UNRESOLVED:
        found = None
        if torch.distributed.is_available():
            from torch.distributed.fsdp import FSDPModule
            from torch.distributed.tensor import DTensor

            found = {"DTensor": DTensor, "FSDPModule": FSDPModule}[name]
        _TYPES[name] = found
    return found


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter FSDP2 manages, outside its module's forward)."""
    dtensor = _distributed_type("DTensor")
    return dtensor is not None and isinstance(t, dtensor)


def full_tensor(t: Tensor) -> Tensor:
    """``t`` whole: a ``DTensor`` all-gathered (a collective: every rank must call it, in the same
    order), anything else as it is."""
    return cast(Any, t).full_tensor() if is_sharded(t) else t  # a DTensor


def is_fsdp_model(modules: Mapping[str, nn.Module]) -> bool:
    """Whether any module (``dict(model.named_modules())``) was ``fully_shard``-ed."""
    fsdp_module = _distributed_type("FSDPModule")
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in modules.values())


def sharded_keys(base: Mapping[str, Tensor]) -> set[str]:
    """The names in ``base`` whose tensor is sharded."""
    return {name for name, t in base.items() if is_sharded(t)}


def check_sharded_frozen(modules: Mapping[str, nn.Module], where: str) -> None:
    """On a model sharded by FSDP2, raise when a parameter requires grad: lora_func does not
    detach FSDP2's parameters (it must not swap them), so backward would fill their ``.grad``
    (and FSDP2 would reduce-scatter it every step) while only the adapter trains.

    ``modules``: ``dict(model.named_modules())``."""
    if not is_fsdp_model(modules):
        return
    trainable = sorted(
        f"{name}.{pname}" if name else pname
        for name, module in modules.items()
        for pname, p in module._parameters.items()
        if p is not None and p.requires_grad
    )
    if trainable:
        raise ValueError(  # error: fsdp-base-trainable
            f"{where}: the model is sharded by FSDP2 and its parameters {trainable[:4]}"
            f"{f' (and {len(trainable) - 4} more)' if len(trainable) > 4 else ''} require grad, so backward would "
            f"compute and reduce-scatter base gradients while only the adapter trains; freeze the base with "
            f"model.requires_grad_(False) (before or after fully_shard)"
        )


def swapped_on(params: Mapping[str, Tensor], modules: Mapping[str, nn.Module], fsdp: bool, where: str) -> Mapping[str, Tensor]:
    """What an :class:`lora_func._application.Application` may swap into the model: ``params``,
    or nothing on a model sharded by FSDP2 (``fsdp``), whose base must then be frozen
    (:func:`check_sharded_frozen`): FSDP2 swaps its own parameters at each module's call."""
    if not fsdp:
        return params
    check_sharded_frozen(modules, where)
    return {}
