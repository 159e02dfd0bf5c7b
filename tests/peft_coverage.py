"""The count in docs/io.md: of peft's configurations for lora_func's methods (each variant with a
peft entry x each layer kind of tests/models.LAYER_KIND_MODEL), how many load exactly, how many
lora_func refuses, and how many peft itself has not.

Each cell, on the tiny model of that kind in float64 (the expert model, MiCA and PSOFT in float32):

- lora_func adapts the kind: its adapter (the contract row's spec, perturbed) is written by
  ``save_peft``; where ``save_peft`` refuses, the first words of its reason are recorded (peft
  refuses the method on that kind: GPT-2 ``Conv1D``, a conv of a shape it does not take).
  Otherwise four parts are measured (``_measured`` gives the label):
  (a) peft's own checkpoint for that config (peft builds the model, every trainable tensor
  perturbed, ``save_pretrained``) read by ``load_peft``: peft's logits, and every trainable
  tensor's gradient for a loss of the logits, per tensor under peft's checkpoint keys (where peft's
  autograd differs, central finite differences of peft's forward are the oracle: ``(FD)``);
  (b) peft loads ``save_peft``'s file (``PeftModel.from_pretrained``) with lora_func's outputs and
  ``load_peft`` reads it back to them; (c) ``init_adapter`` from a seeded generator gives peft's
  initial tensors as peft writes them (``INIT_CONVENTIONS``; ``INIT_APART`` lists the cells where
  it cannot, and why). Relative 1e-9 (2e-5 in float32); the init exactly.
- lora_func does not adapt the kind: the variant's peft config (as ``save_peft`` writes it on
  Linear layers) retargeted at the kind's modules; peft builds it (``get_peft_model``): **refused**
  by lora_func (``variant-kind-unsupported``), or peft raises: **peft has none**.

Run ``python -m tests.peft_coverage`` from the repository root to print the table (about 5
minutes); tests/test_peft_coverage.py checks docs/io.md's against it for a sample of cells.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

import lora_func as lf
from tests.models import DEFAULT_TARGETS, LAYER_KIND_MODEL, MODEL_SPEC, tiny_model
from tests.variant_table import ROWS

KINDS = sorted(LAYER_KIND_MODEL)
# peft initialises these in float32 only (PSOFT refuses a float64 model): probed in float32, 2e-5
FLOAT32_ONLY = ("mica", "psoft")


def _inputs(model_kind: str) -> torch.Tensor:
    from tests.models import tokens

    return tokens()


def _in_input_dtype(model):
    """transformers' RMSNorm and Llama's eager softmax compute in float32: in the input dtype here,
    on both sides."""
    import types

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(forward, m)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "model_type", "") == "llama":
        # (Llama's eager attention takes its softmax in float32: torch's SDPA keeps float64, so
        # that finite differences of peft's forward resolve its gradients at 1e-6)
        config._attn_implementation = "sdpa"
    return model


def _build(row, kind: str, dtype: torch.dtype):
    """(model, adapter) of the contract row on the kind's tiny model, both in ``dtype``."""
    from tests.contract_helpers import calibration_batches, spec_for

    model_kind = LAYER_KIND_MODEL[kind]
    model = _in_input_dtype(tiny_model(model_kind, dtype=dtype))
    spec = spec_for(row, model_kind, dtype=dtype)
    calibration = calibration_batches() if row.calibration else None
    return model, lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(100), calibration=calibration)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _perturbed(adapter):
    g = torch.Generator().manual_seed(7)
    return adapter.with_params({k: v.detach() + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})


def _quiet():
    manager = warnings.catch_warnings()
    manager.__enter__()
    warnings.simplefilter("ignore")
    return manager


class _BlockDiag:
    """peft's CUDA ``FastBlockDiag`` on the CPU (BOFT with several butterfly factors)."""

    @staticmethod
    def apply(blocks):
        return torch.stack([torch.block_diag(*factor) for factor in blocks])


class _Float64Torch:
    """``torch`` with ``float32`` meaning ``float64``. peft's DEFT layer casts to float32 whatever
    the model's dtype (``_project``, ``forward``): unmodified it differs from lora_func's float64
    by float32 round-off (2e-7 on Linear, 6e-8 on Conv1D); with this proxy as its module's
    ``torch`` (nothing else changed, as tests/test_variant_deft.py's oracle) it agrees exactly."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


def cell(variant: str, kind: str, tmp: Path) -> str:
    """``"exact"``, ``"differs"``, ``"refused: <reason>"``, ``"peft has none"`` or ``"error: ..."``."""
    import peft.tuners.boft.layer as boft_layer
    import peft.tuners.c3a.layer as c3a_layer
    import peft.tuners.deft.layer as deft_layer
    import peft.tuners.frod.layer as frod_layer
    import pytest

    from tests.test_variant_frod import _unrounded

    with pytest.MonkeyPatch.context() as mend:
        mend.setattr(c3a_layer, "torch", _Float64Torch())  # C3A's float32 casts in the probe's float64
        # FRoD's U and λ solved in float64 and kept there (peft rounds them to float32 whatever the dtype)
        mend.setattr(frod_layer.FrodLayer, "_calculate_frod_u_and_lambda", _unrounded)
        mend.setattr(boft_layer, "_FBD_CUDA", object())  # peft with its CUDA extension, emulated
        mend.setattr(boft_layer, "FastBlockDiag", _BlockDiag)
        mend.setattr(deft_layer, "torch", _Float64Torch())  # DEFT's float32 casts in the probe's float64
        try:
            return _cell(variant, kind, tmp)
        except Exception as err:  # recorded, not hidden: the table shows it
            return f"error: {type(err).__name__}: {str(err)[:80]}"


def _loss(logits: torch.Tensor) -> torch.Tensor:
    """A scalar of the logits with weights that break every symmetry (not ``labels=``: transformers'
    loss casts to float32)."""
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64).to(logits.dtype)
    return (logits * weights).sum() / logits.numel()


def _peft_key(name: str) -> str:
    """peft's parameter name -> its key in the checkpoint (no adapter name; a tensor held once for
    every layer, TinyLoRA's vectors, under ``base_model.``)."""
    import re

    key = re.sub(r"^base_model\.model\..*\.tinylora_v\.", "base_model.tinylora_v.", name.replace(".default", ""))
    return key.removesuffix(".weight") if key.endswith("lora_magnitude_vector.weight") else key


def _as_peft(adapter, tensors: dict[str, torch.Tensor], model, directory: Path, task_type=None) -> dict[str, torch.Tensor]:
    """lora_func tensors (gradients, inits) under peft's keys and shapes, by ``save_peft``'s own mapping."""
    from safetensors.torch import load_file

    lf.save_peft(adapter.with_params({k: v.detach() for k, v in tensors.items()}), directory, model=model, task_type=task_type)
    return load_file(str(directory / "adapter_model.safetensors"))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def _trained(peft_model) -> list[tuple[str, torch.Tensor]]:
    """peft's trainable parameters, sorted (AdaLoRA's ``ranknum``, a constant it neither trains nor
    saves, left out)."""
    return [(n, p) for n, p in sorted(peft_model.named_parameters()) if p.requires_grad and "ranknum" not in n]


def _peft_built(model_kind: str, dtype, directory: Path, variant: str):
    from peft import PeftConfig, get_peft_model

    config = PeftConfig.from_pretrained(directory)
    config.inference_mode = False  # (save_peft writes True: peft then freezes the adapter)
    return get_peft_model(_in_input_dtype(tiny_model(model_kind, dtype=dtype)), config).eval()


def _call(variant, model, adapter, ids):
    if variant == "poly":  # a routed method: one task per batch row, peft's task_ids
        from lora_func.routed import task_call

        tasks = torch.arange(ids.shape[0]) % int(adapter.spec.option("n_tasks"))
        return _logits(task_call(model, adapter, ids, task_ids=tasks, use_cache=False))
    return _logits(lf.adapted_call(model, adapter, ids))


def _peft_call(variant, peft_model, ids, n_tasks=None):
    if variant == "poly":
        return _logits(peft_model(input_ids=ids, task_ids=torch.arange(ids.shape[0]) % n_tasks))
    return _logits(peft_model(ids))


def _checkpoint_keys(peft_model) -> dict[str, torch.Tensor]:
    """peft's tensors under their checkpoint keys, as ``save_pretrained`` maps them
    (``get_peft_model_state_dict`` on the live parameters: a tensor shared by every layer, a
    vector bank, is one key)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, state_dict=peft_model.state_dict(keep_vars=True), save_embedding_layers=False)


def _saved(peft_model, directory: Path) -> dict[str, torch.Tensor]:
    """What peft writes for ``peft_model`` (``save_pretrained``; not a targeted embedding's base
    table), read back."""
    from safetensors.torch import load_file

    peft_model.save_pretrained(directory, save_embedding_layers=False)
    return load_file(str(directory / "adapter_model.safetensors"))


def _from_peft(variant: str, kind: str, dtype, ours: Path, tmp: Path, rtol: float) -> tuple[float, float, str, list[str]]:
    """(a): peft's own checkpoint for the config of ``ours`` (peft builds the model, every trainable
    tensor perturbed, peft saves it) read by ``load_peft``: (relative output difference, the worst
    relative gradient difference over peft's trainable tensors, that tensor's key, the keys whose
    gradient differs from peft's autograd and equals central finite differences of peft's forward
    (the oracle where peft's backward is not its forward's derivative))."""
    from torch.func import grad

    model_kind = LAYER_KIND_MODEL[kind]
    task_type = "CAUSAL_LM" if variant == "poly" else None
    torch.manual_seed(0)
    peft_model = _peft_built(model_kind, dtype, ours, variant)
    n_tasks = getattr(peft_model.peft_config["default"], "n_tasks", None)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in _trained(peft_model):
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    peft_model.save_pretrained(tmp / "theirs")
    model = _in_input_dtype(tiny_model(model_kind, dtype=dtype))
    adapter = lf.load_peft(tmp / "theirs", model)
    ids = _inputs(model_kind)
    want = _peft_call(variant, peft_model, ids, n_tasks)
    off = _rel(_call(variant, model, adapter, ids), want)
    peft_model.zero_grad()
    _loss(want).backward()
    ours_grad = grad(lambda params: _loss(_call(variant, model, adapter.with_params(params), ids)))(dict(adapter.params))
    worst, where, by_fd = gradients_off(peft_model, adapter, ours_grad, model, tmp / "grads", rtol, lambda: _loss(_peft_call(variant, peft_model, ids, n_tasks)), task_type)
    return off, worst, where, by_fd


def gradients_off(peft_model, adapter, ours_grad, model, directory: Path, rtol: float, loss, task_type=None) -> tuple[float, str, list[str]]:
    """lora_func's gradients (``ours_grad``, by lora_func key) against peft's (after
    ``loss().backward()``), per trainable tensor under peft's checkpoint keys (``save_peft``'s
    mapping; by name where the adapter is stored converted, PiSSA / OLoRA): the worst relative
    difference, its key, and the keys that differ from peft's autograd but equal central finite
    differences of peft's forward ``loss``. A tensor peft writes under two keys (a
    ``modules_to_save`` copy's bias with ``bias="all"``) is compared once."""
    trained = {id(p) for _, p in _trained(peft_model)}
    mapped = _as_peft(adapter, ours_grad, model, directory, task_type)
    theirs: dict[int, list] = {}
    for key, param in sorted(_checkpoint_keys(peft_model).items()):
        if id(param) in trained:
            theirs.setdefault(id(param), [param, []])[1].append(key)
    worst, where, by_fd = 0.0, "", []
    for param, keys in theirs.values():
        key = next((k for k in keys if k in mapped and mapped[k].numel() == param.numel()), keys[0])
        by_name = key.removeprefix("base_model.model.").removesuffix(".weight")
        if key in mapped and mapped[key].numel() == param.numel():
            g_ours = mapped[key]
        elif by_name in ours_grad and ours_grad[by_name].numel() == param.numel():
            g_ours = ours_grad[by_name]
        else:
            return float("inf"), f"{key} not in load_peft's adapter", by_fd
        g_peft = param.grad if param.grad is not None else torch.zeros_like(param)
        g_ours = g_ours.reshape(g_peft.shape).to(g_peft.dtype)
        rel = _rel(g_ours, g_peft)
        if rel > rtol and _by_finite_differences(param, g_ours, loss):
            by_fd.append(key)
        elif rel > worst:
            worst, where = rel, key
    return worst, where, by_fd


def _by_finite_differences(param, ours: torch.Tensor, loss) -> bool:
    """Whether ``ours`` is the gradient of peft's forward loss along two random directions of
    ``param`` (central differences, relative 1e-6; in float64 only)."""
    if param.dtype != torch.float64:
        return False
    for seed in (11, 12):
        direction = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed), dtype=param.dtype)
        eps = 1e-5

        def at(step: float, direction: torch.Tensor = direction) -> float:
            with torch.no_grad():
                param.add_(step * direction)
                try:
                    return float(loss())
                finally:
                    param.sub_(step * direction)

        numeric = (at(eps) - at(-eps)) / (2 * eps)
        analytic = float((ours * direction).sum())
        if not abs(numeric - analytic) <= 1e-6 * max(abs(analytic), 1e-12):
            return False
    return True


def _reset_methods():
    """peft's layers' ``reset_*`` methods (the draws of a layer's init), by class."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    seen, todo = [], [BaseTunerLayer]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(c for c in cls.__subclasses__() if c not in seen)
    return [(cls, name) for cls in seen for name, f in list(vars(cls).items()) if name.startswith("reset_") and callable(f)]


def _seeded_peft(base, config, seed: int, *, constructors: bool, at_reset: bool):
    """``get_peft_model(base, config)`` with the global RNG seeded: before it, or (``at_reset``) at
    the start of the first ``reset_*`` of a peft layer or ``nn.init`` draw (after the placeholder
    draws peft's layers make before their init); ``constructors=False``: torch's layer
    constructors draw nothing (peft builds ``nn.Linear`` factors, then redraws them)."""
    import pytest
    from peft import get_peft_model

    with pytest.MonkeyPatch.context() as mend:
        if not constructors:
            for cls in (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
                mend.setattr(cls, "reset_parameters", lambda self: None)
        if at_reset:
            state = {"seeded": False}

            def seeding(f):
                def reset(*args, **kwargs):
                    if not state["seeded"]:
                        state["seeded"] = True
                        torch.manual_seed(seed)
                    return f(*args, **kwargs)

                return reset

            for cls, name in _reset_methods():
                mend.setattr(cls, name, seeding(vars(cls)[name]))
            for name in ("kaiming_uniform_", "kaiming_normal_", "normal_", "uniform_", "orthogonal_", "xavier_uniform_", "xavier_normal_"):
                mend.setattr(torch.nn.init, name, seeding(getattr(torch.nn.init, name)))
        torch.manual_seed(seed)
        return get_peft_model(base, config)


# the ways of seeding peft's init that lora_func's init_adapter(generator=...) follows, tried in order:
# (one layer at a time, constructors draw, seeded at the first reset_*)
INIT_CONVENTIONS = [
    (False, True, False), (False, False, False), (False, False, True), (False, True, True),
    (True, True, False), (True, False, False), (True, False, True), (True, True, True),
]


def _init_off(variant: str, kind: str, tmp: Path) -> tuple[float, str]:
    """(c): ``init_adapter`` from a seed against peft's initial tensors (trainable and frozen, as
    peft saves them) for the same config, in float32 (peft draws in float32 whatever the model's
    dtype), under the first of ``INIT_CONVENTIONS`` that agrees: the worst relative difference
    and that tensor's key ("" when every tensor is equal)."""
    import peft.tuners.c3a.layer as c3a_layer
    import peft.tuners.deft.layer as deft_layer
    import pytest
    from peft import PeftConfig

    from tests.contract_helpers import calibration_batches, spec_for

    row = ROWS[variant]
    model_kind = LAYER_KIND_MODEL[kind]
    model = _in_input_dtype(tiny_model(model_kind, dtype=torch.float32))
    spec = spec_for(row, model_kind, dtype=torch.float32)
    calibration = calibration_batches() if row.calibration else None
    task_type = "CAUSAL_LM" if variant == "poly" else None
    full = lf.init_adapter(model, spec, calibration=calibration)
    lf.save_peft(full, tmp / "init", model=model, task_type=task_type)
    config = PeftConfig.from_pretrained(tmp / "init")
    layers = [layer.target.module for layer in full.layers if layer.target.layout != "mha_out"]
    best = (float("inf"), "")
    with pytest.MonkeyPatch.context() as mend:
        mend.setattr(deft_layer, "torch", torch)  # peft's DEFT and C3A inits in their own float32
        mend.setattr(c3a_layer, "torch", torch)
        for per_layer, constructors, at_reset in INIT_CONVENTIONS:
            if per_layer and (len(layers) < 2 or spec.target_parameters):  # (the same as the whole)
                continue
            worst, where = 0.0, ""
            for names in [[n] for n in layers] if per_layer else [None]:
                one = spec if names is None else lf.AdapterSpec(spec.variant, **{**_spec_kwargs(spec), "targets": names})
                adapter = lf.init_adapter(model, one, generator=torch.Generator().manual_seed(11), calibration=calibration)
                ours = _as_peft(adapter, dict(adapter.params), model, tmp / "init-ours", task_type)
                cfg = PeftConfig.from_pretrained(tmp / "init-ours") if names is not None else config
                cfg.inference_mode = False
                base = _in_input_dtype(tiny_model(model_kind, dtype=torch.float32))
                theirs = _saved(_seeded_peft(base, cfg, 11, constructors=constructors, at_reset=at_reset), tmp / "init-peft")
                # (peft also writes each layer's view of a tensor shared by every layer, RandLoRA's
                # projections: the same numbers as its one key)
                shared = {k for k in set(theirs) - set(ours) if torch.equal(theirs[k], theirs.get("base_model." + k.rsplit(".", 1)[-1], torch.empty(0)))}
                if sorted(ours) != sorted(set(theirs) - shared):
                    odd = sorted(set(ours) ^ (set(theirs) - shared))
                    return float("inf"), f"{odd[0]} not in both"
                theirs = {k: v for k, v in theirs.items() if k not in shared}
                for key, tensor in sorted(theirs.items()):
                    tensor = tensor.detach()
                    mine = ours[key].reshape(tensor.shape).to(tensor.dtype)
                    rel = 0.0 if torch.equal(mine, tensor) else _rel(mine, tensor)
                    if rel > worst:
                        worst, where = rel, key
            if worst < best[0]:
                best = (worst, where)
            if worst == 0.0:
                break
    return best


def _spec_kwargs(spec) -> dict:
    import dataclasses

    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("variant", "options")} | dict(spec.options)


# the cells whose init cannot be peft's numbers from a seed, and why (checked elsewhere where it can be)
INIT_APART = {
    ("eva", "*"): "data-driven: peft's randomized SVD of the activations (tests/test_variant_eva.py: exact against its full SVD)",
    # (their inits are compared in tests/peft_options.py, on peft's unconverted checkpoints: exact)
    ("pissa", "*"): "stored converted: its file is the plain LoRA it converts to (the options table: init_lora_weights='pissa')",
    ("olora", "*"): "stored converted: its file is the plain LoRA it converts to (the options table: init_lora_weights='olora')",
    ("lora", "mha"): "peft draws the out_proj's factors twice (its Linear's update_layer, then the attention's): lora_func's "
    "are the layers' resets in order (tests/test_kinds_peft.py)",
}


def _cell(variant: str, kind: str, tmp: Path) -> str:
    from peft import PeftConfig, PeftModel, get_peft_model

    row = ROWS[variant]
    # (the expert model runs its fp32 kernels)
    dtype = torch.float32 if kind == "experts" or variant in FLOAT32_ONLY else torch.float64
    rtol = 2e-5 if dtype == torch.float32 else 1e-9
    model_kind = LAYER_KIND_MODEL[kind]
    quiet = _quiet()
    try:
        if kind in lf.get_variant(variant).kinds:
            model, adapter = _build(row, kind, dtype)
            adapter = _perturbed(adapter)
            problems = lf.io.peft_problems(adapter, model=model)
            if problems:
                return "save_peft refuses: " + problems[0].split(";")[0].removeprefix("save_peft: ")[:90]
            # (peft's causal-LM wrapper is the one that hands a routed method its task_ids)
            lf.save_peft(adapter, tmp / "ours", model=model, task_type="CAUSAL_LM" if variant == "poly" else None)
            ids = _inputs(model_kind)
            peft_model = PeftModel.from_pretrained(_in_input_dtype(tiny_model(model_kind, dtype=dtype)), tmp / "ours").eval()
            want = _call(variant, model, adapter, ids)
            got = _peft_call(variant, peft_model, ids, getattr(peft_model.peft_config["default"], "n_tasks", None))
            # (b) save_peft read by peft, and by load_peft (a variant stored converted reads back as
            # the plain method: compared on outputs)
            again = lf.load_peft(tmp / "ours", model)
            saved = max(_rel(got, want), _rel(_call(variant, model, again, ids), want))
            parts = {"save": saved}
            # (a) peft's own checkpoint: outputs and per-tensor gradients
            try:
                loaded, grads, where, by_fd = _from_peft(variant, kind, dtype, tmp / "ours", tmp, rtol)
                parts |= {"load": loaded, "grad": grads}
                parts_where = {"grad": where, "fd": by_fd}
            except Exception as err:
                parts_where = {"load": f"{type(err).__name__}: {str(err)[:60]}"}
                parts["load"] = float("nan")
            # (c) the init
            apart = INIT_APART.get((variant, kind), INIT_APART.get((variant, "*")))
            try:
                init, where = (None, apart) if apart else _init_off(variant, kind, tmp)
            except Exception as err:
                init, where = float("nan"), f"{type(err).__name__}: {str(err)[:60]}"
            parts["init"] = init
            parts_where["init"] = where
            return json.dumps({"parts": parts, "where": parts_where, "rtol": rtol})
        if lf.variants.peft_format(variant).export_needs_base is not None:
            return "n/a (stored converted)"  # its config is the plain method's: no probe of its own
        # the variant's config on Linear layers, retargeted at this kind's modules
        linear_model, linear = _build(row, "linear", dtype)
        lf.save_peft(_perturbed(linear), tmp / "linear", model=linear_model)
        config = json.loads((tmp / "linear" / "adapter_config.json").read_text())
        targets = DEFAULT_TARGETS[model_kind]
        config["target_modules"] = targets
        config.pop("rank_pattern", None), config.pop("alpha_pattern", None)
        if "feedforward_modules" in config:
            config["feedforward_modules"] = [] if not targets else targets[:1]
        if MODEL_SPEC.get(model_kind, {}).get("target_parameters"):
            config["target_parameters"] = MODEL_SPEC[model_kind]["target_parameters"]
        (tmp / "linear" / "adapter_config.json").write_text(json.dumps(config))
        try:
            get_peft_model(tiny_model(model_kind, dtype=dtype), PeftConfig.from_pretrained(tmp / "linear"))
        except Exception:  # peft's own refusal, whatever its type
            return "peft has none"
        return "refused: variant-kind-unsupported"
    finally:
        quiet.__exit__(None, None, None)


def table() -> dict[tuple[str, str], str]:
    variants = [v for v in sorted(ROWS) if lf.variants.peft_format(v) is not None and lf.variants.peft_format(v).reads is not None]
    out = {}
    for variant in variants:
        for kind in KINDS:
            with tempfile.TemporaryDirectory() as tmp:
                out[variant, kind] = cell(variant, kind, Path(tmp))
    return out


# a cell's label in docs/io.md (cells not measured: lora_func does not adapt the kind, or peft refuses)
LABELS = {
    "save_peft refuses": "peft ✗",  # peft refuses the method on that layer (save_peft says so)
    "peft has none": "·",
    "refused": "refused",  # peft builds it, lora_func refuses (variant-kind-unsupported)
    "n/a": "n/a",  # stored converted: its config is the plain method's
    "error": "error",
}


def _measured(parts: dict, where: dict, rtol: float) -> str:
    """A measured cell's label: ``exact`` when outputs (peft on ``save_peft``'s file, ``load_peft``
    on peft's, and the reload), every gradient and the init hold; otherwise the parts that do not,
    each with its worst relative difference (``✗`` above 1: not a round-off); ``(FD)`` where a
    gradient holds against finite differences of peft's forward and not against its autograd."""
    failing = []
    out = max(parts["save"], parts.get("load", float("nan")))
    if out != out:
        failing.append("load ✗")
    elif out > rtol:
        failing.append(f"≈ {out:.0e}" if out < 1 else "✗")
    grads = parts.get("grad")
    if grads is not None and grads > rtol:
        failing.append(f"grad ≈ {grads:.0e}" if grads < 1 else "grad ✗")
    init = parts["init"]
    if init is None:
        failing.append("init n/a")
    elif init != 0.0:
        failing.append(f"init ≈ {init:.0e}" if init < 1 else "init ✗")
    text = ", ".join(failing) if failing else "exact"
    if failing and failing[0] == "init n/a":
        text = "exact, init n/a"
    return text + (" (FD)" if where.get("fd") else "")


def label(cell_text: str) -> str:
    if cell_text.startswith("{"):
        measured = json.loads(cell_text)
        return _measured(measured["parts"], measured["where"], measured["rtol"])
    head = cell_text.split(" (")[0].split(":")[0]
    if head == "error" and "CUDA" in cell_text:
        return "error (peft needs CUDA)"
    return LABELS[head]


def _category(label_text: str) -> str:
    if label_text.startswith("exact"):
        return "init n/a" if "init n/a" in label_text else "exact"
    if label_text.startswith("error"):
        return "cuda" if "CUDA" in label_text else "error"
    if label_text in ("refused", "peft ✗", "·", "n/a"):
        return label_text
    numbers = [float(word.rstrip(",")) for word in label_text.split() if word[:1].isdigit()]
    return "differs" if "✗" in label_text or "init" in label_text or max(numbers) > 1e-6 else "≈"


def count_line(labels: list[str]) -> str:
    """The sentence above the table: the cells counted by category (a difference above float32
    round-off, 1e-6, is counted apart, and so is an error that is not peft's CUDA requirement)."""
    counts = Counter(_category(c) for c in labels)
    names = {"exact": "exact (outputs, gradients, reload and init)", "init n/a": "exact but for an init peft draws otherwise (init n/a)",
             "≈": "within 1e-6 (≈, float32 round-off in peft)", "differs": "differing where the docs say why",
             "refused": "refused by lora_func", "cuda": "not run on the CPU (peft needs CUDA)",
             "error": "where peft fails on our file or model (error)", "peft ✗": "refused by peft itself (peft ✗)",
             "·": "not in peft (·)", "n/a": "n/a"}
    return f"{len(labels)} cells: " + ", ".join(f"{counts[k]} {names[k]}" for k in names if counts[k]) + "."


def markdown(cells: dict[tuple[str, str], str]) -> str:
    lines = [count_line([label(c) for c in cells.values()]), ""]
    variants = sorted({v for v, _ in cells})
    lines.append("| variant | " + " | ".join(KINDS) + " |")
    lines.append("|---|" + "---|" * len(KINDS))
    for v in variants:
        lines.append(f"| `{v}` | " + " | ".join(label(cells[v, k]) for k in KINDS) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(table()))
