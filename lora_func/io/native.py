"""lora_func's own format: one safetensors file, exact reload.

Layout of a file:

- tensors ``params/<key>`` and ``buffers/<key>``, keyed exactly as ``adapter.params`` /
  ``adapter.buffers`` (so a composed adapter's part ``i`` is ``params/<i>/<key>`` and a combined
  adapter's mixing weights are ``params/weights``), contiguous, in the adapter dtype;
- metadata ``tree``: JSON describing the adapter (each leaf's spec, per-layer static info,
  base fingerprints and, for a rank-padded stack, each member's spec and layers; the
  composition structure above the leaves); ``digest``: a sha256 over the metadata that defines
  the adapter (``format``, ``format_version``, ``tree``, ``trainable_only``,
  ``buffer_digests``) and every tensor's name, dtype, shape and bytes, checked on load, so a
  corrupted file (or one edited by hand, say its ``alpha``) is refused instead of giving
  silently different outputs (safetensors itself has no checksum);
- with ``trainable_only=True``: no buffers; instead ``buffer_digests``, a digest of each
  layer's buffers, and ``load(path, model=)`` rebuilds them by re-running the variant's init
  on the model and refuses, naming the layer, when the result differs.

Since everything (residuals, singular bases, EVA's per-layer ranks) is stored, a reload
needs no calibration data and gives bit-identical outputs.

The header is written in one canonical order (safetensors writes the metadata in a random
order, different on every save), so saving the same adapter twice gives the same bytes.

Format versions: ``"2"`` (written); ``"1"`` (read), whose ``digest`` covers only the tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from lora_func._model import base_params, numbered_layers, shared_init, shared_view, target_weights, variant_init, weight_fingerprint
from lora_func.adapter import (
    NODE_TYPES,
    SHARED,
    Adapter,
    AdapterLayer,
    AdapterLike,
    AdapterNode,
    Combinator,
    SharedTensors,
    leaves,
    part_prefix,
    walk,
)
from lora_func.checks import check_float_targets, check_model, check_path
from lora_func.io._files import read_safetensors, safetensors_write, write_file
from lora_func.io._prompt_files import is_prompt_file, load_prompt_file, save_prompt_file
from lora_func.prompts._apply import contains_prompt
from lora_func.io._validate import refuse_non_finite
from lora_func.quantized import logical_shape
from lora_func.spec import LAYER_TYPES, AdapterSpec
from lora_func.targeting import CONV_LAYOUTS, MHA_LAYOUTS, PARAM_LAYOUTS, Target, check_kinds, kind_of_layout, module_kind, stored_shape
from lora_func.variants import LayerInfo, TensorDict, get_variant

__all__ = ["load", "save"]

FORMAT = "lora_func"
FORMAT_VERSION = "2"
# Versions load() reads. In "1" the digest covers only the tensors (see _file_digest).
READABLE_VERSIONS = ("1", "2")
# The metadata entries that define the adapter, covered by the file's digest.
DIGESTED_METADATA = ("format", "format_version", "tree", "trainable_only", "buffer_digests")


# ------------------------------------------------------------------------------- metadata


def _layer_to_json(layer: AdapterLayer) -> dict:
    return {
        "target": layer.target.to_dict(),
        "info": {
            "d_in": layer.info.d_in,
            "d_out": layer.info.d_out,
            "r": layer.info.r,
            "alpha": layer.info.alpha,
            "has_bias": layer.info.has_bias,
            "options": [list(kv) for kv in layer.info.options],
        },
        "param_shapes": [[n, list(s)] for n, s in layer.param_shapes],
        "buffer_shapes": [[n, list(s)] for n, s in layer.buffer_shapes],
        "base_fingerprint": layer.base_fingerprint,
    }


def _layer_from_json(data: dict) -> AdapterLayer:
    info, target = data["info"], Target.from_dict(data["target"])
    # a conv target's kernel comes from its stored shape (layer_info's rule), not from the file
    kernel = target.shape[2:] if target.layout in CONV_LAYOUTS else ()
    # a sequence-valued option is a tuple (hashable), which JSON writes as a list
    options = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in info["options"])
    return AdapterLayer(
        target=target,
        info=LayerInfo(**(info | {"options": options, "kernel": kernel, "kind": kind_of_layout(target.layout)})),
        param_shapes=tuple((n, tuple(s)) for n, s in data["param_shapes"]),
        buffer_shapes=tuple((n, tuple(s)) for n, s in data["buffer_shapes"]),
        base_fingerprint=data["base_fingerprint"],
    )


def _tree_to_json(node: AdapterLike) -> dict:
    """The static structure of ``node`` (no tensors): a leaf's spec, layers and stack members;
    a combinator's kind, parts and :meth:`~lora_func.adapter.Combinator.json_fields`."""
    if isinstance(node, Combinator):
        return {"kind": node.tag, "parts": [_tree_to_json(part) for part in node.parts], **node.json_fields()}
    assert isinstance(node, Adapter)  # a leaf
    members = None
    if node.members is not None:
        members = [[json.loads(spec.to_json()), [_layer_to_json(layer) for layer in layers]] for spec, layers in node.members]
    out = {
        "kind": node.tag,
        "spec": json.loads(node.spec.to_json()),
        "layers": [_layer_to_json(layer) for layer in node.layers],
        "members": members,
    }
    if node.shared is not None:  # only then: files of other adapters stay byte-identical
        out["shared"] = _shared_to_json(node.shared)
    if node.member_shared is not None:  # a rank-padded stack's members' own shared shapes
        out["member_shared"] = [_shared_to_json(s) for s in node.member_shared]
    return out


def _shared_to_json(shared: SharedTensors | None) -> dict | None:
    if shared is None:
        return None
    return {"param_shapes": [[n, list(s)] for n, s in shared.param_shapes], "buffer_shapes": [[n, list(s)] for n, s in shared.buffer_shapes]}


def _shared_from_json(data: dict | None) -> SharedTensors | None:
    if data is None:
        return None
    return SharedTensors(
        param_shapes=tuple((n, tuple(s)) for n, s in data["param_shapes"]),
        buffer_shapes=tuple((n, tuple(s)) for n, s in data["buffer_shapes"]),
    )


@dataclasses.dataclass(frozen=True)
class _Skeleton:
    """One node of a saved tree, parsed (specs and layers built), without tensors: what
    ``load`` checks against the file's tensors and the model, then fills. ``parts`` as in
    the adapter tree, so :func:`~lora_func.adapter.walk` walks it."""

    kind: type[AdapterNode]
    parts: tuple[_Skeleton, ...] = ()
    fields: dict = dataclasses.field(default_factory=dict)  # a combinator's json_fields
    spec: AdapterSpec | None = None  # a leaf's
    layers: tuple[AdapterLayer, ...] = ()
    members: tuple[tuple[AdapterSpec, tuple[AdapterLayer, ...]], ...] | None = None
    shared: SharedTensors | None = None  # a leaf's tensors every layer reads
    member_shared: tuple[SharedTensors | None, ...] | None = None

    def groups(self) -> list[tuple[str, tuple[tuple[str, tuple[int, ...]], ...], tuple[tuple[str, tuple[int, ...]], ...]]]:
        """``(module, param shapes, buffer shapes)`` of each layer of a leaf, then of its shared tensors."""
        out = [(layer.target.module, layer.param_shapes, layer.buffer_shapes) for layer in self.layers]
        return out + ([(SHARED, self.shared.param_shapes, self.shared.buffer_shapes)] if self.shared is not None else [])

    def own_shapes(self) -> dict[str, tuple[int, ...]]:
        """A combinator's own tensors and their shapes without stack axes (they depend only on its parts)."""
        return self.kind.own_shapes_of(self)


def _skeleton(data: dict) -> _Skeleton:
    kind = NODE_TYPES[data["kind"]]
    if kind is Adapter:
        members = None
        if data["members"] is not None:
            members = tuple(
                (AdapterSpec.from_json(json.dumps(spec)), numbered_layers(tuple(_layer_from_json(layer) for layer in layers)))
                for spec, layers in data["members"]
            )
        spec = AdapterSpec.from_json(json.dumps(data["spec"]))
        shared = _shared_from_json(data.get("shared"))
        member_shared = None if data.get("member_shared") is None else tuple(_shared_from_json(s) for s in data["member_shared"])
        layers = numbered_layers(tuple(_layer_from_json(layer) for layer in data["layers"]))
        return _Skeleton(Adapter, spec=spec, layers=layers, members=members, shared=shared, member_shared=member_shared)
    # What Combinator.from_json reads, read here so that a missing field is metadata damage.
    fields = {key: data[key] for key in cast("type[Combinator]", kind).json_field_names()}
    return _Skeleton(kind, parts=tuple(_skeleton(part) for part in data["parts"]), fields=fields)


def tensors_digest(tensors: Mapping[str, Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (sorted by name)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        data = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def _file_digest(metadata: Mapping[str, str], tensors: Mapping[str, Tensor]) -> str:
    """The file's ``digest``: sha256 over the metadata that defines the adapter
    (:data:`DIGESTED_METADATA`, as stored) and the tensors (:func:`_digest`). A version "1"
    file's digest is the tensors' alone."""
    if metadata.get("format_version") == "1":
        return tensors_digest(tensors)
    digest = hashlib.sha256(json.dumps([[key, metadata.get(key)] for key in DIGESTED_METADATA]).encode())
    digest.update(tensors_digest(tensors).encode())
    return digest.hexdigest()


def _canonical_header(path: str) -> None:
    """Rewrite the safetensors header of ``path`` in place with the metadata in sorted order,
    so one adapter always gives the same bytes (safetensors writes the metadata in the random
    order of a Rust ``HashMap``). The tensor entries and data are left as they are; the header
    keeps its length (same content, same escaping), else the file is left as written (valid,
    only not canonical)."""
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        metadata = header.pop("__metadata__", {})
        text = json.dumps(
            {"__metadata__": dict(sorted(metadata.items()))} | header, separators=(",", ":"), ensure_ascii=False
        ).encode()
        if len(text) <= length:
            f.seek(8)
            f.write(text + b" " * (length - len(text)))


# ----------------------------------------------------------------------------------- save


def save(adapter: AdapterLike, path: str | os.PathLike, *, trainable_only: bool = False) -> Path:
    """Write ``adapter`` (an ``Adapter``, ``Composed`` or ``Combined``) to ``path`` (a
    ``.safetensors`` file), atomically, and return the path.

    The file is written next to ``path`` under a temporary name and renamed into place, so
    ``path`` is never half-written (an interrupted save leaves the previous file intact).

    ``trainable_only=True`` stores only the trainable tensors and a digest of each layer's
    buffers (PiSSA's ``W_res``, DeLoRA's column norms, AntiPaSTO's singular bases): a much
    smaller file for residual variants. ``load(path, model=model)`` then rebuilds the buffers
    from the model and refuses a model (or a platform) on which they come out different.
    Not for stacked adapters (their rank masks are not reproducible by an init).
    """
    if not isinstance(adapter, AdapterNode):
        raise TypeError(  # error: save-not-adapter
            f"save() expects an Adapter, Composed or Combined, got {type(adapter).__name__}; "
            f"build one with lora_func.init_adapter(model, spec)"
        )
    check_path(path, "save")
    if contains_prompt(adapter):  # an input-level adapter (lora_func.prompts): its buffers are always saved
        return save_prompt_file(adapter, Path(path), {"format": FORMAT, "format_version": FORMAT_VERSION})
    tree = _tree_to_json(adapter)
    if trainable_only and adapter.stack_shape:
        raise ValueError(  # error: save-trainable-only-stacked
            f"save(trainable_only=True) cannot rebuild the buffers of a stacked adapter (stack_shape "
            f"{adapter.stack_shape}); save it with trainable_only=False, or unstack() and save each member"
        )
    path = Path(path)
    tensors: dict[str, Tensor] = {f"params/{k}": v for k, v in adapter.params.items()}
    buffer_digests: dict[str, dict[str, str]] = {}
    if trainable_only:
        for prefix, leaf in leaves(adapter):
            buffer_digests[prefix] = {
                layer.target.module: tensors_digest({n: leaf.buffers[f"{layer.target.module}.{n}"] for n, _ in layer.buffer_shapes})
                for layer in leaf.layers
                if layer.buffer_shapes
            }
            if leaf.shared is not None and leaf.shared.buffer_shapes:
                buffer_digests[prefix][SHARED] = tensors_digest(leaf.shared_tensors()[1])
    else:
        tensors |= {f"buffers/{k}": v for k, v in adapter.buffers.items()}
    tensors = _unaliased({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
    # What load checks, checked before writing: a file save wrote always loads. An adapter's
    # dict edited in place (a half-precision tensor put into adapter.params) is refused here.
    wrong = _tensor_problems(_skeleton(json.loads(json.dumps(tree))), tensors)
    if wrong:
        raise ValueError(  # error: save-tensor-mismatch
            f"save(): the adapter's tensors do not match what it reports: {wrong[:5]}; the file would not load. "
            f"Build new values with adapter.with_params(params) (tensors of the adapter dtype, adapter.spec.dtype, "
            f"and its shapes) instead of editing adapter.params in place"
        )
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tree": json.dumps(tree),
        "trainable_only": json.dumps(trainable_only),
        "buffer_digests": json.dumps(buffer_digests),
    }
    metadata["digest"] = _file_digest(metadata, tensors)

    def write(tmp: Path) -> None:
        safetensors_write(path, lambda: save_file(tensors, str(tmp), metadata=metadata))
        _canonical_header(str(tmp))

    write_file(path, write)
    return path


def _unaliased(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors that share memory (e.g. steering buffers expanded from one
    scalar): copy every tensor whose storage was already seen."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if storage in seen and tensor.numel() else tensor
        seen.add(storage)
    return out


# ----------------------------------------------------------------------------------- load


def _sane_layer(layer: AdapterLayer) -> bool:
    """Sizes and rank positive integers, alpha a finite number, a known layout, names that are
    strings: a hostile file can recompute the checksum, and a NaN alpha (or a float rank, or
    a made-up layout) would give NaN or wrong outputs instead of an error."""
    info, target = layer.info, layer.target
    sizes = (info.d_in, info.d_out, info.r, target.d_in, target.d_out)
    names = (target.module, target.weight_key, *target.tied_keys, *([] if target.bias_key is None else [target.bias_key]))
    return (
        target.layout in (*LAYER_TYPES, *PARAM_LAYOUTS, *MHA_LAYOUTS)
        and all(isinstance(n, str) for n in names)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in target.shape)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)
        and isinstance(info.alpha, (int, float))
        and not isinstance(info.alpha, bool)
        and math.isfinite(info.alpha)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for _, shape in layer.param_shapes + layer.buffer_shapes for n in shape)
    )


def _parse(path: Path, metadata: Mapping[str, str]) -> tuple[_Skeleton, bool, dict[str, dict[str, str]], str]:
    """``(skeleton, trainable_only, buffer_digests, digest)`` from the file's metadata: the
    tree is parsed once, every spec and layer built (stack members too), so damage fails
    here as metadata damage."""
    problem = None
    try:
        skeleton = _skeleton(json.loads(metadata["tree"]))
        trainable_only = json.loads(metadata["trainable_only"])
        buffer_digests = json.loads(metadata["buffer_digests"])
        layers = [
            layer for _, leaf in leaves(skeleton) for layers in (leaf.layers, *(ls for _, ls in leaf.members or ())) for layer in layers
        ]
        insane = [layer.target.module for layer in layers if not _sane_layer(layer)]
        if insane:
            problem = f"layer info of {insane[:3]} has sizes that are not positive integers, a non-finite alpha or an unknown layout"
        elif not isinstance(trainable_only, bool) or not (
            isinstance(buffer_digests, dict) and all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in buffer_digests.values())
        ):
            problem = f"trainable_only={trainable_only!r} or buffer_digests are not what lora_func writes"
        digest = metadata["digest"]
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as err:
        # RecursionError: a hostile, deeply nested tree (json.loads and the tree walk recurse).
        problem = f"{type(err).__name__}: {err}"
    if problem is not None:
        raise ValueError(f"{path} has damaged lora_func metadata ({problem}); save the adapter again")  # error: load-damaged-metadata
    return skeleton, bool(trainable_only), buffer_digests, digest


def _expected_tensors(skeleton: _Skeleton, trainable_only: bool) -> set[str]:
    expected = set()
    for prefix, node in walk(skeleton):
        expected |= {f"params/{prefix}{name}" for name in node.own_shapes()}
        for module, param_shapes, buffer_shapes in node.groups():
            expected |= {f"params/{prefix}{module}.{name}" for name, _ in param_shapes}
            if not trainable_only:
                expected |= {f"buffers/{prefix}{module}.{name}" for name, _ in buffer_shapes}
    return expected


def _tensor_problems(skeleton: _Skeleton, tensors: Mapping[str, Tensor]) -> list[str]:
    """Where the file's tensors disagree with its own metadata: each leaf's tensors must all
    have one leading stack shape followed by the recorded shape, params the spec's dtype and
    buffers a float dtype (int64 where the variant stores positions); a combinator's own tensors (``weights``) float, of their shape
    after stack axes. The checksum cannot catch this: a hostile file recomputes it."""
    problems = []
    for prefix, node in walk(skeleton):
        for name, shape in node.own_shapes().items():
            own = tensors[f"params/{prefix}{name}"]
            got = tuple(own.shape)
            if len(got) < len(shape) or got[len(got) - len(shape) :] != shape or not own.is_floating_point():
                problems.append(f"params/{prefix}{name}: shape {got} dtype {own.dtype}, not float {name} of shape (..., {shape})")
        if node.spec is None:
            continue
        stacks = set()
        for module, param_shapes, buffer_shapes in node.groups():
            for kind, shapes in (("params", param_shapes), ("buffers", buffer_shapes)):
                for name, shape in shapes:
                    key = f"{kind}/{prefix}{module}.{name}"
                    if key not in tensors:
                        continue  # trainable_only: rebuilt from the model
                    got = tuple(tensors[key].shape)
                    if len(got) < len(shape) or got[len(got) - len(shape) :] != shape:
                        problems.append(f"{key}: shape {got}, the metadata says {shape}")
                        continue
                    stacks.add(got[: len(got) - len(shape)])
                    if kind == "params" and tensors[key].dtype != node.spec.dtype:
                        problems.append(f"{key}: dtype {tensors[key].dtype}, the spec says {node.spec.dtype}")
                    elif name.partition("@")[0] in get_variant(node.spec.variant).integer_buffers:  # (a grouped one's slot: Variant.groups)
                        if tensors[key].dtype != torch.int64:
                            problems.append(f"{key}: dtype {tensors[key].dtype}, not the int64 positions the variant stores")
                    elif not tensors[key].is_floating_point():
                        problems.append(f"{key}: dtype {tensors[key].dtype}, not floating-point")
        if len(stacks) > 1:
            problems.append(f"the tensors of {prefix or 'the adapter'} have different stack shapes {sorted(stacks)}")
    return problems


def _model_problems(model: nn.Module, base: Mapping[str, Tensor], layers: list[AdapterLayer]) -> list[str]:
    """Why ``layers`` do not fit the model whose tensors are ``base`` (empty when they do)."""
    problems = []
    modules = dict(model.named_modules())
    for layer in layers:
        t = layer.target
        stored = stored_shape(t)
        kind = module_kind(modules, t)
        if t.weight_key not in base:
            problems.append(f"{t.weight_key}: not in the model")
        elif kind != t.layout:
            # Same name and, for a square layer, same shape: an nn.Linear adapter on a GPT-2
            # Conv1D would run transposed and give wrong outputs without an error.
            problems.append(f"{t.weight_key}: adapter built for a {t.layout} layer, the model's is {kind or type(modules.get(t.owner)).__name__}")
        elif logical_shape(base[t.weight_key]) != stored:
            problems.append(f"{t.weight_key}: adapter built for {stored}, model has {logical_shape(base[t.weight_key])}")
        elif layer.base_fingerprint is not None and weight_fingerprint(base[t.weight_key]) != layer.base_fingerprint:
            problems.append(
                f"{t.weight_key}: the adapter was derived from different base weights "
                f"(fingerprint {layer.base_fingerprint}, model {weight_fingerprint(base[t.weight_key])})"
            )
    return sorted(problems)


def _rebuild_buffers(
    path: Path, model: nn.Module, spec: AdapterSpec, layer: AdapterLayer, expected_digest: str | None, shared: TensorDict | None = None
) -> dict[str, Tensor]:
    """Re-run the variant's init on ``model`` for one layer; its buffers, checked against the
    digest. ``shared``: the layer's view of the rebuilt shared tensors (``shared_from_weights``)."""
    # Buffers never depend on the random draws of the variants that have them at niter=0 /
    # full SVD; a variant whose buffers do (PiSSA's randomized SVD) fails the digest check below.
    _, buffers, _ = variant_init(
        get_variant(spec.variant), spec, model.get_submodule(layer.target.owner), layer.target, layer.info,
        generator=torch.Generator().manual_seed(0), shared=shared,
    )
    buffers = {name: buffers[name].detach().contiguous() for name, _ in layer.buffer_shapes if name in buffers}
    if sorted(buffers) != sorted(name for name, _ in layer.buffer_shapes) or tensors_digest(buffers) != expected_digest:
        raise ValueError(  # error: load-buffers-differ
            f"{path} holds only trainable tensors, and the buffers of layer {layer.target.module} "
            f"({spec.variant}) that its init gives on this {type(model).__name__} differ from the saved ones "
            f"(different base weights, another device or BLAS, or buffers changed after init such as a "
            f"steering value); load it onto the original model and platform, or save with trainable_only=False"
        )
    return buffers


def _rebuild_shared_buffers(
    path: Path, model: nn.Module, leaf: _Skeleton, expected_digest: str | None, devices: Mapping[str, torch.device]
) -> dict[str, Tensor]:
    """Re-run the variant's ``shared_init`` (e.g. a basis drawn from a seed option, as peft
    re-creates VeRA's projections on load); its buffers, checked against the digest."""
    assert leaf.spec is not None and leaf.shared is not None
    variant = get_variant(leaf.spec.variant)
    infos = {layer.target.module: layer.info for layer in leaf.layers}
    device = devices.get(leaf.layers[0].target.module, torch.device("cpu")) if leaf.layers else torch.device("cpu")
    weights = target_weights(model, [layer.target for layer in leaf.layers], leaf.spec) if variant.shared_from_weights else None
    _, flat, _ = shared_init(variant, leaf.spec, infos, device=device, generator=torch.Generator().manual_seed(0), weights=weights)
    buffers = {key.removeprefix(f"{SHARED}."): value for key, value in flat.items()}
    if sorted(buffers) != sorted(name for name, _ in leaf.shared.buffer_shapes) or tensors_digest(buffers) != expected_digest:
        raise ValueError(  # error: load-shared-buffers-differ
            f"{path} holds only trainable tensors, and the shared buffers ({leaf.spec.variant}) that its init gives "
            f"on this {type(model).__name__} differ from the saved ones (drawn from the init's generator, not from "
            f"an option, or changed after init); save with trainable_only=False"
        )
    return buffers


def load(path: str | os.PathLike, model: nn.Module | None = None, *, check_finite: bool = True) -> AdapterLike:
    """Read an adapter written by :func:`save` (an ``Adapter``, ``Composed`` or ``Combined``).

    Everything is checked before anything is returned: the file's checksum (a corrupted file
    raises instead of giving different outputs), that its tensors match its metadata, and,
    with ``model``, that every target exists in it with the saved shape and layout and, for
    variants derived from their base weights (PiSSA, AntiPaSTO), that the weights are the
    same (fingerprint). With ``model`` the tensors move to each target weight's device.
    A file saved with ``trainable_only=True`` needs ``model``: its buffers are rebuilt from
    it. Params come back as leaf tensors with ``requires_grad=True``.

    A tensor holding a NaN or inf raises too, naming the keys (the adapter's every output would
    be NaN); ``check_finite=False`` loads such a file as it is (e.g. to inspect a diverged run).
    """
    check_path(path, "load")
    path = Path(path)
    if model is not None:
        check_model(model, "load")
    if not path.is_file():
        raise FileNotFoundError(f"no adapter file at {path}; pass the path of a file written by lora_func.save")  # error: load-missing
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT:
        hint = " (a peft checkpoint? use lora_func.load_peft on its directory)" if "adapter_model" in path.name else ""
        raise ValueError(f"{path} is not a lora_func adapter file: its metadata has no format={FORMAT!r}{hint}")  # error: load-foreign
    if metadata.get("format_version") not in READABLE_VERSIONS:
        raise ValueError(  # error: load-version
            f"{path} has format_version {metadata.get('format_version')!r}; this lora_func reads "
            f"{list(READABLE_VERSIONS)}: load it with the (newer) lora_func that wrote it"
        )
    if is_prompt_file(metadata):  # an input-level adapter (lora_func.prompts)
        if check_finite:
            refuse_non_finite(tensors, path, "load(..., check_finite=False)")
        return load_prompt_file(path, tensors, metadata, model)
    skeleton, trainable_only, buffer_digests, digest = _parse(path, metadata)
    expected = _expected_tensors(skeleton, trainable_only)
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(  # error: load-inconsistent
            f"{path} is inconsistent: missing tensors {missing}, unexpected tensors {unexpected}; "
            f"the file was edited or assembled by hand: save the adapter again"
        )
    wrong = _tensor_problems(skeleton, tensors)
    if wrong:
        raise ValueError(  # error: load-tensor-mismatch
            f"{path} is inconsistent: its tensors do not match its metadata: {wrong[:5]}; the file was edited or "
            f"assembled by hand: save the adapter again"
        )
    if _file_digest(metadata, tensors) != digest:
        raise ValueError(  # error: load-corrupted
            f"{path} is corrupted: its tensors or metadata do not match the checksum saved with them (damaged on "
            f"disk or in transfer, or edited by hand); save the adapter again (change hyperparameters through "
            f"the API, not in the file)"
        )
    if check_finite:  # (after the checksum: a damaged file says so first)
        refuse_non_finite(tensors, path, "load(..., check_finite=False)")
    leaf_nodes = list(leaves(skeleton))
    for _, leaf in leaf_nodes:  # a variant adapts the kinds it declares (a file from elsewhere may claim more)
        check_kinds(get_variant(cast(AdapterSpec, leaf.spec).variant), [layer.target for layer in leaf.layers], f"load({path})")
    all_layers = [layer for _, leaf in leaf_nodes for layer in leaf.layers]
    with_buffers = sorted(layer.target.module for layer in all_layers if layer.buffer_shapes)
    with_buffers += [SHARED for _, leaf in leaf_nodes if leaf.shared is not None and leaf.shared.buffer_shapes][:1]
    if trainable_only and with_buffers and model is None:
        raise ValueError(  # error: load-trainable-only-needs-model
            f"{path} holds only the trainable tensors (saved with trainable_only=True); pass model=... (the model "
            f"it was trained on) so that load can rebuild the buffers of {with_buffers[:3]}"
        )
    devices: dict[str, torch.device] = {}
    if model is not None:
        base = base_params(model)
        problems = _model_problems(model, base, all_layers)
        if problems:
            raise ValueError(  # error: load-wrong-model
                f"{path} does not fit {type(model).__name__}: {problems}; load it onto the model the adapter was built on"
            )
        meta = sorted(layer.target.weight_key for layer in all_layers if base[layer.target.weight_key].is_meta)
        if meta:
            raise ValueError(  # error: load-meta-model
                f"load({path}, model=...): the target weights {meta[:5]} of {type(model).__name__} are on the meta "
                f"device (no values): the adapter's tensors would lose theirs. Materialise the model first "
                f"(model.to_empty(device=...) and load its weights), or load without model= and move the adapter later"
            )
        check_float_targets(base, all_layers, f"load({path}, model=...)")
        devices = {layer.target.module: base[layer.target.weight_key].device for layer in all_layers}
        if trainable_only:
            rebuilt: dict[str, Tensor] = {}
            for prefix, leaf in leaf_nodes:
                # (the shared ones first: a shared_from_weights variant's layers are built from them)
                shared_built: dict[str, Tensor] = {}
                if leaf.shared is not None and leaf.shared.buffer_shapes:
                    expected_digest = buffer_digests.get(prefix, {}).get(SHARED)
                    for name, value in _rebuild_shared_buffers(path, model, leaf, expected_digest, devices).items():
                        rebuilt[f"buffers/{prefix}{SHARED}.{name}"] = value
                        shared_built[f"{SHARED}.{name}"] = value
                variant = get_variant(cast(AdapterSpec, leaf.spec).variant)
                groups = variant.layer_groups(cast(AdapterSpec, leaf.spec).targets, {layer.target.module: layer.info for layer in leaf.layers})
                for layer in leaf.layers:
                    if layer.buffer_shapes:
                        expected_digest = buffer_digests.get(prefix, {}).get(layer.target.module)
                        view = shared_view(shared_built, groups[layer.target.module]) if variant.shared_from_weights else None
                        for name, value in _rebuild_buffers(path, model, leaf.spec, layer, expected_digest, view).items():
                            rebuilt[f"buffers/{prefix}{layer.target.module}.{name}"] = value
            tensors |= rebuilt
    return _fill(skeleton, "", tensors, devices)


def _fill(skeleton: _Skeleton, prefix: str, tensors: Mapping[str, Tensor], devices: Mapping[str, torch.device]) -> AdapterLike:
    """The adapter ``skeleton`` describes, with its tensors (checked) moved to ``devices``."""
    if skeleton.spec is None:
        parts = [_fill(part, part_prefix(prefix, i), tensors, devices) for i, part in enumerate(skeleton.parts)]
        device = _device_of(parts[0])
        own = {name: tensors[f"params/{prefix}{name}"].to(device) for name in skeleton.own_shapes()}
        return cast("type[Combinator]", skeleton.kind).from_json(skeleton.fields, parts, own)
    params, buffers = {}, {}
    first = skeleton.layers[0].target.module if skeleton.layers else SHARED
    # The shared tensors first, as init_adapter orders them (code that matches an optimizer's
    # state to the tensors by position must see the same order after a reload).
    groups = sorted(skeleton.groups(), key=lambda group: group[0] != SHARED)
    for module, param_shapes, buffer_shapes in groups:
        # The shared tensors go where the first layer goes (init_adapter puts them there).
        device = devices.get(first if module == SHARED else module, torch.device("cpu"))
        for name, _ in param_shapes:
            params[f"{module}.{name}"] = tensors[f"params/{prefix}{module}.{name}"].to(device).requires_grad_(True)
        for name, _ in buffer_shapes:
            buffers[f"{module}.{name}"] = tensors[f"buffers/{prefix}{module}.{name}"].to(device)
    adapter = Adapter(params, buffers, skeleton.spec, skeleton.layers, skeleton.members, shared=skeleton.shared)
    if skeleton.member_shared is None:
        return adapter
    return Adapter._unchecked(adapter.params, adapter.buffers, adapter.spec, adapter.layers, adapter.members, adapter.shared, skeleton.member_shared)


def _device_of(adapter: AdapterLike) -> torch.device:
    for tensor in (*adapter.params.values(), *adapter.buffers.values()):
        return tensor.device
    return torch.device("cpu")
