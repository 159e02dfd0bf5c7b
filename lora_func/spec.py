"""AdapterSpec: the frozen, validated description of an adapter."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lora_func.variants import get_variant, resolve_options

__all__ = ["LAYER_TYPES", "TIED_POLICIES", "AdapterSpec"]

LAYER_TYPES = ("conv", "conv1d", "embedding", "grouped_conv", "linear", "norm")
TIED_POLICIES = ("error", "both")
_FLOAT_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}


@dataclasses.dataclass(frozen=True, init=False)
class AdapterSpec:
    """Which variant, on which layers, with which hyperparameters.

    Args:
      variant: a name from :func:`lora_func.list_variants`.
      targets: a ``str`` is an anchored regular expression matched (``re.fullmatch``)
        against module names (``"model.layers.0.self_attn.q_proj"``); a list of strings
        selects modules whose name equals an entry or ends with ``"." + entry``.
        ``"all-linear"`` (peft's shorthand): every ``nn.Linear`` / GPT-2 ``Conv1D`` but the
        output head. Modules of every kind of ``lora_func.targeting.KINDS`` can be named
        (``["embed_tokens", "q_proj"]``); the variant must adapt their kind (``Variant.kinds``).
        Empty (``[]``) only with ``target_parameters``.
      r: rank (``1 <= r <= min(d_in, d_out)`` of every target).
      alpha: scale numerator; ``None`` takes the variant's default (peft's, e.g. 8 for LoRA).
      dtype: dtype of the adapter tensors and of the low-rank computation (fp32 default on
        any base dtype; see docs/dtype.md).
      layer_types: ``None`` (default) adapts every matched module and raises if one is of no
        known kind; a tuple from ``("linear", "conv1d", "embedding", "conv", "grouped_conv", "norm")`` instead
        filters the matched modules to those kinds (``targets=".*", layer_types=("linear",)``
        is "every Linear").
      target_parameters: names of 3-D MoE expert parameters to adapt, one low-rank update per
        expert (peft's ``target_parameters``: a parameter's full name equal to an entry or
        ending with ``"." + entry``, e.g. ``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``).
      tied: what to do when a target's weight is tied to another name (GPT-2 ``lm_head`` is
        ``transformer.wte``): ``"error"`` (default) refuses; ``"both"`` adapts the shared
        tensor under every name, so the tied module (the embedding) sees the adapted weight.
      **options: variant options (e.g. ``use_rslora=True`` for LoRA); unknown names raise.
    """

    variant: str
    targets: str | tuple[str, ...]
    r: int
    alpha: float
    dtype: torch.dtype
    layer_types: tuple[str, ...] | None
    tied: str
    options: tuple[tuple[str, Any], ...]
    target_parameters: tuple[str, ...]

    def __init__(
        self,
        variant: str,
        targets: str | Sequence[str],
        r: int = 8,
        alpha: float | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        layer_types: Sequence[str] | None = None,
        tied: str = "error",
        target_parameters: Sequence[str] = (),
        **options: Any,
    ) -> None:
        var = get_variant(variant)
        if isinstance(target_parameters, str) or not isinstance(target_parameters, Sequence) or not all(
            isinstance(t, str) and t for t in target_parameters
        ):
            raise TypeError(  # error: spec-target-parameters
                f"AdapterSpec target_parameters must be a list of parameter names, got {target_parameters!r}; "
                f"e.g. target_parameters=['mlp.experts.gate_up_proj']"
            )
        target_parameters = tuple(target_parameters)
        targets = () if target_parameters and not isinstance(targets, str) and len(targets) == 0 else _normalise_targets(targets)
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"AdapterSpec r must be an integer >= 1, got r={r!r}")  # error: spec-rank
        if alpha is None:
            alpha = var.default_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"AdapterSpec alpha must be a number, got {alpha!r}")  # error: spec-alpha
        if not math.isfinite(alpha):
            # A NaN or inf scale turns every output NaN (or, through SDPA, finite but wrong).
            raise ValueError(f"AdapterSpec alpha must be a finite number, got alpha={alpha!r}; pass e.g. alpha=2*r, or None for the default")  # error: spec-alpha-finite
        if isinstance(dtype, str):
            dtype = _FLOAT_DTYPES.get(dtype.removeprefix("torch."), dtype)
        if dtype not in _FLOAT_DTYPES.values():
            raise TypeError(f"AdapterSpec dtype must be a floating dtype ({', '.join(_FLOAT_DTYPES)}), got {dtype!r}")  # error: spec-dtype
        if layer_types is not None:
            if isinstance(layer_types, str) or not isinstance(layer_types, Sequence):
                raise TypeError(  # error: spec-layer-types-type
                    f"AdapterSpec layer_types must be a tuple of kinds from {list(LAYER_TYPES)} or None, got "
                    f"{layer_types!r}; e.g. layer_types=('linear',)"
                )
            layer_types = tuple(layer_types)
            bad = [kind for kind in layer_types if kind not in LAYER_TYPES]
            if bad or not layer_types:
                raise ValueError(f"AdapterSpec layer_types {bad or list(layer_types)} invalid; choose from {list(LAYER_TYPES)}")  # error: spec-layer-types
        if tied not in TIED_POLICIES:
            raise ValueError(f"AdapterSpec tied={tied!r} is not one of {list(TIED_POLICIES)}")  # error: spec-tied
        # One place validates the options (the variant's option schema), as for peft configs.
        resolved = resolve_options(variant, var.options, options, var.check)
        set_ = object.__setattr__
        set_(self, "variant", variant)
        set_(self, "targets", targets)
        set_(self, "r", r)
        set_(self, "alpha", float(alpha))
        set_(self, "dtype", dtype)
        set_(self, "layer_types", layer_types)
        set_(self, "tied", tied)
        set_(self, "options", tuple(sorted(resolved.items())))
        set_(self, "target_parameters", target_parameters)

    def option(self, name: str) -> Any:
        return dict(self.options)[name]

    def to_json(self) -> str:
        """A JSON string from which :meth:`from_json` rebuilds an equal spec."""
        data = {
            "variant": self.variant,
            "targets": self.targets if isinstance(self.targets, str) else list(self.targets),
            "r": self.r,
            "alpha": self.alpha,
            "dtype": str(self.dtype).removeprefix("torch."),
            "layer_types": None if self.layer_types is None else list(self.layer_types),
            "tied": self.tied,
            "options": dict(self.options),
        }
        if self.target_parameters:  # written only when set: older files stay byte-identical
            data["target_parameters"] = list(self.target_parameters)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AdapterSpec:
        data = json.loads(text)
        return cls(
            data["variant"],
            data["targets"],
            r=data["r"],
            alpha=data["alpha"],
            dtype=data["dtype"],
            layer_types=data["layer_types"],
            tied=data["tied"],
            target_parameters=data.get("target_parameters", ()),
            **data["options"],
        )


def _normalise_targets(targets: str | Sequence[str] | Mapping[str, Any]) -> str | tuple[str, ...]:
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as err:
            raise ValueError(f"AdapterSpec targets {targets!r} is not a valid regular expression: {err}") from None  # error: spec-targets-regex
        return targets
    if isinstance(targets, Mapping) or not isinstance(targets, Sequence):
        raise TypeError(f"AdapterSpec targets must be a regex string or a list of module names, got {type(targets).__name__}")  # error: spec-targets-type
    names = tuple(targets)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"AdapterSpec targets must be a non-empty list of non-empty strings, got {list(names)!r}")  # error: spec-targets-empty
    return names
