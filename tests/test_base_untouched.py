"""The base model is never changed, by any public function, even one that raises midway.

Table-driven: one row per name in ``lora_func.__all__`` (a coverage test fails when a name has
no row). A row is a list of calls, each marked with the exception it must raise (or ``None``);
after every call, every tensor of every model the row touched must be the same object with the
same bytes, the same ``requires_grad`` and no ``.grad``, every module in the same train/eval
mode, with no hook added. The calls include full training steps (``backward`` through both
overlays, an optimiser step on the adapter), the ``adapted`` context left by an exception, and
failures partway through ``init_adapter``, ``load`` and ``save``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

import lora_func as lf
from lora_func.variants import LayerInfo
from lora_func.targeting import canonical_weight
from tests.contract_helpers import calibration_batches, perturbed
from tests.models import tiny_model, tokens
from tests.variant_table import ROWS as VARIANT_ROWS


def model_state(model: nn.Module) -> dict[str, Any]:
    """Everything about ``model`` a library function must not change."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {
        "tensors": {
            name: (id(t), t.dtype, tuple(t.shape), t.requires_grad, t.detach().reshape(-1).view(torch.uint8).clone())
            for name, t in tensors
        },
        "grads": {name: t.grad is not None for name, t in tensors},
        "training": {name: m.training for name, m in model.named_modules()},
        "hooks": {
            name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for name, m in model.named_modules()
        },
        "modules": {name: id(m) for name, m in model.named_modules()},
    }


def assert_same(model: nn.Module, before: dict[str, Any], what: str) -> None:
    now = model_state(model)
    assert now["modules"] == before["modules"], f"{what}: modules replaced"
    assert now["training"] == before["training"], f"{what}: train/eval mode changed"
    assert now["hooks"] == before["hooks"], f"{what}: hooks added"
    assert sorted(now["tensors"]) == sorted(before["tensors"]), f"{what}: tensor names changed"
    for name, (ident, dtype, shape, requires_grad, data) in before["tensors"].items():
        n_ident, n_dtype, n_shape, n_requires_grad, n_data = now["tensors"][name]
        assert n_ident == ident, f"{what}: {name} was replaced by another tensor"
        assert (n_dtype, n_shape, n_requires_grad) == (dtype, shape, requires_grad), f"{what}: {name} metadata changed"
        assert torch.equal(n_data, data), f"{what}: the bytes of {name} changed"
    assert not any(now["grads"].values()), f"{what}: {[n for n, g in now['grads'].items() if g]} received a .grad"


@dataclasses.dataclass
class World:
    """Models (each snapshotted when built), adapters built from them, a scratch directory."""

    tmp: Path
    models: dict[str, nn.Module] = dataclasses.field(default_factory=dict)
    before: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def model(self, kind: str, seed: int = 0) -> nn.Module:
        key = kind if seed == 0 else f"{kind}-seed{seed}"
        if key not in self.models:
            self.models[key] = tiny_model(kind, seed=seed)
            self.before[key] = model_state(self.models[key])
        return self.models[key]

    def adapter(self, variant: str = "lora", kind: str = "llama", seed: int = 0, **kwargs: Any) -> lf.Adapter:
        """A perturbed adapter for ``self.model(kind)`` (cached across tests: built once, from an
        identical untracked copy of the model; the ``init_adapter`` row inits on tracked models)."""
        self.model(kind)
        key = (variant, kind, seed, repr(sorted(kwargs.items())))
        if key not in _ADAPTERS:
            row = VARIANT_ROWS[variant]
            targets = kwargs.pop("targets", None) or (row.targets or {}).get(kind) or (["q_proj", "v_proj"] if kind != "gpt2" else ["c_attn"])
            spec = lf.AdapterSpec(variant, targets=targets, **(row.spec_kwargs | FAST.get(variant, {}) | kwargs))
            adapter = lf.init_adapter(
                _untracked(kind), spec, generator=torch.Generator().manual_seed(seed), calibration=calibration_batches() if row.calibration else None
            )
            _ADAPTERS[key] = perturbed(adapter, row.perturb_scale, seed=seed + 1)
        return _ADAPTERS[key]


# This file checks side effects, not math: EVA may stop its PCA early (fewer SVDs).
FAST = {"eva": {"tau": 0.0}}
_ADAPTERS: dict[tuple, lf.Adapter] = {}
_UNTRACKED: dict[str, nn.Module] = {}


def _untracked(kind: str) -> nn.Module:
    if kind not in _UNTRACKED:
        _UNTRACKED[kind] = tiny_model(kind)
    return _UNTRACKED[kind]


@dataclasses.dataclass(frozen=True)
class Call:
    what: str
    run: Callable[[World], Any]
    raises: type[BaseException] | None = None


IDS = tokens()


def loss_of(model: nn.Module, params: dict[str, Tensor]) -> Tensor:
    ids = IDS
    logits = functional_call(model, params, (ids,)).logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train_steps(w: World, make: Callable[..., dict[str, Tensor]], variant: str = "lora") -> None:
    """Two optimiser steps on the adapter with ``loss.backward()`` (the torch.optim idiom)."""
    model = w.model("llama")
    adapter = w.adapter(variant).detach()
    optimizer = torch.optim.SGD(adapter.params.values(), lr=0.1)
    base = lf.base_params(model)
    for _ in range(2):
        optimizer.zero_grad()
        loss_of(model, make(base, adapter)).backward()
        optimizer.step()
    assert all(p.grad is not None for p in adapter.params.values()), "the row must really train the adapter"


def every_variant_through(w: World, make: Callable[..., dict[str, Tensor]], kind: str) -> None:
    """Forward and ``torch.func.grad`` of every variant."""
    model = w.model(kind)
    base = lf.base_params(model)
    for variant in lf.list_variants():
        adapter = w.adapter(variant, kind)
        if make is MERGED and not lf.get_variant(variant).merges:  # no merged weight (lily, arrow): refused, nothing touched
            with pytest.raises(ValueError, match="has no merged weight"):
                make(base, adapter)
            continue
        torch.func.grad(lambda p: loss_of(model, make(base, adapter.with_params(p))))(adapter.params)  # noqa: B023


# Options that fit a 32-wide layer where peft's defaults do not.
SMALL_LAYER_OPTIONS = {"road": {"group_size": 2}, "oft": {"oft_block_size": 8}, "vblora": {"num_vectors": 12, "vector_length": 8},
                       "arrow": {"num_experts": 2, "top_k": 1}, "xlora": {"hidden_size": 32}}


def variant_functions_on_the_models_own_tensors(w: World) -> None:
    """Each variant's init, weight form and activation form, fed views of the model's own weights
    (no copies): a variant that wrote into its inputs would change the model."""
    model = w.model("llama")
    layer = model.model.layers[0].self_attn.q_proj
    weight, bias = canonical_weight(layer.weight.detach(), "linear"), layer.bias.detach()
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    for name in lf.list_variants():
        variant = lf.get_variant(name)
        calibration = None
        if variant.calibration is not None:
            if name != "corda":
                continue  # eva needs calibrate's output; its forms are LoRA's (covered by "lora")
            calibration = x.T @ x  # corda's payload: the layer inputs' covariance (d_in, d_in)
        spec = lf.AdapterSpec(name, targets=["q_proj"], r=2, **SMALL_LAYER_OPTIONS.get(name, {}))
        info = LayerInfo(d_in=32, d_out=32, r=2, alpha=spec.alpha, has_bias=True, options=spec.options)
        params, buffers = variant.init(weight, bias, info, dtype=torch.float32, generator=torch.Generator().manual_seed(0), calibration=calibration)
        if variant.shared_init is not None:  # VeRA & co: the basis every layer reads, as init_adapter passes it
            # (FRoD's from the weights: the model's own, as init_adapter passes them)
            weights = {"weights": {"q_proj": weight}} if variant.shared_from_weights else {}
            shared = variant.shared_init({"q_proj": info}, dtype=torch.float32, device=weight.device, generator=torch.Generator().manual_seed(1), **weights)
            params, buffers = shared[0] | params, shared[1] | buffers
        if variant.merges:
            variant.weight_form(params, buffers, weight, bias, info)
        else:  # no merged weight (lily, arrow): its weight form refuses, before reading anything
            with pytest.raises(ValueError, match="has no merged weight"):
                variant.weight_form(params, buffers, weight, bias, info)

        class Base:
            def __init__(self) -> None:
                self.weight, self.bias = weight, bias

            def __call__(self, x_: Tensor) -> Tensor:
                return nn.functional.linear(x_, weight, bias)

        variant.activation_form(params, buffers, x, Base(), info)


def raise_inside_adapted(w: World, merged: bool) -> None:
    model = w.model("llama")
    adapter = w.adapter("dora")
    reference = model(tokens()).logits
    with lf.adapted(model, adapter, merged=merged):
        inside = model(tokens()).logits
        assert not torch.allclose(inside, reference), "inside the block the model must be adapted"
        raise KeyboardInterrupt("user pressed ctrl-c while generating")


def init_failing_on_a_later_layer(w: World) -> None:
    # r=3 passes the spec checks; hra's init refuses odd ranks, after the first layer has been set up
    lf.init_adapter(w.model("llama"), lf.AdapterSpec("hra", targets=["q_proj", "v_proj"], r=3))


def save_onto_a_directory(w: World) -> None:
    (w.tmp / "taken.safetensors").mkdir()
    try:
        lf.save(w.adapter("pissa"), w.tmp / "taken.safetensors")
    finally:
        leftovers = sorted(p.name for p in w.tmp.iterdir() if p.name != "new")
        assert leftovers == ["taken.safetensors"], f"save left {leftovers}"


def load_on_another_base(w: World) -> None:
    path = lf.save(w.adapter("pissa"), w.tmp / "p.safetensors")
    other = w.model("llama", seed=1)  # same shapes, other weights: PiSSA's residual does not fit
    lf.load(path, model=other)


def stacked_everything(w: World) -> None:
    model = w.model("llama")
    members = [w.adapter("lora", seed=s) for s in (1, 2)] + [w.adapter("lora", seed=3, r=2)]
    stacked = lf.stack(members)
    base = lf.base_params(model)
    torch.func.vmap(lambda a: loss_of(model, lf.overlay(base, a)))(stacked)
    picked = lf.take(stacked, torch.tensor([2, 0]))
    torch.func.vmap(lambda a: loss_of(model, lf.merge_overlay(base, a)))(picked)
    assert len(lf.unstack(stacked)) == 3


class FakeDist:
    """A world of one standing in for torch.distributed inside lora_func.distributed: its
    collectives are the identity. (A real in-process gloo group leaves threads behind that
    slow every later test in the process ~2.7x on a 2-core machine.)"""

    def __enter__(self) -> None:
        from lora_func import distributed

        def gather(out: list, obj: Any, group: Any = None) -> None:
            out[0] = obj

        self._real = distributed.dist
        distributed.dist = types.SimpleNamespace(
            is_available=lambda: True,
            is_initialized=lambda: True,
            get_world_size=lambda group=None: 1,
            all_reduce=lambda tensor, op=None, group=None: None,
            broadcast=lambda tensor, src=0, group=None: None,
            all_gather_object=gather,
            ReduceOp=types.SimpleNamespace(SUM="sum"),
        )

    def __exit__(self, *exc: object) -> None:
        from lora_func import distributed

        distributed.dist = self._real


def distributed_training_step(w: World) -> None:
    model = w.model("llama")
    base = lf.base_params(model)
    with FakeDist():
        adapter = lf.distributed.broadcast_adapter(w.adapter("dora"))
        loss_of(model, lf.overlay(base, adapter)).backward()
        lf.distributed.all_reduce_mean_grads_(adapter.params)
        lf.distributed.all_reduce_mean(torch.func.grad(lambda p: loss_of(model, lf.merge_overlay(base, adapter.with_params(p))))(adapter.params))


def composed(w: World) -> lf.Composed:
    return lf.compose(w.adapter("pissa"), w.adapter("dora", seed=5), w.adapter("ia3", seed=7))


def _merge_then_train(w: World, method: str) -> None:
    """A merge on the model's base, then a forward and backward through both overlays."""
    model = w.model("llama")
    base = lf.base_params(model)
    weights = torch.tensor([0.7, -0.4], requires_grad=True)
    merged = lf.merge_adapters([w.adapter("lora"), w.adapter("hra", seed=5)], weights, method=method, density=0.5, base=base,
                               generator=torch.Generator().manual_seed(0))
    loss_of(model, MERGED(base, merged)).backward()
    assert weights.grad is not None
    loss_of(model, LAZY(base, merged.detach())).backward()


def combined(w: World) -> lf.Combined:
    return lf.combine([w.adapter("lora"), w.adapter("hra", seed=5)], torch.tensor([0.7, -0.4], requires_grad=True))


def forward_that_raises_midway(w: World, make: Callable[..., dict[str, Tensor]]) -> None:
    model = w.model("llama")
    bad_ids = torch.full((1, 4), 10_000)  # past the vocabulary: the embedding lookup raises mid-forward
    functional_call(model, make(lf.base_params(model), w.adapter("dora")), (bad_ids,))



def _adapter_methods(a: lf.Adapter) -> None:
    a.with_params(a.params), a.with_buffers(a.buffers), a.detach(), repr(a), a.num_parameters(), a.stack_shape


def _forward_and_grad(w: World, adapter: Any) -> None:
    """Both overlays of a composed/combined adapter: a forward each and a gradient each."""
    model = w.model("llama")
    base = lf.base_params(model)
    for make in (MERGED, LAZY):
        loss_of(model, make(base, adapter))
        torch.func.grad(lambda p, make=make: loss_of(model, make(base, adapter.with_params(p))))(adapter.params)


def _grad_of_mixing_weights(w: World) -> None:
    model, mixed = w.model("llama"), combined(w)
    base = lf.base_params(model)
    torch.func.grad(lambda ws: loss_of(model, LAZY(base, lf.combine(list(mixed.parts), ws))))(mixed.weights.detach())


def _tied_lm_head(w: World, make: Callable[..., dict[str, Tensor]]) -> None:
    model = w.model("gpt2")
    loss_of(model, make(lf.base_params(model), w.adapter("lora", "gpt2", targets=["lm_head"], tied="both")))


def _steered_forward(w: World) -> None:
    model, adapter = w.model("llama"), w.adapter("antipasto")
    steered = adapter.with_buffers(api("with_steering")(adapter.buffers, -0.5))
    loss_of(model, lf.overlay(lf.base_params(model), steered))

def _through_overlay_mode(w: World, kind: str, *, lazy_only: bool = False, **adapter_kwargs: Any) -> None:
    """Forward and backward of every variant (or one tied-weight adapter) with the lazy path as a mode."""
    model = w.model(kind)
    base = lf.base_params(model)
    variants = ["lora"] if adapter_kwargs else lf.list_variants()
    for variant in variants:
        adapter = w.adapter(variant, kind, **adapter_kwargs)
        with lf.overlay_mode(base, adapter, lazy_only=lazy_only):
            loss = loss_of(model, base)
        loss.backward()


MERGED, LAZY = lf.merge_overlay, lf.overlay

ROWS: dict[str, list[Call]] = {
    "Adapter": [
        Call("methods", lambda w: _adapter_methods(w.adapter("antipasto"))),
        Call("setattr refused", lambda w: setattr(w.adapter(), "params", {}), AttributeError),
    ],
    "AdapterLayer": [Call("layer tensors", lambda w: [w.adapter("delora").layer_tensors(layer) for layer in w.adapter("delora").layers])],
    "AdapterSpec": [
        Call("json round trip", lambda w: lf.AdapterSpec.from_json(lf.AdapterSpec("lora", ["q_proj"]).to_json())),
        Call("bad option", lambda w: lf.AdapterSpec("lora", ["q_proj"], use_rs_lora=True), TypeError),
    ],
    "Combined": [
        Call("merged + lazy forward and grad", lambda w: _forward_and_grad(w, combined(w))),
        Call("with_params bad keys", lambda w: combined(w).with_params({}), KeyError),
    ],
    "Composed": [
        Call("merged + lazy forward and grad", lambda w: _forward_and_grad(w, composed(w))),
        Call("pissa after another part", lambda w: lf.compose(w.adapter("lora"), w.adapter("pissa")), ValueError),
    ],
    "adapted": [
        Call("merged block left by an exception", lambda w: raise_inside_adapted(w, merged=True), KeyboardInterrupt),
        Call("lazy block left by an exception", lambda w: raise_inside_adapted(w, merged=False), KeyboardInterrupt),
        Call("generate", lambda w: _generate(w.model("gpt2"), w.adapter("ia3", "gpt2"))),
    ],
    "make_plan": [
        Call("held across with_params, both routes", lambda w: [
            lf.adapted_call(w.model("llama"), w.adapter().with_params(w.adapter().params), tokens(), plan=lf.make_plan(w.model("llama"), w.adapter(), route=r))
            for r in ("overlay", "module")
        ]),
        Call("another model's names in base=", lambda w: lf.make_plan(w.model("llama"), w.adapter(), base={"x": torch.zeros(1)}), KeyError),
    ],
    "Plan": [Call("overlay and merge_overlay", lambda w: [
        make(lf.base_params(w.model("llama")), w.adapter(), plan=lf.make_plan(w.model("llama"), w.adapter())) for make in (lf.overlay, lf.merge_overlay)
    ])],
    "adapted_call": [
        Call("both paths, every variant", lambda w: [lf.adapted_call(w.model(k), w.adapter(v, k), tokens(), merged=m) for v in ("lora", "pissa", "hra") for k in ("llama", "gpt2") for m in (True, False)]),
        Call("typo in base=", lambda w: lf.adapted_call(w.model("llama"), w.adapter(), tokens(), base={"x": torch.zeros(1)}), KeyError),
    ],
    "all_reduce_mean": [
        Call("world of one", distributed_training_step),
        Call("not initialised", lambda w: lf.distributed.all_reduce_mean(w.adapter().params), RuntimeError),
    ],
    "all_reduce_mean_grads_": [Call("not initialised", lambda w: lf.distributed.all_reduce_mean_grads_(w.adapter().params), RuntimeError)],
    "base_params": [Call("both models", lambda w: (lf.base_params(w.model("llama")), lf.base_params(w.model("gpt2"))))],
    "broadcast_adapter": [Call("not initialised", lambda w: lf.distributed.broadcast_adapter(w.adapter()), RuntimeError)],
    "check_base_params": [
        Call("valid", lambda w: lf.check_base_params(w.model("gpt2"), lf.base_params(w.model("gpt2")))),
        Call("missing keys", lambda w: lf.check_base_params(w.model("gpt2"), {}), KeyError),
    ],
    "combine": [
        Call("grad through the mixing weights", _grad_of_mixing_weights),
        Call("wrong number of weights", lambda w: lf.combine([w.adapter()], torch.ones(2)), ValueError),
    ],
    "compose": [Call("then merged", lambda w: MERGED(lf.base_params(w.model("llama")), composed(w)))],
    "merge_adapters": [
        Call("ties of LoRA and HRA, then trained", lambda w: _merge_then_train(w, "ties")),
        Call("dare_ties", lambda w: _merge_then_train(w, "dare_ties")),
        Call("cat", lambda w: lf.merge_adapters([w.adapter("lora"), w.adapter("lora", seed=3)], [0.5, 0.5], method="cat")),
        Call("unknown method", lambda w: lf.merge_adapters([w.adapter()], [1.0], method="mean"), ValueError),
        Call("HRA without a base", lambda w: lf.merge_adapters([w.adapter("hra", seed=5)], [1.0], method="linear"), ValueError),
    ],
    "to_lora": [
        Call("a combination", lambda w: lf.to_lora(combined(w), rank=2, base=lf.base_params(w.model("llama")))),
        Call("rank and energy", lambda w: lf.to_lora(w.adapter(), rank=2, energy=0.5), ValueError),
    ],
    "LoraConversion": [Call("unpacked", lambda w: tuple(lf.to_lora(w.adapter("dora"), energy=0.9, base=lf.base_params(w.model("llama")))))],
    "get_variant": [Call("variant functions on the model's own tensors", variant_functions_on_the_models_own_tensors)],
    "init_adapter": [
        Call("every variant", lambda w: [_init(w, v, k) for v, k in zip(lf.list_variants(), ("llama", "gpt2") * 9, strict=False)]),
        Call("tied weights, both names", lambda w: w.adapter("lora", "gpt2", targets=["lm_head"], tied="both")),
        Call("fails on a layer's init", init_failing_on_a_later_layer, ValueError),
    ],
    "list_variants": [Call("names", lambda w: lf.list_variants())],
    "load": [
        Call("round trip onto the model", lambda w: lf.load(lf.save(w.adapter("antipasto"), w.tmp / "a.safetensors"), model=w.model("llama"))),
        Call("PiSSA onto other base weights", load_on_another_base, ValueError),
    ],
    "merge_overlay": [
        Call("every variant: forward + grad (Conv1D)", lambda w: every_variant_through(w, MERGED, "gpt2")),
        Call("training steps", lambda w: train_steps(w, MERGED, "dora")),
        Call("forward raising midway", lambda w: forward_that_raises_midway(w, MERGED), IndexError),
        Call("tied lm_head (merged)", lambda w: _tied_lm_head(w, MERGED)),
    ],
    "overlay": [
        Call("every variant: forward + grad (Linear)", lambda w: every_variant_through(w, LAZY, "llama")),
        Call("training steps", lambda w: train_steps(w, LAZY, "hra")),
        Call("forward raising midway", lambda w: forward_that_raises_midway(w, LAZY), IndexError),
        Call("lazy_only on a tied weight", lambda w: _tied_lm_head(w, functools.partial(LAZY, lazy_only=True)), RuntimeError),
    ],
    "overlay_mode": [
        Call("every variant: forward + backward (Conv1D)", lambda w: _through_overlay_mode(w, "gpt2")),
        Call("lazy_only on a tied weight", lambda w: _through_overlay_mode(w, "gpt2", lazy_only=True, targets=["lm_head"], tied="both"), RuntimeError),
    ],
    "save": [
        Call("into a new directory", lambda w: lf.save(w.adapter("eva"), w.tmp / "new" / "e.safetensors")),
        Call("onto a directory", save_onto_a_directory, OSError),
    ],
    "stack": [Call("ranks 2 and 4, vmap both paths", stacked_everything)],
    "take": [Call("not stacked", lambda w: lf.take(w.adapter(), 0), ValueError)],
    "unstack": [Call("not stacked", lambda w: lf.unstack(w.adapter()), ValueError)],
}


# Public functions that live in a namespace of lora_func (train, distributed, io, ...), not in
# lora_func.__all__: where each lives. A row for a name that is neither in lora_func.__all__ nor here fails.
PENDING: dict[str, str] = {
    "save_peft": "lora_func.io",
    "load_peft": "lora_func.io",
    "all_reduce_mean": "lora_func.distributed",
    "all_reduce_mean_grads_": "lora_func.distributed",
    "broadcast_adapter": "lora_func.distributed",
    "mixed_call": "lora_func.many",
    "ensemble_call": "lora_func.many",
    "per_example_grads": "lora_func.many",
    "check_finite": "lora_func.checks",
    "with_steering": "lora_func.variants.antipasto",
    "for_task": "lora_func.variants.poly",
    "task_call": "lora_func.routed",
    "task_adapted": "lora_func.routed",
    "task_members": "lora_func.routed",
    "arrow": "lora_func.routed",
    "arrow_experts": "lora_func.routed",
    "xlora": "lora_func.routed",
    "xlora_call": "lora_func.routed",
    "xlora_scalings": "lora_func.routed",
    "xlora_adapted": "lora_func.routed",
    "xlora_experts": "lora_func.routed",
    "xlora_classifier_keys": "lora_func.routed",
    "load_xlora": "lora_func.routed",
    "save_xlora": "lora_func.routed",
    "TrainState": "lora_func.train",
    "train_step": "lora_func.train",
    "fit": "lora_func.train",
    "make_optimizer": "lora_func.train",
    "adapter_loss": "lora_func.train",
    "causal_lm_loss": "lora_func.train",
    "save_checkpoint": "lora_func.train",
    "load_checkpoint": "lora_func.train",
}


def api(name: str) -> Any:
    """``lora_func.<name>``, or where it lives until the lead exports it."""
    if name in lf.__all__:
        return getattr(lf, name)
    return getattr(importlib.import_module(PENDING[name]), name)


def _init(w: World, variant: str, kind: str) -> lf.Adapter:
    row = VARIANT_ROWS[variant]
    targets = (row.targets or {}).get(kind) or (["q_proj", "v_proj"] if kind != "gpt2" else ["c_attn"])
    spec = lf.AdapterSpec(variant, targets=targets, **(row.spec_kwargs | FAST.get(variant, {})))
    return lf.init_adapter(w.model(kind), spec, calibration=calibration_batches(n=2) if row.calibration else None)


def _generate(model: nn.Module, adapter: lf.Adapter) -> None:
    with torch.no_grad(), lf.adapted(model, adapter):
        model.generate(tokens(1, 4), max_new_tokens=3, do_sample=False, pad_token_id=0)



def _peft_round_trip(w: World) -> None:
    model = w.model("llama")
    directory = api("save_peft")(w.adapter("dora"), w.tmp / "peft", model=model)
    loaded = api("load_peft")(directory, model)
    loss_of(model, lf.overlay(lf.base_params(model), loaded))


def _train_state(w: World, variant: str = "lora") -> Any:
    adapter = w.adapter(variant).detach()
    return api("TrainState")(adapter, api("make_optimizer")(adapter, lr=1e-2))


def _batch() -> dict[str, Tensor]:
    return {"input_ids": IDS, "labels": IDS}


def _nan_step(w: World) -> None:
    state = _train_state(w)
    key = next(iter(state.adapter.params))
    with torch.no_grad():
        state.adapter.params[key][0, 0] = float("nan")
    api("train_step")(w.model("llama"), state, _batch())


def _fit_and_checkpoint(w: World) -> None:
    model = w.model("llama")
    state = _train_state(w, "hra")
    api("fit")(model, state, lambda step: _batch(), 2, progress=False)
    directory = api("save_checkpoint")(w.tmp / "ckpt", state)
    api("load_checkpoint")(directory, model)


def _safe_merge_with_nan(w: World) -> None:
    model = w.model("llama")
    adapter = w.adapter("lora")
    bad = adapter.with_params({k: v.detach() * float("nan") for k, v in adapter.params.items()})
    merged = lf.merge_overlay(lf.base_params(model), bad)
    api("check_finite")({k: merged[k] for k in merged if "q_proj.weight" in k}, "merged weights")


ROWS.update(
    {
        "save_peft": [
            Call("round trip (dora)", _peft_round_trip),
            Call("pissa without model=", lambda w: api("save_peft")(w.adapter("pissa"), w.tmp / "p"), ValueError),
        ],
        "load_peft": [Call("onto another model", lambda w: api("load_peft")(api("save_peft")(w.adapter(), w.tmp / "q", model=w.model("llama")), w.model("gpt2")), ValueError)],
        "merged_state_dict": [
            Call("full state dict, both models", lambda w: (api("merged_state_dict")(w.model("llama"), w.adapter("ia3")), api("merged_state_dict")(w.model("gpt2"), w.adapter("lora", "gpt2", targets=["lm_head"], tied="both")))),
            Call("stacked adapter", lambda w: api("merged_state_dict")(w.model("llama"), lf.stack([w.adapter(), w.adapter(seed=1)])), ValueError),
        ],
        "mixed_call": [
            Call("two adapters, one per example", lambda w: api("mixed_call")(w.model("llama"), lf.stack([w.adapter(), w.adapter(seed=2)]), torch.tensor([1, 0]), IDS, use_cache=False)),
            Call("index out of range", lambda w: api("mixed_call")(w.model("llama"), lf.stack([w.adapter(), w.adapter(seed=2)]), torch.tensor([3, 0]), IDS), IndexError),
        ],
        "ensemble_call": [
            Call("merged and lazy", lambda w: [api("ensemble_call")(w.model("gpt2"), lf.stack([w.adapter("dora", "gpt2"), w.adapter("dora", "gpt2", seed=4)]), IDS, merged=m, use_cache=False) for m in (True, False)]),
            Call("not stacked", lambda w: api("ensemble_call")(w.model("llama"), w.adapter(), IDS), ValueError),
        ],
        "per_example_grads": [
            Call("per-example gradients", lambda w: api("per_example_grads")(lambda a, ids: loss_of_ids(w.model("llama"), a, ids), w.adapter("delora"), IDS)),
        ],
        "check_finite": [Call("on a merged NaN weight", _safe_merge_with_nan, FloatingPointError)],
        # Private training (issue 33): the DP-SGD gradient on both layer kinds; the accountant and
        # the sampler read no model (a row each, so a model-reading regression would show).
        "private_grads": [
            Call("lora on Llama, noised", lambda w: lf.private_grads(lambda a, ids: loss_of_ids(w.model("llama"), a, ids), w.adapter(), IDS,
                                                                     max_grad_norm=0.5, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))),
            Call("dora on GPT-2 Conv1D", lambda w: lf.private_grads(lambda a, ids: loss_of_ids(w.model("gpt2"), a, ids), w.adapter("dora", "gpt2"), IDS,
                                                                    max_grad_norm=0.5, noise_multiplier=0.0)),
            Call("bad max_grad_norm", lambda w: lf.private_grads(lambda a, ids: loss_of_ids(w.model("llama"), a, ids), w.adapter(), IDS,
                                                                 max_grad_norm=0.0, noise_multiplier=1.0), ValueError),
        ],
        "epsilon": [Call("RDP accountant", lambda w: lf.epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=100, delta=1e-5))],
        "noise_for_epsilon": [Call("inverse", lambda w: lf.noise_for_epsilon(epsilon=8.0, sample_rate=0.01, steps=100, delta=1e-5))],
        "PoissonBatchSampler": [Call("batches", lambda w: list(lf.PoissonBatchSampler(10, 0.3, 3, generator=torch.Generator().manual_seed(0))))],
        "with_steering": [Call("steered forward", _steered_forward)],
        "TrainState": [Call("built", lambda w: _train_state(w))],
        "make_optimizer": [Call("built", lambda w: api("make_optimizer")(w.adapter().detach(), lr=0.1))],
        "adapter_loss": [Call("loss and backward", lambda w: api("adapter_loss")(w.model("llama"), w.adapter().detach(), _batch()).backward())],
        "causal_lm_loss": [Call("on the model's logits", lambda w: api("causal_lm_loss")(w.model("llama")(IDS).logits.detach(), IDS))],
        "train_step": [
            Call("steps", lambda w: [api("train_step")(w.model("llama"), s, _batch()) for s in [_train_state(w, "pissa")] for _ in range(2)]),
            Call("a NaN adapter tensor stops the step", _nan_step, FloatingPointError),
        ],
        "fit": [Call("fit, save and load a checkpoint", _fit_and_checkpoint)],
        "save_checkpoint": [Call("via fit", _fit_and_checkpoint)],
        "load_checkpoint": [Call("not a checkpoint", lambda w: api("load_checkpoint")(w.tmp, w.model("llama")), FileNotFoundError)],
    }
)


def loss_of_ids(model: nn.Module, adapter: lf.Adapter, ids: Tensor) -> Tensor:
    logits = lf.adapted_call(model, adapter, ids).logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

# Ecosystem (issue 21): the module bridge and the summary.
def _bridge_round(w: World, kind: str) -> None:
    """Trainer's uses of the bridge: train(), forward, backward, save_pretrained, from_pretrained."""
    model = w.model(kind)
    adapter = w.adapter("lora", kind, targets=["c_attn"]) if kind == "gpt2" else w.adapter().detach()
    bridge = lf.as_module(model, adapter.with_params({k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}))
    bridge.train()
    bridge(IDS).logits.sum().backward()
    bridge.save_pretrained(w.tmp / kind)
    lf.AdaptedModule.from_pretrained(w.tmp / kind, model=model)(IDS)


ROWS.update(
    {
        "as_module": [Call("Trainer's calls, both models", lambda w: [_bridge_round(w, kind) for kind in ("llama", "gpt2")])],
        "AdaptedModule": [Call("no adapter in the directory", lambda w: lf.AdaptedModule.from_pretrained(w.tmp, model=w.model("llama")), FileNotFoundError)],
        "adapter_summary": [Call("per layer", lambda w: str(lf.adapter_summary(w.model("gpt2"), w.adapter("lora", "gpt2", targets=["c_attn"]), per_layer=True)))],
        "AdapterSummary": [Call("printed", lambda w: str(lf.adapter_summary(w.model("llama"), w.adapter())))],
    }
)


# Mixed adapters inside the target layers (issue 20): training through the route, generation.
def _mixed_train_and_generate(w: World) -> None:
    model = w.model("gpt2")
    adapters = [w.adapter("lora", "gpt2"), w.adapter("lora", "gpt2", seed=2)]
    leaves = [a.with_params({k: v.detach().clone().requires_grad_(True) for k, v in a.params.items()}) for a in adapters]
    model.train()
    try:
        lf.mixed_call(model, leaves, torch.tensor([1, 0]), IDS, batching="layers").logits.sum().backward()
    finally:
        model.eval()
    with torch.no_grad(), lf.mixed_adapted(model, adapters, torch.tensor([0, 1])):
        model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3, num_beams=2, pad_token_id=0)


def _mixed_wrong_batch(w: World) -> None:
    model = w.model("llama")
    with lf.mixed_adapted(model, [w.adapter()], torch.tensor([0, 0, 0])):
        model(IDS)  # IDS has 2 rows


ROWS.update(
    {
        "mixed_call": [
            Call("training step, per-row adapters (dora on llama)", lambda w: lf.mixed_call(w.model("llama"), [w.adapter("dora"), w.adapter("dora", seed=2)], torch.tensor([1, 0]), IDS, batching="layers").logits.sum().backward()),
            Call("index out of range", lambda w: lf.mixed_call(w.model("llama"), [w.adapter(), w.adapter(seed=2)], torch.tensor([2, 0]), IDS, batching="layers"), IndexError),
        ],
        "mixed_adapted": [
            Call("train, then generate with beams", _mixed_train_and_generate),
            Call("a batch that is not a multiple of the index", _mixed_wrong_batch, ValueError),
        ],
    }
)


# Issue 31: optimiser methods and AdaLoRA's rank budget (lora_func.optimizers, lora_func.rank_budget).
def _optimiser_steps(w: World, build: Callable[[lf.Adapter], torch.optim.Optimizer], variant: str = "lora") -> None:
    model, adapter = w.model("llama"), w.adapter(variant).detach()
    optimizer = build(adapter)
    for _ in range(2):
        optimizer.zero_grad()
        loss_of_ids(model, adapter, IDS).backward()
        optimizer.step()


def _budget_round(w: World) -> None:
    model, adapter = w.model("llama"), w.adapter("adalora")
    state = lf.budget_init(adapter)
    for step in range(1, 3):
        loss = loss_of_ids(model, adapter, IDS) + lf.orth_penalty(adapter)
        grads = dict(zip(adapter.params, torch.autograd.grad(loss, list(adapter.params.values())), strict=True))
        state, mask = lf.budget_step(state, adapter, grads, step)
        adapter = lf.apply_mask(adapter, mask)


ROWS.update(
    {
        "loraplus_optimizer": [Call("two AdamW steps (dora)", lambda w: _optimiser_steps(w, lambda a: lf.loraplus_optimizer(a, torch.optim.AdamW, lr=1e-2, loraplus_lr_ratio=4.0), "dora"))],
        "lorafa_optimizer": [
            Call("two steps", lambda w: _optimiser_steps(w, lambda a: lf.lorafa_optimizer(a, lr=1e-2, weight_decay=0.1))),
            Call("an adapter without factor pairs", lambda w: lf.lorafa_optimizer(w.adapter("hra"), lr=1e-2), ValueError),
        ],
        "riemannian_optimizer": [Call("two SGD steps", lambda w: _optimiser_steps(w, lambda a: lf.riemannian_optimizer(a, torch.optim.SGD, lr=1e-2)))],
        "budget_init": [Call("schedule round", _budget_round), Call("no adalora part", lambda w: lf.budget_init(w.adapter()), ValueError)],
        "budget_step": [Call("schedule round", _budget_round)],
        "apply_mask": [Call("schedule round", _budget_round)],
        "orth_penalty": [Call("backward", lambda w: lf.orth_penalty(w.adapter("adalora")).backward())],
    }
)
# Issue 31: KaSA's regulariser.
ROWS.update({"kasa_penalty": [Call("backward", lambda w: lf.kasa_penalty(w.adapter("kasa")).backward())]})

# Input-level adapters (issue 47): every prompt method through every call that takes one.
PROMPT_SPECS = {
    "prompt_tuning": {}, "p_tuning": {"encoder": "lstm", "encoder_hidden_size": 4}, "prefix_tuning": {"prefix_projection": True},
    "multitask_prompt_tuning": {"num_tasks": 2}, "cpt": {"cpt_token_ids": [5, 6], "cpt_tokens_type_mask": [1, 4]}, "cartridge": {},
    "adaption_prompt": {"adapter_layers": 2},
}


def _prompt(w: World, method: str, kind: str, seed: int = 0) -> lf.Prompt:
    n = None if method == "cpt" else 3
    prompt = api("init_prompt")(w.model(kind), api("PromptSpec")(method, n, **PROMPT_SPECS[method]), generator=torch.Generator().manual_seed(seed))
    return prompt.with_params({k: (v.detach() + 0.1).requires_grad_(True) for k, v in prompt.params.items()})


def _prompt_kwargs(method: str, rows: int = 2) -> dict[str, Tensor]:
    return {"task_ids": torch.tensor([1, 0][:rows])} if method == "multitask_prompt_tuning" else {}


def _every_prompt_through_every_call(w: World) -> None:
    for kind in ("llama", "gpt2"):
        model = w.model(kind)
        for method in PROMPT_SPECS:
            prompt, other = _prompt(w, method, kind), _prompt(w, method, kind, seed=1)
            kwargs = _prompt_kwargs(method)
            lf.adapted_call(model, prompt, IDS, labels=IDS, **kwargs).loss.backward()
            lf.mixed_call(model, [prompt, other], torch.tensor([1, 0]), IDS, **kwargs, batching="layers").logits.sum().backward()
            lf.ensemble_call(model, lf.stack([prompt, other]), IDS, **kwargs).logits.sum().backward()
            api("per_example_grads")(lambda p, ids, *t, model=model: lf.adapted_call(model, p, ids, use_cache=False, **({"task_ids": t[0]} if t else {})).logits.sum(),
                                     prompt, IDS, *kwargs.values())
            with torch.no_grad(), lf.adapted(model, prompt):
                model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=2, do_sample=False, pad_token_id=0, **kwargs)
            with torch.no_grad(), lf.mixed_adapted(model, [prompt, other], torch.tensor([0, 1])):
                model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=2, do_sample=False, pad_token_id=0, **kwargs)
            lf.load(lf.save(prompt, w.tmp / f"{kind}-{method}.safetensors"), model=model)
            api("load_peft")(api("save_peft")(prompt, w.tmp / f"{kind}-{method}"), model)
        lora = w.adapter("lora", kind)
        lf.adapted_call(model, lf.compose(_prompt(w, "prompt_tuning", kind), lora), IDS).logits.sum().backward()
    model = w.model("llama")
    model.train()
    try:
        lf.adapted_call(model, _prompt(w, "p_tuning", "llama"), IDS, labels=IDS).loss.backward()
    finally:
        model.eval()


def _prompt_raising_midway(w: World) -> None:
    model = w.model("llama")

    def explode(module: Any, args: Any) -> None:
        raise IndexError("raised inside the model")

    handle = model.model.layers[1].register_forward_pre_hook(explode)
    try:
        lf.adapted_call(model, _prompt(w, "prefix_tuning", "llama"), IDS)
    finally:
        handle.remove()


ROWS.update(
    {
        "init_prompt": [
            Call("every method through every call, both models", _every_prompt_through_every_call),
            Call("a model the method does not fit", lambda w: api("init_prompt")(w.model("llama"), api("PromptSpec")("adaption_prompt", 3, adapter_layers=5)), ValueError),
        ],
        "Prompt": [
            Call("methods", lambda w: [p.detach().with_params(p.params).with_buffers(p.buffers) for p in [_prompt(w, "cpt", "gpt2")]]),
            Call("forward raising midway", _prompt_raising_midway, IndexError),
        ],
        "PromptSpec": [
            Call("json round trip", lambda w: api("PromptSpec").from_json(api("PromptSpec")("cpt", **PROMPT_SPECS["cpt"]).to_json())),
            Call("bad option", lambda w: api("PromptSpec")("prompt_tuning", 3, init="zeros"), ValueError),
        ],
    }
)


# Routed LoRA (issue 47): Poly / MHR task routing, training through the per-row route, generation.
def _routed_train_and_generate(w: World) -> None:
    model = w.model("llama")
    adapter = w.adapter("poly")
    leaf = adapter.with_params({k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()})
    model.train()
    try:
        api("task_call")(model, leaf, IDS, task_ids=torch.tensor([2, 0])).logits.sum().backward()
        lf.adapted_call(model, api("for_task")(leaf, 1), IDS, labels=IDS).loss.backward()
    finally:
        model.eval()
    lf.ensemble_call(model, api("task_members")(leaf), IDS).logits.sum().backward()
    with torch.no_grad(), api("task_adapted")(model, adapter, torch.tensor([1, 2])):
        model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3, num_beams=2, pad_token_id=0)


ROWS.update(
    {
        "task_call": [
            Call("train, route, generate", _routed_train_and_generate),
            Call("task out of range", lambda w: api("task_call")(w.model("llama"), w.adapter("poly"), IDS, task_ids=torch.tensor([0, 3])), ValueError),
        ],
        "task_adapted": [Call("train, route, generate", _routed_train_and_generate)],
        "task_members": [Call("train, route, generate", _routed_train_and_generate)],
        "for_task": [Call("train, route, generate", _routed_train_and_generate), Call("bad task", lambda w: api("for_task")(w.adapter("poly"), -1), ValueError)],
    }
)


def _arrow_round(w: World) -> None:
    model = w.model("llama")
    experts = [w.adapter("lora", seed=s) for s in range(3)]
    router = api("arrow")(experts[:2], top_k=1, general=experts[2:])
    model.train()
    try:
        lf.adapted_call(model, router, IDS, labels=IDS).loss.backward()
    finally:
        model.eval()
    with torch.no_grad(), lf.adapted(model, router, merged=False):
        model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3, pad_token_id=0)
    for e, expert in enumerate(api("arrow_experts")(router)):
        api("save_peft")(expert, w.tmp / f"expert{e}", model=model)


ROWS.update(
    {
        "arrow": [Call("build, train, generate, save the experts", _arrow_round), Call("merged", lambda w: lf.adapted_call(
            w.model("llama"), api("arrow")([w.adapter("lora", seed=s) for s in range(2)], top_k=1), IDS, merged=True), ValueError)],
        "arrow_experts": [Call("build, train, generate, save the experts", _arrow_round)],
    }
)


def _xlora_round(w: World) -> None:
    model = w.model("llama")
    adapter = api("xlora")([w.adapter("lora", seed=s) for s in range(2)], hidden_size=32, xlora_depth=2, xlora_size=4, layerwise_scalings=True)
    model.train()
    try:
        api("xlora_call")(model, adapter, IDS, labels=IDS).loss.backward()
        api("xlora_call")(model, lf.stack([adapter, adapter]), IDS, index=torch.tensor([1, 0])).logits.sum().backward()
    finally:
        model.eval()
    api("xlora_scalings")(model, adapter, IDS).sum().backward()
    assert api("xlora_classifier_keys")(adapter)
    with torch.no_grad(), api("xlora_adapted")(model, adapter):
        model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3, num_beams=2, pad_token_id=0)
    for expert in api("xlora_experts")(adapter):
        lf.adapted_call(model, expert, IDS, merged=True)
    api("load_xlora")(api("save_xlora")(adapter, w.tmp / "xlora", model=model), model)


_XLORA_ROUND = [Call("build, train, route per row, generate, save and load", _xlora_round)]
ROWS.update(
    {
        "xlora": _XLORA_ROUND,
        "xlora_call": [*_XLORA_ROUND, Call("merged", lambda w: api("xlora_call")(
            w.model("llama"), api("xlora")([w.adapter("lora", seed=s) for s in range(2)], hidden_size=32), IDS, merged=True), ValueError)],
        "xlora_scalings": _XLORA_ROUND, "xlora_adapted": _XLORA_ROUND, "xlora_experts": _XLORA_ROUND, "xlora_classifier_keys": _XLORA_ROUND,
        "load_xlora": _XLORA_ROUND, "save_xlora": _XLORA_ROUND,
    }
)


def test_every_public_name_has_a_row():
    missing = sorted(set(lf.__all__) - set(ROWS))
    stale = sorted(set(ROWS) - set(lf.__all__) - set(PENDING))
    assert not missing and not stale, f"add rows to tests/test_base_untouched.py for {missing}; remove rows for {stale}"
    for name in PENDING:
        assert callable(api(name)), name


@pytest.mark.parametrize("name", sorted(ROWS))
def test_base_untouched(name, tmp_path):
    world = World(tmp_path)
    for kind in ("llama", "gpt2"):
        world.model(kind)
    for call in ROWS[name]:
        what = f"{name}: {call.what}"
        if call.raises is None:
            call.run(world)
        else:
            with pytest.raises(call.raises):
                call.run(world)
        for key, model in world.models.items():
            assert_same(model, world.before[key], f"{what} ({key})")


def test_the_check_catches_each_kind_of_change():
    """Guards the guard: every kind of change to a model fails ``assert_same``."""
    changes: dict[str, Callable[[nn.Module], Any]] = {
        "bytes": lambda m: m.model.norm.weight.data.add_(1e-3),
        "object": lambda m: setattr(m.model.norm, "weight", nn.Parameter(m.model.norm.weight.detach().clone())),
        "grad": lambda m: m.model.norm.weight.sum().backward(),
        "requires_grad": lambda m: m.model.norm.weight.requires_grad_(False),
        "mode": lambda m: m.model.layers[0].train(),
        "hook": lambda m: m.lm_head.register_forward_hook(lambda *a: None),
        "module": lambda m: setattr(m.model, "norm", nn.Identity()),
        "one bit of a buffer": lambda m: m.model.rotary_emb.inv_freq.view(torch.int32).__ixor__(1),
    }
    for what, change in changes.items():
        model = tiny_model("llama")
        before = model_state(model)
        change(model)
        with pytest.raises(AssertionError):
            assert_same(model, before, what)


