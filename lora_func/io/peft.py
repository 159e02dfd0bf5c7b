"""HF peft's checkpoint format, both directions: ``adapter_config.json`` + ``adapter_model.safetensors``.

Adapters trained with peft load onto the untouched base model (:func:`load_peft`), and
lora_func adapters are written in peft's format (:func:`save_peft`) for peft and the tools
that read it (vLLM, TGI, LoRAX); :func:`peft_problems` says whether an adapter fits.

The reader and writer are generic: how each variant is stored is declared in its file, beside
its math: the tensor schema holds each tensor's peft key and shape, the option schema each
option's config field, and the file's ``PEFT`` (a :class:`~lora_func.variants.PeftFormat`) the
peft method, which config marks the variant and any conversion (see :mod:`lora_func.variants`);
docs/io.md has the table. A variant without a ``PEFT`` has no peft equivalent. This module writes (:func:`save_peft`, :func:`peft_problems`); the others of one
job each: ``_peft_keys`` (tensor names and shapes), ``_peft_config`` (the config, both ways),
``_peft_read`` (:func:`load_peft`).
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor, nn

from lora_func._model import (
    base_params,
    weight_fingerprint,
)
from lora_func.adapter import (
    Adapter,
    AdapterLayer,
    AdapterLike,
    AdapterNode,
    Composed,
    leaves,
    walk,
)
from lora_func.checks import check_model, check_path
from lora_func.io._files import replace_directory, safetensors_write
from lora_func.io._peft_config import config_of, written_config
from lora_func.io._peft_keys import CONFIG_NAME, PREFIX, WEIGHTS_NAME, Out, bias_copy_options, methods, module_copy, parameter_key, saved_names, stored
from lora_func.io._peft_read import load_peft
from lora_func.io._prompt_files import prompt_peft_problems, save_prompt_peft
from lora_func.prompts._apply import contains_prompt
from lora_func.io._validate import warn_full_rank_merge
from lora_func.replication import layer_map_of
from lora_func.targeting import (
    biased_modules,
    canonical_weight,
)
from lora_func.variants import (
    PeftFormat,
    peft_format,
)

__all__ = ["load_peft", "peft_problems", "save_peft"]


def _out(fmt: PeftFormat, adapter: Adapter, layer: AdapterLayer, base: Mapping[str, Tensor] | None) -> Out:
    """``layer`` of ``adapter`` as peft stores it, after checking that a conversion has the base it needs."""
    params, buffers = adapter.layer_tensors(layer)
    variant = adapter.variant
    saved = saved_names(variant, dict(adapter.spec.options))  # the others are re-created on load
    t, name = layer.target, adapter.spec.variant
    if fmt.export is None:
        method = fmt.method
        kept = {k: v for k, v in buffers.items() if k in saved}
        return Out(
            t,
            lambda: stored(variant, fmt, params | kept, t),
            r=_written_rank(adapter, layer) if method.rank is not None else None,
            alpha=layer.info.alpha if method.alpha is not None else None,
            feedforward=fmt.feedforward,
        )
    weight = None
    if fmt.export_needs_base is not None:
        if base is None:
            raise ValueError(  # error: save-peft-needs-model
                f"save_peft of a {name} adapter needs model=<the base model>: {fmt.export_needs_base} ({t.module})"
            )
        weight = base[t.weight_key]
        if layer.base_fingerprint is not None and weight_fingerprint(weight) != layer.base_fingerprint:
            raise ValueError(  # error: save-peft-other-base
                f"save_peft: the {name} adapter on {t.module} was derived from other base weights than this model's "
                f"(fingerprint {layer.base_fingerprint}, model {weight_fingerprint(weight)}); pass the model it was built on"
            )
        weight = canonical_weight(weight, t.layout)
    converted = fmt.export(params, buffers, weight, layer.info)
    return Out(t, lambda: stored(variant, fmt, converted.tensors(), t), r=converted.r, alpha=converted.alpha, feedforward=fmt.feedforward)

def _written_rank(adapter: Adapter, layer: AdapterLayer) -> int:
    """The rank a layer is written with: its own, but the spec's ``r`` where the variant derives
    each layer's rank from it (``Variant.layer_ranks``) and peft's method has no per-layer rank
    field: peft derives it the same way on load (a layer smaller than ``r`` gets a lower rank)."""
    fmt = peft_format(adapter.spec.variant)
    no_pattern = fmt is not None and fmt.method.rank is not None and fmt.method.rank[1] is None
    return adapter.spec.r if adapter.variant.layer_ranks is not None and no_pattern else int(layer.info.r)


@dataclass(frozen=True)
class _Export:
    """What one lora_func adapter becomes in peft: a peft_type, the config fields that must be
    the same for every layer of one checkpoint, and its layers."""

    peft_type: str
    shared: tuple[tuple[str, Any], ...]
    layers: tuple[Out, ...]
    # The tensors held once for every layer, by whole key (the tensor schema's shared slots).
    whole: Mapping[str, Tensor] = field(default_factory=dict)
    # A trained-copy part that trains the biases alone (_peft_keys.bias_copy_options: peft's `bias`)
    bias_only: bool = False
    # Its layers that have a bias of their own (what peft's "<method>_only" trains)
    biased: frozenset[str] = frozenset()
    # The spec's targets, written as target_modules for a variant whose tied tensors peft groups
    # by the target that matched (Variant.groups): peft then ties as lora_func does.
    target_modules: Any = None

def _export_leaf(adapter: Adapter, base: Mapping[str, Tensor] | None) -> _Export:
    """``adapter`` as peft stores it, after every check that peft can hold it (no tensor is
    computed yet: see :class:`Out`)."""
    name = adapter.spec.variant
    if adapter.stack_shape or adapter.members is not None:
        raise ValueError(  # error: save-peft-stacked
            f"save_peft: this {name} adapter is stacked (stack_shape {adapter.stack_shape}); a peft checkpoint holds one "
            f"adapter: save each of lora_func.unstack(adapter)"
        )
    fmt = peft_format(name)
    layers = []
    for layer in adapter.layers:
        if layer.target.tied_keys:
            raise ValueError(  # error: save-peft-tied
                f"save_peft: {layer.target.module} is adapted under its tied names {list(layer.target.tied_keys)} too "
                f"(tied='both'), but peft would adapt only the {layer.target.module} module's output, not the embedding "
                f"lookup: a different model. Export the merged model with lora_func.merged_state_dict, or save with lora_func.save"
            )
        if fmt is None:
            raise ValueError(  # error: save-peft-no-equivalent
                f"save_peft: {name} has no peft equivalent (peft has no such method); save it with lora_func.save, or "
                f"export the merged model with lora_func.merged_state_dict"
            )
        if layer.target.layout == "conv1d" and not fmt.conv1d:
            raise ValueError(  # error: save-peft-conv1d
                f"save_peft: peft refuses {name} on GPT-2 Conv1D layers ({layer.target.module}), so no peft tool could "
                f"load this checkpoint; save it with lora_func.save instead"
            )
        layers.append(_out(fmt, adapter, layer, base))
    assert fmt is not None  # an adapter has layers
    options = dict(adapter.spec.options)
    shared = config_of(adapter.variant, fmt, options)
    whole: dict[str, Tensor] = {}
    slots = {name: slot for name, slot in adapter.variant.tensors.items() if slot.shared and slot.saved(options)}
    if slots:
        shared_params, shared_buffers = adapter.shared_tensors()
        held = shared_params | shared_buffers
        for name, slot in slots.items():
            key = slot.peft_key("")
            assert key is not None  # a saved slot has a key
            if "{group}" in key:  # once per group, under its group key (Slot.peft)
                whole |= {key.format(group=k.partition("@")[2]): t for k, t in held.items() if k.partition("@")[0] == name}
                continue
            tensor = held[name]
            # a key with "{}" holds the tensor row by row (Slot.peft)
            whole |= {key.format(i): row for i, row in enumerate(tensor)} if "{}" in key else {key: tensor}
    targets = adapter.spec.targets
    selector = None if adapter.variant.groups is None else targets if isinstance(targets, str) else list(targets)
    return _Export(
        fmt.method.peft_type,
        tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in shared.items())),
        tuple(layers),
        whole,
        bias_only=fmt.module_copy is not None and all(options.get(k) == v for k, v in bias_copy_options().items()),
        biased=frozenset(layer.target.module for layer in adapter.layers if layer.info.has_bias),
        target_modules=selector,
    )

def _leaves(adapter: AdapterLike) -> list[Adapter]:
    """The leaf adapters of ``adapter`` in order. peft applies its adapters in order, as
    :class:`Composed` does, and has no form for any other combinator."""

    if not isinstance(adapter, AdapterNode):
        raise TypeError(f"save_peft expects an Adapter or Composed, got {type(adapter).__name__}")  # error: save-peft-not-adapter
    for _, node in walk(adapter):
        if node.parts and not isinstance(node, Composed):
            raise TypeError(  # error: save-peft-combined
                f"save_peft: a {type(node).__name__} adapter (built by {node.verb}()) has no peft checkpoint form "
                f"(peft applies adapters only in order, as compose does); save it with lora_func.save, or export the "
                f"merged model with lora_func.merged_state_dict"
            )
    return [leaf for _, leaf in leaves(adapter)]

def _base_of(leaves: Sequence[Adapter], model: nn.Module | None) -> dict[str, Tensor] | None:
    """The model's parameters (``None`` without a model), after checking that it has every target."""
    base = base_params(model) if model is not None else None
    if base is not None:
        missing = sorted({layer.target.weight_key for leaf in leaves for layer in leaf.layers} - set(base))
        if missing:
            raise ValueError(f"save_peft: the adapter's targets {missing[:5]} are not in {type(model).__name__}; pass the model it was built on")  # error: save-peft-wrong-model
    return base

def _one_checkpoint(
    exports: Sequence[_Export], model: nn.Module | None, task_type: str | None
) -> tuple[dict[str, Any], list[Out], dict[str, Tensor]]:
    """The config and the layers of the one checkpoint that holds every part, after checking
    that the parts fit in one: one peft method and one set of options, each layer once."""
    # Parts of the trained-copy variant (PeftFormat.module_copy) beside another method's are peft's
    # modules_to_save: copies of their layers, stored under the layer's own names (as load_peft
    # reads them back)
    copy_name, copy_format, own_name = module_copy()
    copy_type = copy_format.method.peft_type
    bias_parts = [e for e in exports if e.bias_only]
    exports = [e for e in exports if not e.bias_only]
    if bias_parts and not exports:
        raise ValueError(  # error: save-peft-bias-alone
            f"save_peft: this adapter trains only biases ({sorted(o.target.module for e in bias_parts for o in e.layers)[:5]}: "
            f"{copy_name} {bias_copy_options()}); peft trains biases only beside a method (its config's bias='all' or "
            f"'<method>_only'): compose them with the method's adapter, or save with lora_func.save"
        )
    copies = [o for e in exports if e.peft_type == copy_type for o in e.layers] if {e.peft_type for e in exports} - {copy_type} else []
    if copies:
        exports = [e for e in exports if e.peft_type != copy_type]
    kinds = sorted({(e.peft_type, e.shared) for e in exports})
    if len(kinds) > 1:
        raise ValueError(  # error: save-peft-mixed-methods
            f"save_peft: the parts of this composed adapter need different peft configs ({[k[0] for k in kinds]}: "
            f"{[{name: json.loads(value) for name, value in k[1]} for k in kinds]}); one peft checkpoint has one method and one set of options: save each "
            f"part with save_peft to its own directory"
        )
    layers = [o for e in exports for o in e.layers]
    counts = collections.Counter(o.target.module for o in [*layers, *copies])
    twice = sorted(m for m, n in counts.items() if n > 1)
    if twice:
        raise ValueError(  # error: save-peft-same-layers
            f"save_peft: several parts adapt the same layers {twice[:5]}; a peft checkpoint has one adapter per "
            f"layer: save the parts separately, or export the merged model with lora_func.merged_state_dict"
        )
    # peft adapts an attention's out_proj with the attention's rank and twice its alpha (see
    # lora_func._model.layer_info), and never alone (the attention does not call out_proj)
    attentions = {o.target.module: (o.r, None if o.alpha is None else 2 * o.alpha) for o in layers if o.target.layout == "mha_in"}
    alone = sorted(
        o.target.module for o in layers if o.target.layout == "mha_out" and attentions.get(o.target.module.rpartition(".")[0]) != (o.r, o.alpha)
    )
    if alone:
        raise ValueError(  # error: save-peft-out-proj-alone
            f"save_peft: {alone[:5]} is the out_proj of an nn.MultiheadAttention, which peft adapts only together with "
            f"the attention, at its rank and scale (it never calls out_proj: a checkpoint of it alone would load in peft "
            f"with no effect); target the attention module itself (its in_proj and out_proj), or save with lora_func.save"
        )
    holding = [e for e in exports if e.whole]
    if len(holding) > 1:
        raise ValueError(  # error: save-peft-shared-twice
            f"save_peft: {len(holding)} parts of this composed adapter each hold their own shared tensors "
            f"({sorted(holding[0].whole)}); a peft checkpoint holds one set for all its layers: save each part with "
            f"save_peft to its own directory"
        )
    peft_type, shared = kinds[0][0], {k: json.loads(v) for k, v in kinds[0][1]}
    config = written_config(peft_type, shared, layers, model, task_type)
    layer_map = layer_map_of(model) if model is not None else None
    if layer_map is not None:  # a replicated view of the base: peft rebuilds it from the map
        config["layer_replication"] = layer_map
    selectors = [e.target_modules for e in exports if e.target_modules is not None]
    if selectors:
        config["target_modules"] = selectors[0]
    whole = dict(holding[0].whole) if holding else {}
    if copies:
        config["modules_to_save"] = sorted(o.target.module for o in copies)
        if model is not None:
            _refuse_wider_copies(config["modules_to_save"], model)
        # (a copy's tensors are its layer's, in the stored layout: no conversion to defer)
        whole |= {f"{PREFIX}{o.target.module}.{own_name[suffix]}": t for o in copies for suffix, t in o.tensors().items()}
    if bias_parts:
        config["bias"] = _bias_mode(peft_type, bias_parts, exports, copies, model)
        targets = {o.target.module for o in layers}
        # peft's keys: a target's bias is its base layer's (the tuner layer wraps it)
        whole |= {
            f"{PREFIX}{o.target.module}{'.base_layer' if o.target.module in targets else ''}.bias": t
            for e in bias_parts for o in e.layers for t in o.tensors().values()
        }
    return config, layers, whole

def _refuse_wider_copies(names: Sequence[str], model: nn.Module) -> None:
    """peft's ``modules_to_save`` matching is a plain ``endswith`` (``"head"`` also selects
    ``"aux_head"``): refuse a copy whose full name is the end of another module's name, as peft
    would make a trained copy of that module too and no written name selects the copy alone."""
    wanted = set(names)
    wider = sorted((other, name) for other, _ in model.named_modules() for name in names if other not in wanted and other != name and other.endswith(name))
    if wider:
        raise ValueError(  # error: save-peft-modules-to-save-wider
            f"save_peft: the trained copy of {wider[0][1]!r} is written as modules_to_save={wider[0][1]!r}, which peft matches "
            f"by name ending and so also selects {wider[0][0]!r} ({len(wider)} such: {wider[:3]}): peft would train and "
            f"load a copy of that module too, another model. No name selects {wider[0][1]!r} alone: also copy "
            f"{wider[0][0]!r} (a trained copy of it too), or save with lora_func.save"
        )

def _bias_mode(peft_type: str, bias_parts: Sequence[_Export], exports: Sequence[_Export], copies: Sequence[Out], model: nn.Module | None) -> str:
    """peft's ``bias`` value for trained biases: ``"<method>_only"`` when they are exactly the
    biases of the method's layers, ``"all"`` when they are every bias of the model (a trained
    copy holds its module's); anything else peft cannot train."""
    trained = sorted(o.target.module for e in bias_parts for o in e.layers)
    if "bias" not in methods()[peft_type].fixed:
        raise ValueError(  # error: save-peft-bias-method
            f"save_peft: peft's {peft_type} has no bias option, so it cannot hold the trained biases {trained[:5]}; "
            f"save the biases' part with lora_func.save"
        )
    own = sorted(m for e in exports for m in e.biased)
    if trained == own:
        return f"{peft_type.lower()}_only"
    everything = sorted(set(biased_modules(model)) - {o.target.module for o in copies}) if model is not None else None
    if trained == everything:
        return "all"
    raise ValueError(  # error: save-peft-bias-subset
        f"save_peft: the adapter trains the biases of {trained[:5]} ({len(trained)}); peft trains the biases of its "
        f"method's layers ({own[:5]}, bias='{peft_type.lower()}_only') or every bias of the model (bias='all'"
        + (f": {everything[:5]}, {len(everything)}" if everything is not None else ", which save_peft checks with model=")
        + "), nothing in between: train one of those sets (lora_func.targeting.biased_modules(model)), or save with lora_func.save"
    )

def peft_problems(adapter: AdapterLike, *, model: nn.Module | None = None) -> list[str]:
    """Why :func:`save_peft` would refuse to write ``adapter`` (with this ``model=``): the
    message it would raise for each part that peft's format cannot hold, or for the parts
    together; an empty list when it can write the checkpoint.

    What peft cannot hold: a variant without a peft entry (peft has no such method), a
    ``Combined`` adapter, a stacked adapter, a variant on GPT-2 ``Conv1D`` where peft refuses
    it, a weight adapted under its tied names (``tied="both"``), parts that need different peft
    configs or adapt the same layer, layers of different ranks where the method has one rank.
    A variant stored converted from its base (``export_needs_base``) needs ``model=``,
    which must be the model it was built on. Cheap: nothing is computed beyond the base
    weights' fingerprints, and nothing is written.
    """
    if not isinstance(adapter, AdapterNode):
        raise TypeError(f"peft_problems expects an adapter (Adapter, Composed, Combined, ...), got {type(adapter).__name__}")  # error: peft-problems-not-adapter
    if model is not None:
        check_model(model, "peft_problems")
    if contains_prompt(adapter):  # an input-level adapter (lora_func.prompts)
        return prompt_peft_problems(adapter)
    try:
        leaves = _leaves(adapter)
        base = _base_of(leaves, model)
    except (TypeError, ValueError) as err:  # a Combined adapter; a model without the targets
        return [str(err)]
    problems, exports = [], []
    for leaf in leaves:
        try:
            exports.append(_export_leaf(leaf, base))
        except ValueError as err:
            problems.append(str(err))
    if not problems:
        try:
            _one_checkpoint(exports, model, None)
        except ValueError as err:
            problems.append(str(err))
    return problems

def _write_text(path: Path, text: str) -> None:
    path.write_text(text)

def save_peft(
    adapter: AdapterLike, directory: str | os.PathLike, *, model: nn.Module | None = None, task_type: str | None = None
) -> Path:
    """Write ``adapter`` as a peft checkpoint: ``directory/adapter_config.json`` and
    ``directory/adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained(base,
    directory)``. Returns the directory.

    Every variant with a peft entry (its file's ``Variant(peft=...)``; docs/io.md has the
    table), per-layer ranks and alphas as ``rank_pattern`` / ``alpha_pattern``, a conversion
    where the entry has one (one that reads the base weights needs ``model=``). A ``Composed`` of adapters that map to one peft method on
    different layers is one checkpoint.
    ``model`` (the base) is optional otherwise; with it the config uses short module names
    (``["q_proj", "v_proj"]``) when they select exactly the adapted layers, and records the
    model's ``name_or_path``. ``task_type`` (e.g. ``"CAUSAL_LM"``) is written as peft's
    ``task_type``: it picks peft's wrapper class, not the adapter's math, so ``load_peft``
    does not keep it (pass it again when you save).

    Raises before writing anything for what peft cannot express (see :func:`peft_problems`,
    which says so without trying).

    The checkpoint is replaced as a whole: both files are written into a new directory next to
    ``directory``, which then takes its place in one atomic step (Linux ``renameat2``), so an
    interrupted save leaves the complete old checkpoint or the complete new one, never a mix,
    and at every moment ``directory`` holds one complete checkpoint. Other entries of
    ``directory`` (a README, tokenizer files) are kept (as hard links, or copies where links
    are refused). Elsewhere, or where the file system refuses the exchange, the two files are
    renamed into place one after the other (each file whole; the pair best effort). See
    docs/io.md.
    """
    if contains_prompt(adapter):  # an input-level adapter (lora_func.prompts)
        check_path(directory, "save_peft", "directory")
        return save_prompt_peft(adapter, directory, model=model, task_type=task_type)
    leaves = _leaves(adapter)
    check_path(directory, "save_peft", "directory")
    if task_type is not None and not isinstance(task_type, str):
        raise TypeError(f"save_peft: task_type must be a peft task name such as 'CAUSAL_LM' or None, got {task_type!r}")  # error: save-peft-task-type
    if model is not None:
        check_model(model, "save_peft")
    base = _base_of(leaves, model)
    config, layers, whole = _one_checkpoint([_export_leaf(leaf, base) for leaf in leaves], model, task_type)
    warn_full_rank_merge(leaves)
    stored_under = parameter_key([o.target for o in layers])
    tensors = {
        f"{PREFIX}{stored_under[o.target.module]}.{suffix}": tensor.detach().to("cpu").contiguous()
        for o in layers
        for suffix, tensor in o.tensors().items()
    } | {key: tensor.detach().to("cpu").contiguous() for key, tensor in whole.items()}
    # A tensor shared within a group of layers (Variant.groups) is written under each layer's
    # key, as peft writes its tied modules: one copy each (safetensors refuses shared memory).
    seen: set[int] = set()
    for key, tensor in tensors.items():
        if tensor.untyped_storage().data_ptr() in seen and tensor.numel():
            tensors[key] = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
    directory = Path(directory)
    # The real directory (a symlink to a checkpoint directory is kept, its target replaced).
    target = Path(os.path.realpath(directory))
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(  # error: save-peft-not-a-directory
            f"save_peft: {directory} exists and is not a directory; pass a directory path (a peft checkpoint is "
            f"a directory holding {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    replace_directory(
        target,
        {
            WEIGHTS_NAME: lambda path: safetensors_write(path, lambda: save_file(tensors, str(path), metadata={"format": "pt"})),
            CONFIG_NAME: lambda path: _write_text(path, text),
        },
    )
    return directory
