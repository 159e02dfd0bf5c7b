"""Helpers shared by the contract suite: build an adapter from a row, perturb, oracles."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import functional_call

import lora_func as lf
from lora_func.targeting import canonical_weight, stored_weight
from tests.models import DEFAULT_TARGETS, LAYER_KIND_MODEL, MODEL_SPEC, tiny_model, tokens
from tests.variant_table import Row


def calibration_batches(n: int = 4, batch: int = 4, length: int = 16, seed: int = 7) -> list[dict[str, Tensor]]:
    out = []
    for i in range(n):
        ids = tokens(batch, length, seed=seed + i)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # some padding, which calibration must ignore
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def spec_for(row: Row, model_kind: str, **overrides) -> lf.AdapterSpec:
    targets = (row.targets or DEFAULT_TARGETS).get(model_kind, DEFAULT_TARGETS[model_kind])
    kwargs = {**MODEL_SPEC.get(model_kind, {}), **row.spec_kwargs, **overrides}
    return lf.AdapterSpec(row.variant, targets=targets, **kwargs)


def build(row: Row, layer_kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **spec_overrides):
    """(model, adapter) for a row on the tiny model that has ``layer_kind`` layers."""
    model_kind = LAYER_KIND_MODEL[layer_kind]
    model = tiny_model(model_kind, seed=seed, dtype=dtype)
    spec = spec_for(row, model_kind, **spec_overrides)
    adapter = lf.init_adapter(
        model,
        spec,
        generator=torch.Generator().manual_seed(seed + 100),
        calibration=calibration_batches() if row.calibration else None,
    )
    return model, adapter


_SHARED: dict[tuple, tuple] = {}


def shared_build(row: Row, layer_kind: str, *, dtype: torch.dtype = torch.float32):
    """``build(row, layer_kind, dtype=dtype)`` for checks that only read the model: one model per
    (layer kind, dtype) and one ``init_adapter`` per (variant, layer kind, dtype) in the process;
    each call gets new copies of the adapter's trainable tensors (a check may write into them)
    and the global RNG state ``build`` leaves. ``clear_shared_builds()`` drops them."""
    key = (row.variant, layer_kind, dtype)
    # A test that registers a changed variant under the same name (test_variant_new_file) gets a
    # fresh adapter built with it: the cache holds the variant object it built with and compares.
    variant = lf.get_variant(row.variant)
    if key not in _SHARED or _SHARED[key][3] is not variant:
        model_key = ("model", layer_kind, dtype)
        if model_key not in _SHARED:
            _SHARED[model_key] = (tiny_model(LAYER_KIND_MODEL[layer_kind], dtype=dtype), torch.get_rng_state())
        model, rng = _SHARED[model_key]
        torch.set_rng_state(rng)
        adapter = lf.init_adapter(
            model,
            spec_for(row, LAYER_KIND_MODEL[layer_kind]),
            generator=torch.Generator().manual_seed(100),
            calibration=calibration_batches() if row.calibration else None,
        )
        _SHARED[key] = (model, adapter, torch.get_rng_state(), variant)
    model, adapter, rng, _ = _SHARED[key]
    torch.set_rng_state(rng)
    return model, adapter.with_params({k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in adapter.params.items()})


def clear_shared_builds() -> None:
    _SHARED.clear()


def perturbed(adapter: lf.Adapter, scale: float, seed: int = 3) -> lf.Adapter:
    """Every trainable tensor plus independent Gaussian noise (non-symmetric)."""
    g = torch.Generator().manual_seed(seed)
    return adapter.with_params(
        {k: (v.detach() + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)).requires_grad_(True) for k, v in adapter.params.items()}
    )


def perturbed_adapters(model, kind: str, variant: str, ranks) -> list[lf.Adapter]:
    """One perturbed adapter of ``variant`` per rank in ``ranks`` on the default targets of
    tiny-model ``kind``, each from its own seeds (distinct adapters: a swapped row shows)."""
    out = []
    for i, r in enumerate(ranks):
        spec = lf.AdapterSpec(variant, targets=DEFAULT_TARGETS[kind], r=r)
        adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(10 + i))
        out.append(perturbed(adapter, 0.3, seed=20 + i))
    return out


def probe(shape, seed: int = 9) -> Tensor:
    """Random weights for a scalar loss ``sum(out * probe)``: no symmetry hides a swapped row."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _float64_layer(base: dict[str, Tensor], adapter: lf.Adapter, layer) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor, Tensor | None]:
    """A layer's params, buffers, canonical ``W (d_out, d_in)`` and bias, detached, in float64."""
    t = layer.target
    p, b = adapter.layer_tensors(layer)
    W = canonical_weight(base[t.weight_key], t.layout).double()
    bias = base[t.bias_key].double() if t.bias_key else None
    return {k: v.detach().double() for k, v in p.items()}, {k: v.detach().double() for k, v in b.items()}, W, bias


def oracle_params(base: dict[str, Tensor], adapter: lf.Adapter, row: Row) -> dict[str, Tensor]:
    """``base`` with every target replaced by the row's explicit W_eff formula (float64 math)."""
    out = dict(base)
    for layer in adapter.layers:
        t = layer.target
        p64, b64, W, bias = _float64_layer(base, adapter, layer)
        w_eff, b_eff = row.w_eff(p64, b64, W, bias, layer.info)
        w_stored = stored_weight(w_eff, t.layout, base[t.weight_key].shape).to(base[t.weight_key].dtype)
        for key in (t.weight_key, *t.tied_keys):
            out[key] = w_stored
        if t.bias_key is not None and b_eff is not None:
            out[t.bias_key] = b_eff.to(base[t.bias_key].dtype)
    return out


def oracle_logits(model, base: dict[str, Tensor], adapter: lf.Adapter, row: Row, ids: Tensor) -> Tensor:
    """The logits of the row's oracle: the model on ``base`` with every target's W_eff replaced
    (``oracle_params``), or for a row with a ``y_oracle`` (no merged weight) every target's
    output replaced by the oracle's (float64 math) from the layer's input, by forward hooks."""
    if row.y_oracle is None:
        return logits(model, oracle_params(base, adapter, row), ids)
    modules = dict(model.named_modules())
    handles = []
    for layer in adapter.layers:
        p64, b64, W, bias = _float64_layer(base, adapter, layer)

        def hook(module, inputs, output, p64=p64, b64=b64, W=W, bias=bias, info=layer.info):
            return row.y_oracle(p64, b64, inputs[0].double(), W, bias, info).to(output.dtype)

        handles.append(modules[layer.target.module].register_forward_hook(hook))
    try:
        return logits(model, base, ids)
    finally:
        for handle in handles:
            handle.remove()


def logits(model, params: dict[str, Tensor], ids: Tensor) -> Tensor:
    return functional_call(model, params, (ids,)).logits


# The ways an adapter reaches the model: the parameter-dict overlays (lazy stand-ins, merged
# weights) and the module-call route (the variant applied at each target module's call).
PATHS = ("lazy", "merged", "module-lazy", "module-merged")


def run_path(model, base: dict[str, Tensor], adapter, ids: Tensor, path: str) -> Tensor:
    """The adapted model's logits on ``ids`` through ``path``."""
    if path == "lazy":
        return logits(model, lf.overlay(base, adapter), ids)
    if path == "merged":
        return logits(model, lf.merge_overlay(base, adapter), ids)
    return lf.adapted_call(model, adapter, ids, base=base, merged=path == "module-merged", route="module").logits


def loss_fn(model, base, adapter: lf.Adapter, ids: Tensor, *, merged: bool = False, path: str | None = None, with_output: bool = False):
    """Next-token cross-entropy of the adapted model on ``ids``; a function of the params.
    ``with_output``: it returns ``(loss, logits)``, for ``grad(..., has_aux=True)`` (one forward
    gives both the gradients and the logits)."""
    path = path or ("merged" if merged else "lazy")

    def loss(params):
        out = run_path(model, base, adapter.with_params(params), ids, path)
        value = torch.nn.functional.cross_entropy(out[..., :-1, :].reshape(-1, out.shape[-1]), ids[..., 1:].reshape(-1))
        return (value, out) if with_output else value

    return loss


def snapshot(model) -> dict[str, tuple[int, Tensor]]:
    return {
        name: (id(t), t.detach().clone())
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    }


def assert_unchanged(model, snap) -> None:
    now = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    assert sorted(now) == sorted(snap)
    for name, (ident, value) in snap.items():
        t = now[name]
        assert id(t) == ident, f"{name} was replaced"
        assert t.dtype == value.dtype and t.shape == value.shape, name
        assert torch.equal(t.detach().view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float16) else t.detach(), value.view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float16) else value), f"{name} changed"
        assert t.grad is None, f"{name} received a gradient"
