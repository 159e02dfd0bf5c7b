"""Which modules of a model are targets, their layout, and tied weights.

``nn.Linear`` stores ``(d_out, d_in)`` and computes ``F.linear(x, W, b)``; transformers'
GPT-2 ``Conv1D`` stores ``(d_in, d_out)`` and computes ``addmm(b, x, W)``. Variants only
ever see the canonical ``(d_out, d_in)`` view; the layout is recorded per target here and
never changes what the user asked for.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable

from torch import Tensor, nn

from lora_func.quantized import logical_shape
from lora_func.spec import AdapterSpec

__all__ = ["ALL_LINEAR", "Target", "canonical_weight", "find_targets", "layer_kind", "output_head", "stored_weight", "tensor_names"]

# peft's shorthand, with peft's meaning: every nn.Linear / GPT-2 Conv1D except the output head.
ALL_LINEAR = "all-linear"
# Appended to "matches nothing" errors: users coming from peft often only know its shorthand.
_HINT = (
    f"targets={ALL_LINEAR!r} adapts every Linear/Conv1D but the output head, and "
    f"targets='.*' with layer_types=('linear',) every Linear"
)


@dataclasses.dataclass(frozen=True)
class Target:
    """One adapted layer (static data: part of an adapter's pytree context).

    Attributes:
      module: the module's name in the model.
      weight_key / bias_key: the parameter names the overlays replace or read.
      layout: ``"linear"`` (stored ``(d_out, d_in)``) or ``"conv1d"`` (stored ``(d_in, d_out)``).
      d_in / d_out: feature sizes.
      tied_keys: every other name of the same weight tensor (only with ``tied="both"``).
    """

    module: str
    weight_key: str
    bias_key: str | None
    layout: str
    d_in: int
    d_out: int
    tied_keys: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"tied_keys": list(self.tied_keys)}

    @classmethod
    def from_dict(cls, data: dict) -> Target:
        return cls(**(data | {"tied_keys": tuple(data["tied_keys"])}))


def layer_kind(module: nn.Module) -> str | None:
    """``"linear"``, ``"conv1d"`` (transformers' GPT-2 Conv1D) or ``None``."""
    if isinstance(module, nn.Linear):
        return "linear"
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return "conv1d" if isinstance(module, Conv1D) else None


def canonical_weight(weight: Tensor, layout: str) -> Tensor:
    """The ``(d_out, d_in)`` view of a stored weight (no copy)."""
    return weight.T if layout == "conv1d" else weight


def stored_weight(weight: Tensor, layout: str) -> Tensor:
    """Back from canonical ``(d_out, d_in)`` to the layout the model stores."""
    return weight.T if layout == "conv1d" else weight


def tensor_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> every name it has`` (tied weights have several), over params and buffers."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(buffer), []).append(name)
    return names


def output_head(model: nn.Module) -> str | None:
    """The name of the model's output head (transformers' ``get_output_embeddings()``, e.g.
    ``"lm_head"``), or ``None`` for a model without one."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        return None
    return next((name for name, module in model.named_modules() if module is head), None)


def _matches(name: str, targets: str | tuple[str, ...]) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def close_names(wanted: Iterable[str], pool: Iterable[str]) -> list[str]:
    """The names of ``pool`` close to any of ``wanted`` (for "did you mean" lists in errors)."""
    choices = sorted(set(pool))
    close: set[str] = set()
    for w in wanted:
        close.update(difflib.get_close_matches(w, choices, n=5, cutoff=0.5))
    return sorted(close)


def _module_name_pool(names: list[str]) -> set[str]:
    # Full module names and their last parts: a spec may name "q_proj" or "layers.0.q_proj".
    return set(names) | {n.rsplit(".", 1)[-1] for n in names}


def _did_you_mean(wanted: list[str], modules: list[tuple[str, nn.Module]]) -> str:
    """The module names close to ``wanted``, or, when none is, the names of the layers that
    can be adapted (a list to pick from instead of "none")."""
    close = close_names(wanted, _module_name_pool([name for name, _ in modules]))
    if close:
        return f"close module names: {close}"
    adaptable = sorted({name.rsplit(".", 1)[-1] for name, module in modules if layer_kind(module) is not None})
    shown = f"{adaptable[:20]}{' ...' if len(adaptable) > 20 else ''}" if adaptable else "none (no nn.Linear or Conv1D)"
    return f"no module name is close; the layers it can adapt are named {shown}"


def find_targets(model: nn.Module, spec: AdapterSpec) -> list[Target]:
    """The targets of ``spec`` in ``model``, in module order; raises before touching anything.

    ``spec.targets == "all-linear"`` is peft's shorthand: every ``nn.Linear`` and GPT-2
    ``Conv1D`` except the output head (:func:`output_head`); ``layer_types`` still filters.

    Raises ``ValueError`` when nothing matches (listing close module names), when a matched
    module is neither ``nn.Linear`` nor GPT-2 ``Conv1D`` (unless ``layer_types`` filters),
    when a list entry matches nothing, or when a target's weight is tied and ``tied="error"``.
    """
    modules = [(name, module) for name, module in model.named_modules() if name]
    module_names = [name for name, _ in modules]
    if spec.targets == ALL_LINEAR:
        # peft's "all-linear": the output head stays frozen (it is usually tied to the input
        # embedding, and adapting it is rarely wanted); modules of other kinds are not matched.
        head = output_head(model)
        matched = [(n, m) for n, m in modules if n != head and layer_kind(m) is not None]
        if not matched:
            raise ValueError(  # error: target-all-linear-none
                f"targets={ALL_LINEAR!r} found no nn.Linear or transformers Conv1D in {type(model).__name__} "
                f"(besides the output head {head!r}); name the layers to adapt in `targets` instead"
            )
    else:
        matched = [(name, module) for name, module in modules if _matches(name, spec.targets)]
    if not isinstance(spec.targets, str):
        unmatched = [t for t in spec.targets if not any(n == t or n.endswith("." + t) for n in module_names)]
        if unmatched:
            raise ValueError(  # error: target-list-unmatched
                f"target(s) {sorted(unmatched)} match no module of {type(model).__name__}; "
                f"{_did_you_mean(unmatched, modules)}; {_HINT}"
            )
    if not matched:
        raise ValueError(  # error: target-pattern-unmatched
            f"target pattern {spec.targets!r} matches no module of {type(model).__name__} "
            f"(the pattern must match the whole name, e.g. r'.*\\.q_proj'); "
            f"{_did_you_mean([spec.targets], modules)}; {_HINT}"  # type: ignore[list-item]
        )
    kinds = [(name, module, layer_kind(module)) for name, module in matched]
    if spec.layer_types is None:
        unsupported = sorted(f"{name} ({type(module).__name__})" for name, module, kind in kinds if kind is None)
        if unsupported:
            raise ValueError(  # error: target-unsupported-kind
                f"target(s) {unsupported} are neither nn.Linear nor transformers Conv1D; "
                f"narrow `targets`, or pass layer_types=('linear', 'conv1d') to keep only those kinds"
            )
    else:
        kinds = [k for k in kinds if k[2] in spec.layer_types]
        if not kinds:
            raise ValueError(  # error: target-layer-types-none
                f"target pattern {spec.targets!r} matches modules, but none of layer_types {list(spec.layer_types)}"
            )
    names_of = tensor_names(model)
    targets = []
    for name, module, kind in kinds:
        weight = module.weight
        shape = logical_shape(weight)  # a packed quantized weight reports its layer's shape
        d_in, d_out = (shape[1], shape[0]) if kind == "linear" else (shape[0], shape[1])
        others = tuple(sorted(n for n in names_of.get(id(weight), []) if n != f"{name}.weight"))
        if others and spec.tied == "error":
            raise ValueError(  # error: target-tied
                f"target {name}.weight is tied to {list(others)}; adapting it would change those too. "
                f"Pass tied='both' to adapt the shared tensor under every name, or leave {name} out of targets"
            )
        targets.append(
            Target(
                module=name,
                weight_key=f"{name}.weight",
                bias_key=f"{name}.bias" if getattr(module, "bias", None) is not None else None,
                layout=str(kind),  # the unsupported (None) kinds were refused or filtered above
                d_in=int(d_in),
                d_out=int(d_out),
                tied_keys=others,
            )
        )
    return targets
