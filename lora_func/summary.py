"""A trainable-parameter summary, like peft's ``print_trainable_parameters``."""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from lora_func.adapter import Adapter, AdapterLike, leaves
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
    # A targets entry that matched modules of more than one kind, by peft's suffix rule:
    # (entry, the module names it matched with layer indices as "*"), e.g. GPT-2's "c_proj"
    # -> ("transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj").
    broad_targets: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def percent(self) -> float:
        return 100.0 * self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        # peft's format, so scripts and habits that read it keep working.
        line = f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable%: {self.percent:.4f}"
        if self.stack_shape:
            line += f" (per member of a stack of {self.stack_shape})"
        for entry, kinds in self.broad_targets:
            line += (
                f"\nnote: targets entry {entry!r} adapts {len(kinds)} kinds of module: {', '.join(kinds)} (a name matches "
                f"every module whose name ends with it, as in peft; name a longer suffix, e.g. {_longer(entry, kinds[0])!r}, "
                f"for one)"
            )
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
    if isinstance(adapter, Adapter):  # a leaf
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


def _longer(entry: str, pattern: str) -> str:
    """``entry`` with the part of ``pattern`` just before it: ``"attn.c_proj"`` for ``"c_proj"``."""
    before = pattern[: -len(entry) - 1].rsplit(".", 1)[-1] if pattern.endswith("." + entry) else ""
    return f"{before}.{entry}" if before and before != "*" else entry


def _broad_targets(adapter: AdapterLike) -> tuple[tuple[str, tuple[str, ...]], ...]:
    found: dict[str, set[str]] = {}
    for _, leaf in leaves(adapter):
        if isinstance(leaf.spec.targets, str):  # a regex or "all-linear": the user asked for a pattern
            continue
        for layer in leaf.layers:
            module = layer.target.module
            for entry in leaf.spec.targets:
                if module == entry or module.endswith("." + entry):
                    found.setdefault(entry, set()).add(re.sub(r"\.\d+(?=\.|$)", ".*", module))
    return tuple((entry, tuple(sorted(kinds))) for entry, kinds in sorted(found.items()) if len(kinds) > 1)


def _logical_numel(parameter: torch.Tensor) -> int:
    """The scalars a parameter stands for: a bitsandbytes 4-bit weight packs two values per
    byte of its storage, so its ``numel()`` is a fraction of the weight's (peft counts it as
    ``numel · 2 · itemsize``; the quantization state records the weight's own shape, the same
    number). Int8 weights and torchao's NF4 tensors report their logical ``numel`` already."""
    if type(parameter).__name__ == "Params4bit":
        shape = getattr(getattr(parameter, "quant_state", None), "shape", None)
        if shape is not None:
            return int(torch.Size(shape).numel())
        return parameter.numel() * 2 * parameter.element_size()
    return parameter.numel()


def adapter_summary(model: nn.Module, adapter: AdapterLike, *, per_layer: bool = False) -> AdapterSummary:
    """How many scalars ``adapter`` trains, and what share of ``model`` plus adapter that is.

    ``print(lf.adapter_summary(model, adapter))`` prints peft's
    ``trainable params: … || all params: … || trainable%: …``; ``per_layer=True`` adds one
    line per adapted layer (module, variant, rank, count). Reads nothing but shapes.
    """
    check_model_and_adapter(model, adapter, "adapter_summary")
    trainable = adapter.num_parameters()
    base = sum(_logical_numel(p) for p in model.parameters())  # tied tensors are yielded once
    rows = tuple(_rows(adapter, None)) if per_layer else None
    return AdapterSummary(
        trainable=int(trainable), total=int(base + trainable), stack_shape=adapter.stack_shape, layers=rows,
        broad_targets=_broad_targets(adapter),
    )
