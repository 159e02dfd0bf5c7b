"""The error catalogue's cases for lora_func.attribution (docs/errors.md, "Training-data
attribution"): one case per entry, run by tests/test_error_catalogue.py's ``test_error`` (type,
message, names, nothing touched, the global RNG left alone).

The cases are added to that file's ``CASES`` when this module is imported (pytest imports every
collected module before running any test), so the catalogue's coverage tests see them whenever
this file is collected too; tests/test_error_catalogue.py imports this module at its end, so
that file alone covers them too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import lora_func as lf
from lora_func import attribution as at
from tests import test_error_catalogue as catalogue
from tests.test_error_catalogue import Case, Ctx
from tests.models import tokens

IDS = tokens(3, 6)


def _loss(model: torch.nn.Module) -> Callable[..., Any]:
    def loss_fn(adapter: Any, ids: torch.Tensor, *rest: Any) -> torch.Tensor:
        logits = lf.adapted_call(model, adapter, ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    return loss_fn


def _on_lora(call: Callable[[torch.nn.Module, lf.Adapter, Ctx], Any], **kwargs: Any) -> Callable[[Ctx], Callable[[], Any]]:
    """``call(model, adapter, ctx)`` with a LoRA adapter on q_proj of a tracked tiny Llama."""

    def arrange(ctx: Ctx) -> Callable[[], Any]:
        model = ctx.model()
        return functools.partial(call, model, ctx.adapter(model, **kwargs), ctx)

    return arrange


def _features(**kwargs: Any) -> Callable[[Ctx], Callable[[], Any]]:
    return _on_lora(lambda m, a, ctx: at.features(_loss(m), a, IDS, **kwargs))


def _rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _scores(train: Any, test: Any, **kwargs: Any) -> Callable[[Ctx], Callable[[], Any]]:
    return lambda ctx: lambda: at.scores(train, test, **kwargs)


def _arranged(make: Callable[[torch.nn.Module, lf.Adapter, Ctx], Callable[[], Any]], **kwargs: Any) -> Callable[[Ctx], Callable[[], Any]]:
    """``make(model, adapter, ctx)`` builds what the failing call needs and returns the call."""

    def arrange(ctx: Ctx) -> Callable[[], Any]:
        model = ctx.model()
        return make(model, ctx.adapter(model, **kwargs), ctx)

    return arrange


def _stepped(model: torch.nn.Module, adapter: lf.Adapter, groups: list[dict] | None = None) -> tuple[torch.optim.Optimizer, lf.Adapter]:
    """An AdamW that stepped once on a copy of ``adapter`` (its tensors, not the adapter's)."""
    copy = adapter.detach()
    params = list(copy.params.values())
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "betas": (0.5, 0.5)}] if groups else params)
    _loss(model)(copy, IDS).backward()
    optimizer.step()
    return optimizer, copy


def _not_its_optimizer(m: torch.nn.Module, a: lf.Adapter, ctx: Ctx) -> Callable[[], Any]:
    optimizer, _ = _stepped(m, a)
    return lambda: at.features(_loss(m), a, IDS, preconditioner=optimizer)


def _groups(m: torch.nn.Module, a: lf.Adapter, ctx: Ctx) -> Callable[[], Any]:
    optimizer, copy = _stepped(m, a, groups=[{}])
    return lambda: at.adam_preconditioner(optimizer, copy)


def _influence(train: Callable[[torch.nn.Module, lf.Adapter], Any], test: Callable[[torch.nn.Module, lf.Adapter], Any], **kwargs: Any) -> Callable[[Ctx], Callable[[], Any]]:
    def make(m: torch.nn.Module, a: lf.Adapter, ctx: Ctx) -> Callable[[], Any]:
        curvature, train_rows, test_rows = at.ekfac(_loss(m), a, [(IDS,)]), train(m, a), test(m, a)
        return lambda: at.influence(curvature, train_rows, test_rows, **kwargs)

    return _arranged(make)


def _raw(m: torch.nn.Module, a: lf.Adapter) -> torch.Tensor:
    return at.features(_loss(m), a, IDS)


def _moments(a: lf.Adapter, **changes: Any) -> dict:
    out = {k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v)} for k, v in a.params.items()}
    for key, value in changes.items():
        out[next(k for k in out if k.endswith(key))] = value
    return out


def _dropout_in_train_mode(m: torch.nn.Module, a: lf.Adapter, ctx: Ctx) -> Any:
    m.train()
    return at.ekfac(_loss(m), a, [(IDS,)], randomness="different")


def _one_shot(m: torch.nn.Module, a: lf.Adapter, ctx: Ctx) -> Any:
    return at.ekfac(_loss(m), a, iter([(IDS,)]))


def _write_into_directory(m: torch.nn.Module, a: lf.Adapter, ctx: Ctx) -> Callable[[], Any]:
    (ctx.tmp / "features").mkdir()
    return lambda: at.write_features(ctx.tmp / "features", _loss(m), a, [(IDS,)])


def _write_nothing(m: torch.nn.Module, a: lf.Adapter, ctx: Ctx) -> Any:
    return at.write_features(ctx.tmp / "features.npy", _loss(m), a, [])


CASES: dict[str, Case] = {
    "attribution-loss-fn": Case(_on_lora(lambda m, a, ctx: at.features(a, a, IDS)), ("Adapter", "features(loss_fn, adapter, ...)")),
    "attribution-proj-dim": Case(_features(proj_dim=0), ("proj_dim", "got 0")),
    "attribution-chunk-size": Case(_features(chunk_size=-2), ("chunk_size", "-2")),
    "attribution-generator": Case(_features(proj_dim=8, generator=3), ("generator", "int")),
    "attribution-batch": Case(_on_lora(lambda m, a, ctx: at.features(_loss(m), a, IDS, torch.ones(2))), ("[2, 3]",)),
    "attribution-stack-shape": Case(_on_lora(lambda m, a, ctx: at.features(_loss(m), lf.stack([lf.stack([a, a]), lf.stack([a, a])]), IDS)), ("(2, 2)",)),
    "attribution-path-dir": Case(_arranged(_write_into_directory), ("features", "features.npy")),
    "attribution-no-examples": Case(_on_lora(_write_nothing), ("batches",)),
    "attribution-optimizer-state": Case(_arranged(_not_its_optimizer), ("AdamW", "q_proj.lora_A")),
    "attribution-optimizer-groups": Case(_arranged(_groups), ("(0.5, 0.5)", "betas=")),
    "attribution-moments-keys": Case(_on_lora(lambda m, a, ctx: at.features(_loss(m), a, IDS, preconditioner=_moments(a, lora_A={"exp_avg": torch.zeros(1)}))), ("q_proj.lora_A",)),
    "attribution-preconditioner-type": Case(_on_lora(lambda m, a, ctx: at.adam_preconditioner([1.0], a)), ("list",)),
    "attribution-moments-shape": Case(
        _on_lora(lambda m, a, ctx: at.adam_preconditioner(_moments(a, lora_B={"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}), a)),
        ("exp_avg of", "q_proj.lora_B", "(3,)"),
    ),
    "attribution-preconditioner": Case(_features(preconditioner=torch.ones(3)), ("preconditioner", "Tensor")),
    "attribution-features-shape": Case(_scores(_rows(4, 3)[0], _rows(2, 3)), ("train", "(3,)")),
    "attribution-features-type": Case(_scores({"x": _rows(4, 3)}, _rows(2, 3)), ("train", "dict")),
    "attribution-checkpoints": Case(_scores(torch.stack([_rows(4, 3)] * 2), _rows(2, 3)), ("train has 2", "test none")),
    "attribution-feature-dims": Case(_scores(_rows(4, 3), _rows(2, 5)), ("[3, 5]", "proj_dim")),
    "attribution-weights": Case(_scores(torch.stack([_rows(4, 3)] * 2), torch.stack([_rows(2, 3)] * 2), weights=[1.0]), ("2 finite numbers", "[1.0]")),
    "attribution-trak-rank": Case(_scores(_rows(4, 6), _rows(2, 6), method="trak"), ("D=6", "n_train=4", "damping > 0")),
    "attribution-trak-singular": Case(_scores(torch.zeros(6, 3), _rows(2, 3), method="trak"), ("damping=0.0",)),
    "attribution-method": Case(_scores(_rows(4, 3), _rows(2, 3), method="ekfac"), ("'ekfac'", "'trak'")),
    "attribution-damping": Case(_scores(_rows(4, 3), _rows(2, 3), method="trak", damping=-1.0), ("-1.0",)),
    "attribution-damping-method": Case(_scores(_rows(4, 3), _rows(2, 3), method="less", damping=0.1), ("damping=0.1", "method='trak'")),
    "attribution-lds-input": Case(lambda ctx: lambda: at.lds(np.zeros((2, 3)), torch.ones(4, 3), torch.ones(4, 2)), ("ndarray",)),
    "attribution-lds-shapes": Case(lambda ctx: lambda: at.lds(torch.zeros(2, 3), torch.ones(4, 5), torch.ones(4, 2)), ("(4, 5)", "(M, n_train)")),
    "attribution-ekfac-damping": Case(_influence(_raw, _raw, damping=float("nan")), ("nan", "None")),
    "attribution-ekfac-dim": Case(
        _influence(_raw, lambda m, a: at.features(_loss(m), a, IDS, proj_dim=4, generator=torch.Generator())), ("test", "D=256", "(3, 4)")
    ),
    "attribution-ekfac-train-dim": Case(_influence(lambda m, a: _rows(3, 7), _raw), ("D=256", "(3, 7)")),
    "attribution-ekfac-type": Case(lambda ctx: lambda: at.influence(_rows(3, 7), _rows(3, 7), _rows(3, 7)), ("Tensor",)),
    "attribution-ekfac-stacked": Case(_on_lora(lambda m, a, ctx: at.ekfac(_loss(m), lf.stack([a, a]), [(IDS,)])), ("(2,)", "take")),
    "attribution-ekfac-unsupported": Case(
        _on_lora(lambda m, a, ctx: at.ekfac(_loss(m), a, [(IDS,)]), variant="dora"),
        ("model.layers.0.self_attn.q_proj (dora", "method='trak'"),
    ),
    "attribution-ekfac-token-mask": Case(_on_lora(lambda m, a, ctx: at.ekfac(_loss(m), a, [(IDS,)], token_mask=torch.ones(3, 6))), ("Tensor",)),
    "attribution-ekfac-mask": Case(
        _on_lora(lambda m, a, ctx: at.ekfac(_loss(m), a, [(IDS,)], token_mask=lambda ids: torch.ones(3, 7))),
        ("(3, 7)", "6 tokens", "q_proj"),
    ),
    "attribution-ekfac-merged": Case(
        _on_lora(lambda m, a, ctx: at.ekfac(lambda a_, ids: lf.adapted_call(m, a_, ids, merged=True).logits.square().mean(), a, [(IDS,)])),
        ("q_proj.lora_", "merged=False"),
    ),
    "attribution-ekfac-dropout": Case(_on_lora(_dropout_in_train_mode, dropout=0.5), ("model.layers.0.self_attn.q_proj", "model.eval()")),
    "attribution-ekfac-no-data": Case(_on_lora(lambda m, a, ctx: at.ekfac(_loss(m), a, [])), ("batches gave no examples",)),
    "attribution-ekfac-batches-once": Case(_on_lora(_one_shot), ("3 examples on the first pass and 0",)),
}

catalogue.CASES.update(CASES)
# Fails after the LoRA dropout of a layer in train mode has drawn its mask.
catalogue.RNG_ADVANCES = catalogue.RNG_ADVANCES | {"attribution-ekfac-dropout"}


def test_every_attribution_entry_of_the_catalogue_has_a_case_here():
    entries = {entry for entry in catalogue.ENTRIES if entry.startswith("attribution-")}
    assert entries == set(CASES)
    assert all(catalogue.CASES[key] is case for key, case in CASES.items())
