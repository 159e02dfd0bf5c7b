"""Which modules (and parameters) of a model are targets, their kind and layout, and tied weights.

The kinds table (:data:`KINDS`): what can be adapted, how its sizes are read and how its stored
weight maps to the canonical ``(d_out, d_in)`` view that variants see:

- ``"linear"``: ``nn.Linear``, stored ``(d_out, d_in)``, ``F.linear(x, W, b)``;
- ``"conv1d"``: transformers' GPT-2 ``Conv1D``, stored ``(d_in, d_out)``, ``addmm(b, x, W)``;
- ``"embedding"``: ``nn.Embedding``, stored ``(num_embeddings, dim)``: a lookup is a linear map of
  one-hot inputs, so ``d_in = num_embeddings``, ``d_out = dim`` and the canonical view is ``Wᵀ``;
- ``"conv"``: ``nn.Conv1d/2d/3d`` (``groups=1``), stored ``(out, in, *kernel)``: canonical
  ``(out, in·prod(kernel))`` (peft's conv LoRA: ``A`` a conv with the base kernel to ``r``
  channels, ``B`` a 1x1 conv, is ``B·A`` in this view);
- ``"grouped_conv"``: ``nn.Conv1d/2d/3d`` with ``groups > 1``, stored ``(out, in/groups, *kernel)``:
  canonical ``(out, in/groups·prod(kernel))``, the grouped kernel itself, so an update made in it
  stays grouped (peft's LoHa, LoKr, IA3 on the outputs); a kind of its own because peft's conv
  LoRA and DoRA adapt such a layer with a dense ``(out, in, *kernel)`` update that the grouped
  layer cannot hold;
- ``"norm"``: ``nn.LayerNorm`` and ``*RMSNorm`` / ``*LayerNorm`` modules with a 1-D weight
  ``(d,)``: ``d_in = d_out = d``, the canonical view is the weight itself;
- ``"experts"``: a 3-D parameter of a MoE layer (``AdapterSpec(target_parameters=...)``), one
  matrix per expert: stored ``(E, d_out, d_in)``, or ``(E, d_in, d_out)`` where the module says
  ``is_transposed`` (layout ``"experts_t"``); canonical ``(E, d_out, d_in)``, a variant's forms
  run per expert;
- ``"parameter"``: a 2-D parameter named by ``target_parameters`` (peft's ``ParamWrapper``),
  stored ``(d_out, d_in)`` and used by its module however it likes (layout ``"param"``);
- ``"mha"``: an ``nn.MultiheadAttention`` (query, key and value of one size, as peft): its
  packed ``in_proj_weight (3·E, E)`` (layout ``"mha_in"``, the target named as the module) and
  its ``out_proj`` (layout ``"mha_out"``), both ``(d_out, d_in)``; the module hands them to
  ``F.multi_head_attention_forward`` and never calls ``out_proj``, so both apply through their
  merged weights (peft merges them for each call too).

Variants see only canonical views; the layout is recorded per target here and never changes
what the user asked for. Which kinds a variant adapts is its ``Variant.kinds``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

from torch import Tensor, nn

from lora_func.quantized import logical_shape
from lora_func.spec import AdapterSpec
from lora_func.variants import Variant, get_variant

__all__ = [
    "ALL_LINEAR",
    "biased_modules",
    "CONV_LAYOUTS",
    "EXPERT_LAYOUTS",
    "MHA_LAYOUTS",
    "PARAM_LAYOUTS",
    "KINDS",
    "MERGED_ONLY",
    "Target",
    "canonical_weight",
    "check_kinds",
    "no_kind",
    "find_targets",
    "kind_of_layout",
    "layer_kind",
    "module_kind",
    "is_mha_out_proj",
    "output_head",
    "parameter_layout",
    "peft_target",
    "refuse_kinds",
    "stored_shape",
    "stored_weight",
    "tensor_names",
]

# peft's shorthand, with peft's meaning: every nn.Linear / GPT-2 Conv1D except the output head.
ALL_LINEAR = "all-linear"
# Appended to "matches nothing" errors: users coming from peft often only know its shorthand.
_HINT = (
    f"targets={ALL_LINEAR!r} adapts every Linear/Conv1D but the output head, and "
    f"targets='.*' with layer_types=('linear',) every Linear"
)


# kind -> what it is, for messages (the kinds table of the module docstring).
KINDS = {
    "linear": "nn.Linear",
    "conv1d": "transformers Conv1D",
    "embedding": "nn.Embedding",
    "conv": "nn.Conv1d/2d/3d",
    "grouped_conv": "nn.Conv1d/2d/3d with groups > 1",
    "norm": "LayerNorm / RMSNorm",
    "experts": "3-D MoE expert parameter",
    "parameter": "2-D nn.Parameter (target_parameters)",
    "mha": "nn.MultiheadAttention (its in/out projections)",
}
# Layouts of the "experts" kind: (E, d_out, d_in) stored, or (E, d_in, d_out) (is_transposed).
EXPERT_LAYOUTS = ("experts", "experts_t")
# Layouts stored (out, in/groups, *kernel): their canonical view flattens the kernel's axes.
CONV_LAYOUTS = ("conv", "grouped_conv")
# Layouts of parameters named by target_parameters (peft's ParamWrapper): their target is the
# parameter's full name.
PARAM_LAYOUTS = (*EXPERT_LAYOUTS, "param")
# An nn.MultiheadAttention's projections. peft adapts the out_proj as part of the attention
# module (its tensors under "<attention>.base_layer.out_proj"), never on its own.
MHA_LAYOUTS = ("mha_in", "mha_out")
# Layouts the overlays apply through the merged weight only (a parameter overlay of W_eff):
# their layer op is not a matmul of x (a lookup, a convolution, a normalisation, a per-expert
# loop or grouped_mm), so no lazy stand-in intercepts it.
MERGED_ONLY = frozenset({"embedding", *CONV_LAYOUTS, "norm", *PARAM_LAYOUTS, *MHA_LAYOUTS})


def kind_of_layout(layout: str) -> str:
    """The kind of a stored layout (``"experts_t"`` is of kind ``"experts"``)."""
    return "experts" if layout in EXPERT_LAYOUTS else "parameter" if layout == "param" else "mha" if layout in MHA_LAYOUTS else layout


@dataclasses.dataclass(frozen=True)
class Target:
    """One adapted layer (static data: part of an adapter's pytree context).

    Attributes:
      module: the module's name in the model.
      weight_key / bias_key: the parameter names the overlays replace or read.
      module: the module's name in the model; for an expert parameter the parameter's name
        (``"model.layers.0.mlp.experts.gate_up_proj"``), as peft's ``target_parameters`` names it.
      weight_key / bias_key: the parameter names the overlays replace or read.
      layout: ``"linear"`` (stored ``(d_out, d_in)``), ``"conv1d"`` (stored ``(d_in, d_out)``), or
        one of the other kinds' layouts (module docstring).
      d_in / d_out: feature sizes (per expert for the experts kind).
      tied_keys: every other name of the same weight tensor (only with ``tied="both"``).
      shape: the stored weight's shape, for the layouts whose canonical view is a reshape
        (``"conv"``) or has an expert axis; ``()`` for the others.
    """

    module: str
    weight_key: str
    bias_key: str | None
    layout: str
    d_in: int
    d_out: int
    tied_keys: tuple[str, ...] = ()
    shape: tuple[int, ...] = ()

    @property
    def owner(self) -> str:
        """The name of the module that holds the weight (``module`` itself but for expert parameters)."""
        return self.weight_key.rpartition(".")[0]

    @property
    def experts(self) -> int | None:
        """The number of experts of an expert parameter, else ``None``."""
        return self.shape[0] if self.layout in EXPERT_LAYOUTS else None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self) | {"tied_keys": list(self.tied_keys), "shape": list(self.shape)}
        if not self.shape:
            del out["shape"]  # the files of linear / Conv1D targets stay as they were
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Target:
        return cls(**(data | {"tied_keys": tuple(data["tied_keys"]), "shape": tuple(data.get("shape", ()))}))


def layer_kind(module: nn.Module) -> str | None:
    """The kind of a module (:data:`KINDS`, but ``"experts"``, which is a parameter), or ``None``."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.MultiheadAttention):
        # peft's form: one packed in_proj (query, key and value of one size) and a Linear out_proj
        return "mha" if module._qkv_same_embed_dim and isinstance(module.out_proj, nn.Linear) else None
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv" if module.groups == 1 else "grouped_conv"
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.LayerNorm) or (
        type(module).__name__.endswith(("RMSNorm", "LayerNorm")) and isinstance(weight, Tensor) and weight.dim() == 1
    ):
        return "norm" if isinstance(weight, Tensor) else None
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return "conv1d" if isinstance(module, Conv1D) else None


def stored_shape(target: Target) -> tuple[int, ...]:
    """The shape of ``target``'s weight as the model stores it."""
    if target.shape:
        return target.shape
    if target.layout in ("linear", *MHA_LAYOUTS):
        return (target.d_out, target.d_in)
    if target.layout == "norm":
        return (target.d_out,)
    return (target.d_in, target.d_out)  # conv1d, embedding


def module_kind(modules: Mapping[str, nn.Module], target: Target) -> str | None:
    """The layout ``target``'s weight has in a model with ``modules`` (``None``: no such weight
    there, or of no kind), to compare with the layout it was built for."""
    module = modules.get(target.owner)
    if module is None:
        return None
    if target.layout in PARAM_LAYOUTS:
        param = getattr(module, target.weight_key.rpartition(".")[2], None)
        if not isinstance(param, Tensor) or param.dim() not in (2, 3):
            return None
        return parameter_layout(module, param)
    if is_mha_out_proj(modules, target.owner):
        return "mha_out"
    kind = layer_kind(module)
    return "mha_in" if kind == "mha" else kind


def parameter_layout(module: nn.Module, param: Tensor) -> str:
    """The layout of a parameter named by ``target_parameters``: ``"param"`` for a 2-D one, an
    expert layout for a 3-D one."""
    if param.dim() == 2:
        return "param"
    return "experts_t" if getattr(module, "is_transposed", False) else "experts"


def is_mha_out_proj(modules: Mapping[str, nn.Module], name: str) -> bool:
    """Whether module ``name`` is the ``out_proj`` of an ``nn.MultiheadAttention`` lora_func adapts
    (its forward is never called: the attention reads its weight)."""
    parent, _, last = name.rpartition(".")
    return last == "out_proj" and layer_kind(modules.get(parent, nn.Module())) == "mha"


def peft_target(modules: Mapping[str, nn.Module], name: str) -> str:
    """The module peft's config names for lora_func's target ``name``: the attention module for an
    ``nn.MultiheadAttention``'s out_proj (peft adapts both with the attention's rank and alpha),
    else ``name``."""
    return name.rpartition(".")[0] if is_mha_out_proj(modules, name) else name


def canonical_weight(weight: Tensor, layout: str) -> Tensor:
    """The canonical ``(d_out, d_in)`` view of a stored weight (no copy); ``(E, d_out, d_in)`` for
    an expert parameter, the weight itself for a norm's ``(d,)``."""
    if layout in ("conv1d", "embedding"):
        return weight.T
    if layout in CONV_LAYOUTS:
        return weight.flatten(1)
    if layout == "experts_t":
        return weight.transpose(-1, -2)
    return weight


def stored_weight(weight: Tensor, layout: str, shape: Sequence[int] | None = None) -> Tensor:
    """Back from the canonical view to the layout the model stores; ``shape``: the stored
    shape, needed for the conv layouts (the kernel's axes)."""
    if layout in ("conv1d", "embedding"):
        return weight.T
    if layout in CONV_LAYOUTS:
        assert shape is not None, "a conv weight's stored shape"
        return weight.reshape(shape)
    if layout == "experts_t":
        return weight.transpose(-1, -2)
    return weight


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


def biased_modules(model: nn.Module) -> list[str]:
    """The modules that hold a bias of their own (a parameter named ``bias``), in module order:
    the biases peft's ``bias="all"`` trains, as targets of ``ln_tuning`` with ``weight=False``
    (``AdapterSpec("ln_tuning", targets=biased_modules(model), weight=False)``)."""
    return [name for name, module in model.named_modules() if name and isinstance(module._parameters.get("bias"), Tensor)]


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
    adaptable = sorted({name.rsplit(".", 1)[-1] for name, module in modules if layer_kind(module) in ("linear", "conv1d")})
    shown = f"{adaptable[:20]}{' ...' if len(adaptable) > 20 else ''}" if adaptable else "none (no nn.Linear or Conv1D)"
    return f"no module name is close; the layers it can adapt are named {shown}"


def no_kind(module: nn.Module) -> str:
    """What a module of no kind is, for the refusal: its class."""
    return type(module).__name__


def _sizes(kind: str, shape: Sequence[int]) -> tuple[int, int]:
    """``(d_in, d_out)`` of a stored weight of ``kind`` (the kinds table)."""
    if kind in ("linear", "param", *MHA_LAYOUTS):
        return shape[1], shape[0]
    if kind in ("conv1d", "embedding"):
        return shape[0], shape[1]
    if kind in CONV_LAYOUTS:
        return math.prod(shape[1:]), shape[0]
    if kind == "norm":
        return shape[0], shape[0]
    if kind == "experts_t":
        return shape[1], shape[2]
    return shape[2], shape[1]  # experts: (E, d_out, d_in)


def _expert_parameters(model: nn.Module, spec: AdapterSpec) -> list[tuple[str, str, Tensor, str]]:
    """``(owner module, parameter name, parameter, layout)`` of every parameter ``spec.target_parameters``
    selects (peft's matching: the full name equals an entry or ends with ``"." + entry``), in
    module order and, within a module, in the order of its parameters (peft's nesting order)."""
    wanted = spec.target_parameters
    if not wanted:
        return []
    found, matched_entries = [], set()
    for owner, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            key = f"{owner}.{pname}" if owner else pname
            hits = [t for t in wanted if key == t or key.endswith("." + t)]
            if not hits:
                continue
            matched_entries.update(hits)
            if param.dim() not in (2, 3):
                raise ValueError(  # error: target-parameter-dims
                    f"target_parameters selects {key} of shape {tuple(param.shape)}; lora_func adapts 2-D parameters "
                    f"(out, in) and 3-D expert parameters (num_experts, out, in) there, as peft's ParamWrapper: name the "
                    f"module in `targets` instead"
                )
            found.append((owner, pname, param, parameter_layout(module, param)))
    unmatched = sorted(set(wanted) - matched_entries)
    if unmatched:
        names = [n for n, p in model.named_parameters() if p.dim() == 3] or [n for n, p in model.named_parameters() if p.dim() == 2]
        raise ValueError(  # error: target-parameters-unmatched
            f"target_parameters {unmatched} match no parameter of {type(model).__name__}; its 3-D (expert) "
            f"parameters, or else 2-D ones, are {names[:8]}{' ...' if len(names) > 8 else ''}"
        )
    return found


def _weights(modules: Mapping[str, nn.Module], kinds: Sequence[tuple[str, nn.Module, str | None]]) -> list[tuple[str, str, Tensor, str]]:
    """``(owner module, parameter name, parameter, layout)`` of the matched modules' weights, in
    module order: an ``nn.MultiheadAttention`` gives its ``in_proj_weight`` and its out_proj's weight
    (an out_proj also matched on its own is adapted once), an attention's out_proj on its own is
    of layout ``"mha_out"`` (its forward is never called)."""
    found: dict[str, tuple[str, str, Tensor, str]] = {}
    for name, module, kind in kinds:
        if kind == "mha":
            attention = cast(nn.MultiheadAttention, module)
            found.setdefault(f"{name}.in_proj_weight", (name, "in_proj_weight", cast(Tensor, attention.in_proj_weight), "mha_in"))
            found.setdefault(f"{name}.out_proj.weight", (f"{name}.out_proj", "weight", attention.out_proj.weight, "mha_out"))
        else:
            layout = "mha_out" if is_mha_out_proj(modules, name) else str(kind)
            found.setdefault(f"{name}.weight", (name, "weight", cast(Tensor, module.weight), layout))
    return list(found.values())


def check_kinds(variant: Variant, targets: Sequence[Target], where: str) -> None:
    """Raise unless ``variant`` adapts the kind of every target (``Variant.kinds``), naming the
    variant, the targets and kinds it refuses, and the kinds it adapts."""
    refuse_kinds(variant, [(t.module, kind_of_layout(t.layout)) for t in targets], where)


def refuse_kinds(variant: Variant, kinds: Sequence[tuple[str, str]], where: str) -> None:
    """:func:`check_kinds` on ``(module, kind)`` pairs (a checkpoint's layers before any is read)."""
    refused = sorted({f"{module} ({kind})" for module, kind in kinds if kind not in variant.kinds})
    if refused:
        supported = [f"{k} ({KINDS[k]})" for k in KINDS if k in variant.kinds]
        why = "".join(sorted({_WHY_NOT.get(kind, "") for _, kind in kinds if kind not in variant.kinds}))
        raise ValueError(  # error: variant-kind-unsupported
            f"{where}: variant {variant.name!r} cannot adapt {refused[:5]}{' ...' if len(refused) > 5 else ''}; "
            f"{variant.name} adapts {', '.join(supported)}.{why} Leave those out of the targets, or pick a variant that adapts "
            f"them (lora adapts every kind but norms and grouped convs; ln_tuning adapts norms, Linear and Conv1D)"
        )


# Why a kind is not adapted by some variants, where that is not the variant's own choice.
_WHY_NOT = {
    "grouped_conv": (
        " A grouped conv (groups > 1) is adapted in its grouped kernel (loha, lokr, ia3); peft's conv LoRA and DoRA add "
        "a dense (out, in, *kernel) update there, which the grouped layer cannot hold."
    ),
}


def find_targets(model: nn.Module, spec: AdapterSpec, where: str = "init_adapter") -> list[Target]:
    """The targets of ``spec`` in ``model``, in module order; raises before touching anything.

    ``spec.targets == "all-linear"`` is peft's shorthand: every ``nn.Linear`` and GPT-2
    ``Conv1D`` except the output head (:func:`output_head`); ``layer_types`` still filters.
    ``spec.target_parameters`` adds 3-D expert parameters (after the modules).

    Raises ``ValueError`` when nothing matches (listing close module names), when a matched
    module is of no kind of :data:`KINDS` (unless ``layer_types`` filters), when a list entry
    matches nothing, when a target's weight is tied and ``tied="error"``, or when the spec's
    variant does not adapt a target's kind (:func:`check_kinds`).
    """
    modules = [(name, module) for name, module in model.named_modules() if name]
    module_names = [name for name, _ in modules]
    if spec.targets == ALL_LINEAR:
        # peft's "all-linear": the output head stays frozen (it is usually tied to the input
        # embedding, and adapting it is rarely wanted); modules of other kinds are not matched.
        head = output_head(model)
        matched = [(n, m) for n, m in modules if n != head and layer_kind(m) in ("linear", "conv1d")]
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
    experts = _expert_parameters(model, spec)
    if not matched and not experts:
        raise ValueError(  # error: target-pattern-unmatched
            f"target pattern {spec.targets!r} matches no module of {type(model).__name__} "
            f"(the pattern must match the whole name, e.g. r'.*\\.q_proj'); "
            f"{_did_you_mean([str(spec.targets)], modules)}; {_HINT}"
        )
    kinds = [(name, module, layer_kind(module)) for name, module in matched]
    if spec.layer_types is None:
        unsupported = sorted(f"{name} ({no_kind(module)})" for name, module, kind in kinds if kind is None)
        if unsupported:
            raise ValueError(  # error: target-unsupported-kind
                f"target(s) {unsupported} are of no kind lora_func adapts ({', '.join(KINDS.values())}); narrow "
                f"`targets`, or pass layer_types=('linear', 'conv1d') to keep only those kinds"
            )
    else:
        kinds = [k for k in kinds if k[2] in spec.layer_types]
        if not kinds and not experts:
            raise ValueError(  # error: target-layer-types-none
                f"target pattern {spec.targets!r} matches modules, but none of layer_types {list(spec.layer_types)}"
            )
    names_of = tensor_names(model)
    targets = []
    pairs = _weights(dict(modules), kinds)
    for owner, pname, param, layout in [*pairs, *experts]:
        weight = param
        shape = logical_shape(weight)  # a packed quantized weight reports its layer's shape
        d_in, d_out = _sizes(layout, shape)
        weight_key = f"{owner}.{pname}"
        others = tuple(sorted(n for n in names_of.get(id(weight), []) if n != weight_key))
        if others and spec.tied == "error":
            raise ValueError(  # error: target-tied
                f"target {weight_key} is tied to {list(others)}; adapting it would change those too. "
                f"Pass tied='both' to adapt the shared tensor under every name, or leave {owner} out of targets"
            )
        module = model.get_submodule(owner)
        bias = {"weight": "bias", "in_proj_weight": "in_proj_bias"}.get(pname) if layout not in PARAM_LAYOUTS else None
        has_bias = bias is not None and getattr(module, bias, None) is not None
        targets.append(
            Target(
                module=owner if layout not in PARAM_LAYOUTS else weight_key,
                weight_key=weight_key,
                bias_key=f"{owner}.{bias}" if has_bias else None,
                layout=layout,  # the unsupported (None) kinds were refused or filtered above
                d_in=int(d_in),
                d_out=int(d_out),
                tied_keys=others,
                shape=tuple(int(n) for n in shape) if layout in (*CONV_LAYOUTS, *PARAM_LAYOUTS) else (),
            )
        )
    check_kinds(get_variant(spec.variant), targets, where)
    return targets
