"""A trainable-parameter summary, like peft's ``print_trainable_parameters``."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lora_func.adapter import AdapterLike
from lora_func.checks import check_model_and_adapter

__all__ = ["AdapterSummary", "LayerSummary", "adapter_summary"]


@dataclasses.dataclass(frozen=True)
class LayerSummary:
    """One adapted layer: ``part`` is the index inside a ``Composed``/``Combined`` (``None``
    for a plain adapter), ``trainable`` its trainable scalars."""

    module: str
    variant: str
    r: int
    trainable: int
    part: int | None = None


@dataclasses.dataclass(frozen=True)
class AdapterSummary:
    """``trainable`` adapter scalars, ``total`` = the model's parameters (tied ones once) plus
    ``trainable`` (peft's ``all params``), ``percent`` = 100 · trainable / total. ``str()``
    prints peft's line, and one line per layer when built with ``per_layer=True``. For a
    stack, the counts are one member's (``stack_shape`` says how many there are)."""

    trainable: int
    total: int
    stack_shape: tuple[int, ...]
    layers: tuple[LayerSummary, ...] | None = None

    @property
    def percent(self) -> float:
        return 100.0 * self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        # peft's format, so scripts and habits that read it keep working.
        line = f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable%: {self.percent:.4f}"
        if self.stack_shape:
            line += f" (per member of a stack of {self.stack_shape})"
        if self.layers is None:
            return line
        width = max((len(row.module) for row in self.layers), default=0)
        rows = [
            f"  {'' if row.part is None else f'[{row.part}] '}{row.module:<{width}}  {row.variant:<9} r={row.r:<3} {row.trainable:>12,}"
            for row in self.layers
        ]
        return "\n".join([line, *rows])


def _rows(adapter: AdapterLike, part: int | None) -> list[LayerSummary]:
    """A leaf's layers; a combinator's parts' rows (``part``: the top-level part index), then
    one row per tensor the combinator holds itself (``"(combine weights)"``)."""
    if not adapter.parts:  # a leaf Adapter
        return [
            LayerSummary(
                module=layer.target.module,
                variant=adapter.spec.variant,
                r=layer.info.r,
                trainable=sum(int(torch.Size(shape).numel()) for _, shape in layer.param_shapes),
                part=part,
            )
            for layer in adapter.layers
        ]
    rows = [row for i, p in enumerate(adapter.parts) for row in _rows(p, i if part is None else part)]
    for name, shape in adapter.own_shapes().items():
        rows.append(LayerSummary(f"({adapter.verb} {name})", adapter.verb, 0, int(torch.Size(shape).numel()), part))
    return rows


def adapter_summary(model: nn.Module, adapter: AdapterLike, *, per_layer: bool = False) -> AdapterSummary:
    """How many scalars ``adapter`` trains, and what share of ``model`` plus adapter that is.

    ``print(lf.adapter_summary(model, adapter))`` prints peft's
    ``trainable params: … || all params: … || trainable%: …``; ``per_layer=True`` adds one
    line per adapted layer (module, variant, rank, count). Reads nothing but shapes.
    """
    check_model_and_adapter(model, adapter, "adapter_summary")
    trainable = adapter.num_parameters()
    base = sum(p.numel() for p in model.parameters())  # tied tensors are yielded once
    rows = tuple(_rows(adapter, None)) if per_layer else None
    return AdapterSummary(trainable=int(trainable), total=int(base + trainable), stack_shape=adapter.stack_shape, layers=rows)
