"""The shared contract suite: every registered variant x every target kind it adapts
(``Variant.kinds``): nn.Linear (tiny Llama), GPT-2 Conv1D, and the other kinds of
``lora_func.targeting.KINDS`` (the Llama's embedding and norms, a conv LM, a tiny Mixtral's
expert parameters).

Each check compares against an independent oracle (the row's explicit W_eff formula, a Python
loop for vmap) and is made per tensor, after a random non-symmetric perturbation."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, vmap

import lora_func as lf
from tests.contract_helpers import (
    assert_unchanged,
    calibration_batches,
    clear_shared_builds,
    logits,
    PATHS,
    loss_fn,
    oracle_logits,
    perturbed,
    run_path,
    shared_build as build,
    snapshot,
    spec_for,
)
from lora_func.targeting import kind_of_layout
from tests.models import DEFAULT_TARGETS, LAYER_KIND_MODEL, MODEL_SPEC, tiny_model, tokens
from tests.variant_table import ROWS

KINDS = tuple(LAYER_KIND_MODEL)
CASES = [pytest.param(ROWS[v], kind, id=f"{v}-{kind}") for v in sorted(ROWS) for kind in KINDS if kind in lf.get_variant(v).kinds]
# A MoE model's routing is data-dependent (nonzero, index_add_ into an unbatched buffer), which
# torch.func.vmap cannot batch whatever the adapter: the vmap checks run on the other kinds.
VMAP_CASES = [case for case in CASES if case.values[1] != "experts"]


@pytest.fixture(scope="module", autouse=True)
def _shared_builds():
    # build() here is contract_helpers.shared_build: one model per layer kind and one
    # init_adapter per case for the whole module (no check writes into the model; each gets its
    # own copy of the adapter's tensors). test_base_model_never_changes builds its own model.
    yield
    clear_shared_builds()
    _UPCAST.clear()


def test_every_registered_variant_has_a_row():
    assert sorted(ROWS) == lf.list_variants(), "add a row in tests/variant_rows/ for every registered variant"


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_targets_are_exactly_the_requested_layers(row, kind):
    model, adapter = build(row, kind)
    model_kind = LAYER_KIND_MODEL[kind]
    wanted = (row.targets or DEFAULT_TARGETS).get(model_kind, DEFAULT_TARGETS[model_kind])
    wanted = [*wanted, *MODEL_SPEC.get(model_kind, {}).get("target_parameters", [])]
    names = [n for n, _ in model.named_modules()] + [n for n, p in model.named_parameters() if p.dim() in (2, 3) and "." in n]
    expected = sorted(n for n in names if any(n == t or n.endswith("." + t) for t in wanted))
    if kind == "mha":  # an attention is two targets: its in_proj (named as the attention) and its out_proj
        expected = sorted([*expected, *(f"{n}.out_proj" for n in expected)])
    assert sorted(layer.target.module for layer in adapter.layers) == expected
    assert {kind_of_layout(layer.target.layout) for layer in adapter.layers} == {kind}


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_init_holds_the_tensor_schema(row, kind):
    """``init`` and ``shared_init`` give exactly the tensors the variant's schema declares (the
    shapes ``load_peft`` checks a checkpoint against, what ``stack`` pads): names, shapes
    (an expert parameter's with its expert axis), trainable or buffer, integer positions as
    int64 and the rest in the spec's dtype."""
    model, adapter = build(row, kind)
    variant = adapter.variant
    for layer in adapter.layers:
        # (a layer's forms see the shared tensors too: compared below)
        params, buffers = ({k: v for k, v in t.items() if not variant.tensors[k].shared} for t in adapter.layer_tensors(layer))
        lead = tuple(layer.target.shape[:1]) if layer.target.experts is not None else ()
        want = {name: (*lead, *shape) for name, shape in variant.shapes(layer.info).items()}
        assert {k: tuple(v.shape) for k, v in (params | buffers).items()} == want, layer.target.module
        assert set(buffers) == {name for name in want if variant.tensors[name].buffer}
    shared_params, shared_buffers = adapter.shared_tensors()
    info = adapter.layers[0].info
    # (a shared slot whose shape is None is not held: X-LoRA's classifier layers beyond its depth)
    shared = {name: tuple(shape) for name, slot in variant.tensors.items() if slot.shared and (shape := slot.shape(info)) is not None}
    # A tensor shared within groups of layers (Variant.groups): one per group key, shaped by its layers.
    for layer in adapter.layers:
        for name, key in adapter.layer_groups().get(layer.target.module, {}).items():
            shared.pop(name, None)
            assert shared.setdefault(f"{name}@{key}", tuple(variant.tensors[name].shape(layer.info))) == tuple(variant.tensors[name].shape(layer.info))
    assert {k: tuple(v.shape) for k, v in (shared_params | shared_buffers).items()} == shared
    assert set(shared_buffers) == {name for name in shared if variant.tensors[name.partition("@")[0]].buffer}
    for name, tensor in {**adapter.params, **adapter.buffers}.items():
        short = name.rsplit(".", 1)[-1].partition("@")[0]  # (a grouped shared tensor's slot: Variant.groups)
        slot = variant.tensors.get(short)
        if slot is not None:
            assert tensor.dtype == (torch.int64 if slot.integer else adapter.spec.dtype) or not slot.integer and short == "W_res", name


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_identity_at_init(row, kind):
    model, adapter = build(row, kind)
    ids = tokens()
    reference = model(ids).logits
    base = lf.base_params(model)
    for name in row.paths:
        out = run_path(model, base, adapter, ids, name)
        if row.identity_rtol == 0.0:
            assert torch.equal(out, reference), name
        else:
            assert (out - reference).abs().max() <= row.identity_rtol * reference.abs().max(), name


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_step0_gradient_pattern_per_tensor(row, kind):
    model, adapter = build(row, kind)
    names = {name for layer in adapter.layers for name, _ in layer.param_shapes}
    nonzero = row.step0(kind)
    assert nonzero <= names, f"row names {sorted(nonzero - names)} are not trainable tensors"
    base, ids = lf.base_params(model), tokens()
    grads = {m: grad(loss_fn(model, base, adapter, ids, path=m))(adapter.params) for m in row.paths}
    for layer in adapter.layers:
        for name, _ in layer.param_shapes:
            key = f"{layer.target.module}.{name}"
            g = grads["lazy"][key]
            assert torch.isfinite(g).all(), key
            if name in nonzero:
                assert g.abs().max() > 0, f"{key} gets no gradient at step 0"
            else:
                assert torch.count_nonzero(g) == 0, f"{key} should get exactly zero gradient at step 0"
            # atol relative to the tensor's largest gradient once that exceeds 1 (DeLoRA's
            # step-0 B gradient is ~1e4: the 1e4 per-rank factor of its norm clamp).
            atol = 1e-6 * max(1.0, float(g.detach().abs().max()))
            for other in row.paths[1:]:
                torch.testing.assert_close(grads[other][key], g, atol=atol, rtol=1e-4, msg=f"{other} {key}")


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_merged_lazy_and_oracle_agree_after_perturbation(row, kind):
    model, adapter = build(row, kind)
    adapter = perturbed(adapter, row.perturb_scale)
    base, ids = lf.base_params(model), tokens()
    reference = model(ids).logits
    oracle = oracle_logits(model, base, adapter, row, ids)
    assert (oracle - reference).abs().max() > 1e-3, "the perturbed adapter should change the output"
    for name in row.paths:
        out = run_path(model, base, adapter, ids, name)
        torch.testing.assert_close(out, oracle, atol=row.tol, rtol=0, msg=name)
        route = "module" if name.startswith("module") else "overlay"
        via_call = lf.adapted_call(model, adapter, ids, merged=name.endswith("merged"), route=route).logits
        assert torch.equal(via_call, out), name


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_inference_calls_reusing_one_base_follow_the_adapter(row, kind):
    # adapted_call reuses its validated application between no_grad calls with one base dict
    # and adapter: every call, the first and the reusing ones, on both routes, equals the
    # oracle, also after an in-place write to every trainable tensor (an optimiser step). The
    # tolerance is the row's, relative to the logits' scale (fp32 kernels may pick another
    # blocking from one process to the next: a few ulps of a logit of size ~2).
    model, adapter = build(row, kind)
    adapter = perturbed(adapter, row.perturb_scale)
    base, ids = lf.base_params(model), tokens()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for route in ("overlay", "module"):
            oracle = oracle_logits(model, base, adapter, row, ids)
            tol = row.tol * max(1.0, float(oracle.abs().max()))
            for _ in range(2):
                got = lf.adapted_call(model, adapter, ids, base=base, route=route).logits
                torch.testing.assert_close(got, oracle, atol=tol, rtol=0, msg=route)
            for tensor in adapter.params.values():
                tensor.add_(row.perturb_scale * torch.randn(tensor.shape, generator=g, dtype=tensor.dtype))
            moved = oracle_logits(model, base, adapter, row, ids)
            assert (moved - oracle).abs().max() > 1e-4
            torch.testing.assert_close(lf.adapted_call(model, adapter, ids, base=base, route=route).logits, moved, atol=tol, rtol=0)


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_module_call_route_equals_the_overlay_bit_for_bit(row, kind):
    # Same kernels on the same tensors in the same order: logits and gradients identical.
    model, adapter = build(row, kind)
    adapter = perturbed(adapter, row.perturb_scale)
    base, ids = lf.base_params(model), tokens()
    for overlay_path, module_path in (("lazy", "module-lazy"), ("merged", "module-merged"))[: len(row.paths) // 2]:
        assert torch.equal(run_path(model, base, adapter, ids, module_path), run_path(model, base, adapter, ids, overlay_path))
        want = grad(loss_fn(model, base, adapter, ids, path=overlay_path))(adapter.params)
        got = grad(loss_fn(model, base, adapter, ids, path=module_path))(adapter.params)
        for key in want:
            assert torch.equal(got[key], want[key]), f"{module_path} {key}"


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_each_trainable_tensor_alone_changes_the_output(row, kind):
    model, adapter = build(row, kind)
    adapter = perturbed(adapter, row.perturb_scale)
    base, ids = lf.base_params(model), tokens()
    g = torch.Generator().manual_seed(11)
    for name in row.paths:
        out = run_path(model, base, adapter, ids, name)
        keys, variants = [], []
        for key, value in adapter.params.items():
            if key.rsplit(".", 1)[-1] in row.training_only:
                continue  # acts in training steps only (Row.training_only)
            bumped = dict(adapter.params)
            bumped[key] = value.detach() + 0.5 * torch.randn(value.shape, generator=g)
            keys.append(key)
            variants.append(adapter.with_params(bumped))
        if kind == "experts":  # (a MoE's routing cannot be vmapped: VMAP_CASES)
            moved = torch.stack([run_path(model, base, a, ids, name) for a in variants])
        else:
            # One vmap over the bumped adapters instead of a call per tensor (vmap == a loop on
            # every path: test_vmap_over_stacked_adapters_equals_loop).
            moved = vmap(lambda a: run_path(model, base, a, ids, name))(lf.stack(variants))  # noqa: B023
        for key, one in zip(keys, moved, strict=True):
            assert (one - out).abs().max() > 1e-5, f"{name}: {key} does not affect the output"


@pytest.mark.parametrize(("row", "kind"), VMAP_CASES)
def test_vmap_over_stacked_adapters_equals_loop(row, kind):
    model, adapter = build(row, kind)
    members = [perturbed(adapter, row.perturb_scale, seed=s) for s in (1, 2, 3)]
    stacked = lf.stack(members)
    assert stacked.stack_shape == (3,)
    base, ids = lf.base_params(model), tokens()
    for name in row.paths:
        batched = vmap(lambda a: run_path(model, base, a, ids, name))(stacked)  # noqa: B023
        for i, member in enumerate(members):
            torch.testing.assert_close(batched[i], run_path(model, base, member, ids, name), atol=1e-5, rtol=0, msg=name)
    assert not torch.allclose(batched[0], batched[1])
    for original, back in zip(members, lf.unstack(stacked), strict=True):
        for key in original.params:
            assert torch.equal(original.params[key], back.params[key])


@pytest.mark.parametrize(("row", "kind"), VMAP_CASES)
def test_per_example_gradients_equal_loop(row, kind):
    model, adapter = build(row, kind)
    adapter = perturbed(adapter, row.perturb_scale)
    # (two examples: a gradient that mixes rows, or sums them, differs from each one's own)
    base, ids = lf.base_params(model), tokens(batch=2)
    for name in row.paths:

        def example_loss(params, x, path=name):
            return loss_fn(model, base, adapter, x[None], path=path)(params)

        per_example = vmap(grad(example_loss), in_dims=(None, 0))(adapter.params, ids)
        for i in range(ids.shape[0]):
            single = grad(example_loss)(adapter.params, ids[i])
            for key, g in single.items():
                assert g.abs().max() > 0 or key.rsplit(".", 1)[-1] in row.training_only, key
                torch.testing.assert_close(per_example[key][i], g, atol=1e-6, rtol=1e-4, msg=f"{name} {key}")
        key = [k for k in single if k.rsplit(".", 1)[-1] not in row.training_only][-1]
        assert not torch.allclose(per_example[key][0], per_example[key][1])


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_base_model_never_changes(row, kind, tmp_path):
    model_kind = LAYER_KIND_MODEL[kind]
    model = tiny_model(model_kind)
    snap = snapshot(model)
    spec = spec_for(row, model_kind)
    calibration = calibration_batches() if row.calibration else None
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0), calibration=calibration)
    adapter = perturbed(adapter, row.perturb_scale).detach()
    base, ids = lf.base_params(model), tokens()
    for path in row.paths:
        grad(loss_fn(model, base, adapter, ids, path=path))(adapter.params)
        route = "module" if path.startswith("module") else "overlay"
        lf.adapted_call(model, adapter, ids, merged=path.endswith("merged"), route=route).logits.square().mean().backward()
    if kind != "experts":  # (a MoE's routing cannot be vmapped: VMAP_CASES)
        vmap(lambda a: logits(model, lf.overlay(base, a), ids))(lf.stack([adapter, adapter]))
    lf.take(lf.stack([adapter, adapter]), torch.tensor([1, 0]))
    optimizer = torch.optim.SGD(adapter.params.values(), lr=0.1)
    out = lf.adapted_call(model, adapter, ids).logits
    out.square().mean().backward()  # a plain backward must not reach the model's tensors
    optimizer.step()
    path = lf.save(adapter, tmp_path / "a.safetensors")
    lf.load(path, model=model)
    # Calls that raise midway must not leave anything behind either.
    other = build(ROWS["lora"], "conv1d" if model_kind.startswith("llama") else "linear")[0]  # (a load that raises: read only)
    with pytest.raises((KeyError, ValueError)):
        lf.load(path, model=other)
    with pytest.raises(ValueError):
        lf.init_adapter(model, lf.AdapterSpec(row.variant, targets=["no_such_layer"]))
    with pytest.raises(KeyError):
        lf.adapted_call(model, adapter, ids, base={**base, "typo.weight": base[next(iter(base))]})
    broken = adapter.with_params({k: v[..., :1] for k, v in adapter.params.items()})
    for merged in (False, True):
        with pytest.raises(ValueError):
            lf.adapted_call(model, broken, ids, merged=merged)
    assert_unchanged(model, snap)


_UPCAST: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def _upcast(kind: str, dtype: torch.dtype, model: torch.nn.Module) -> torch.nn.Module:
    """An fp32 copy of the shared half-precision ``model`` (its rounded weights, upcast), once per kind."""
    if (kind, dtype) not in _UPCAST:
        model32 = tiny_model(LAYER_KIND_MODEL[kind]).float()
        model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        _UPCAST[kind, dtype] = model32
    return _UPCAST[kind, dtype]


def _half_dtype_cases():
    """Each (row, kind) on one half dtype, alternating over the variant's kinds, so every variant
    with two kinds meets bf16 on one and fp16 on the other, and each kind meets both over the
    variants (both dtypes on every case repeated the same forms: what differs between them, the
    range and the rounding, acts on every variant's one code path)."""
    variants = sorted({case.values[0].variant for case in CASES})
    seen: dict[str, int] = {}
    for case in CASES:
        row, kind = case.values
        nth = seen[row.variant] = seen.get(row.variant, -1) + 1  # the variant's kinds in CASES order
        dtype = (torch.bfloat16, torch.float16)[(variants.index(row.variant) + nth) % 2]
        yield pytest.param(row, kind, dtype, id=f"{row.variant}-{kind}-{'bf16' if dtype == torch.bfloat16 else 'fp16'}")


@pytest.mark.parametrize(("row", "kind", "dtype"), list(_half_dtype_cases()))
def test_dtype_policy_fp32_adapter_on_half_base(row, kind, dtype):
    model, adapter = build(row, kind, dtype=dtype)
    for key, value in {**adapter.params, **adapter.buffers}.items():
        if value.is_floating_point():
            assert value.dtype == torch.float32, key
    adapter = perturbed(adapter, row.perturb_scale)
    base, ids = lf.base_params(model), tokens()
    # fp32 reference: the same (already rounded) base weights, upcast, with the oracle W_eff.
    model32 = _upcast(kind, dtype, model)
    base32 = lf.base_params(model32)
    oracle = oracle_logits(model32, base32, adapter, row, ids)
    effect = (oracle - model32(ids).logits).abs().max()
    for name in row.paths:
        # the logits of the forward the gradients are taken through (one forward for both)
        grads, out = grad(loss_fn(model, base, adapter, ids, path=name, with_output=True), has_aux=True)(adapter.params)
        assert out.dtype == dtype, name
        assert torch.isfinite(out).all(), name
        # Worst case measured 0.040 of the effect (DoRA, bf16, lazy): a 10% loss of the adapter fails.
        assert (out.float() - oracle).abs().max() < 0.08 * effect, f"{name}: half-precision output far from the fp32 oracle"
        for key, g in grads.items():
            assert g.dtype == torch.float32 and torch.isfinite(g).all(), f"{name} {key}"


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_save_load_after_training_steps(row, kind, tmp_path):
    model, adapter = build(row, kind)
    adapter = adapter.detach()
    initial = {k: v.detach().clone() for k, v in adapter.params.items()}
    optimizer = torch.optim.Adam(adapter.params.values(), lr=1e-2)
    ids = tokens()
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(model, lf.base_params(model), adapter, ids)(adapter.params).backward()
        optimizer.step()
    for name in row.step0(kind):
        for layer in adapter.layers:
            key = f"{layer.target.module}.{name}"
            assert not torch.equal(adapter.params[key], initial[key]), f"{key} did not train"
    path = lf.save(adapter, tmp_path / "adapter.safetensors")
    fresh = tiny_model(LAYER_KIND_MODEL[kind])
    loaded = lf.load(path, model=fresh)
    assert loaded.spec == adapter.spec and loaded.layers == adapter.layers
    for flat, flat_loaded in ((adapter.params, loaded.params), (adapter.buffers, loaded.buffers)):
        assert sorted(flat) == sorted(flat_loaded)
        for key in flat:
            assert flat_loaded[key].dtype == flat[key].dtype and torch.equal(flat_loaded[key], flat[key]), key
    for merged in (False, True)[: len(row.paths) // 2]:
        before = lf.adapted_call(model, adapter, ids, merged=merged).logits
        after = lf.adapted_call(fresh, loaded, ids, merged=merged).logits
        assert torch.equal(before, after)
        assert not torch.equal(after, fresh(ids).logits)
