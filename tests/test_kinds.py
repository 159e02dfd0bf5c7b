"""The target kinds beyond Linear / Conv1D (lora_func.targeting.KINDS): every registered variant
either adapts a kind or refuses it naming the variant, the kind and what it adapts; the spec's
``target_parameters``; targets of the new kinds in native files; LoRA's merged weights per kind
against an explicit formula (the peft oracle is tests/test_kinds_peft.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lora_func as lf
from lora_func.targeting import KINDS, kind_of_layout
from tests.contract_helpers import calibration_batches
from tests.models import tiny_model, tokens

# kind -> (tiny model, targets, extra spec arguments)
NEW_KINDS = {
    "embedding": ("llama", ["embed_tokens"], {}),
    "conv": ("convlm", ["seq", "grid"], {}),
    "grouped_conv": ("gconvlm", ["seq", "grid"], {}),
    "parameter": ("parameters", [], {"target_parameters": ["hold.w"]}),
    "mha": ("attention", ["attn"], {}),
    "norm": ("gpt2", ["ln_1", "ln_f"], {}),
    "experts": ("mixtral", [], {"target_parameters": ["gate_up_proj", "down_proj"]}),
}


@pytest.fixture(scope="module")
def models():
    return {name: tiny_model(name) for name in {m for m, _, _ in NEW_KINDS.values()}}


@pytest.mark.parametrize("kind", sorted(NEW_KINDS))
@pytest.mark.parametrize("variant", lf.list_variants())
def test_every_variant_adapts_a_kind_or_refuses_it_clearly(variant, kind, models):
    model_name, targets, extra = NEW_KINDS[kind]
    model = models[model_name]
    spec = lf.AdapterSpec(variant, targets=targets, r=2, **extra)
    declared = lf.get_variant(variant).kinds
    assert declared <= set(KINDS), f"{variant} declares unknown kinds {sorted(declared - set(KINDS))}"
    calibration = calibration_batches(n=1) if lf.get_variant(variant).calibration is not None else None
    if kind in declared:
        adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0), calibration=calibration)
        assert {kind_of_layout(layer.target.layout) for layer in adapter.layers} == {kind}
        return
    with pytest.raises(ValueError) as err:
        lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0), calibration=calibration)
    message = str(err.value)
    assert f"variant {variant!r} cannot adapt" in message and f"({kind})" in message
    assert all(f"{k} ({KINDS[k]})" in message for k in declared), message


def test_lora_and_ln_tuning_declare_their_kinds():
    assert lf.get_variant("lora").kinds == {"linear", "conv1d", "embedding", "conv", "experts", "parameter", "mha"}
    assert lf.get_variant("ln_tuning").kinds == {"linear", "conv1d", "norm", "embedding", "conv", "grouped_conv"}


def _perturbed(adapter, scale=0.3, seed=4):
    g = torch.Generator().manual_seed(seed)
    return adapter.with_params({k: v.detach() + scale * torch.randn(v.shape, generator=g) for k, v in adapter.params.items()})


def test_lora_merged_weights_per_kind_follow_the_formula(models):
    """W_eff per kind from an explicit formula: the embedding's (V, d) table gains s·(BA)ᵀ, a
    conv's kernel s·B·A reshaped to (out, in, *k), each expert e its own s·B_e A_e."""
    s = 6.0 / 2
    for kind, (model_name, targets, extra) in NEW_KINDS.items():
        if kind in ("norm", "grouped_conv", "parameter", "mha"):  # (LoRA adapts neither of the first two; the others: test_kinds_peft)
            continue
        model = models[model_name]
        adapter = _perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=2, alpha=6.0, **extra)))
        base = lf.base_params(model)
        merged = lf.merge_overlay(base, adapter)
        for layer in adapter.layers:
            t = layer.target
            a, b = adapter.params[f"{t.module}.lora_A"], adapter.params[f"{t.module}.lora_B"]
            w = base[t.weight_key]
            if kind == "embedding":
                want = w + s * (b @ a).T
            elif kind == "conv":
                want = w + s * (b @ a).reshape(w.shape)
            else:
                want = w + s * torch.stack([b[e] @ a[e] for e in range(w.shape[0])])
            torch.testing.assert_close(merged[t.weight_key], want, rtol=1e-6, atol=1e-6, msg=t.module)


def test_ln_tuning_replaces_the_norm_weight_and_bias(models):
    model = models["gpt2"]
    adapter = _perturbed(lf.init_adapter(model, lf.AdapterSpec("ln_tuning", targets=["ln_f"])))
    merged = lf.merge_overlay(lf.base_params(model), adapter)
    assert torch.equal(merged["transformer.ln_f.weight"], adapter.params["transformer.ln_f.ln_weight"])
    assert torch.equal(merged["transformer.ln_f.bias"], adapter.params["transformer.ln_f.ln_bias"])
    # The logits are the head on ln_f with the trained copy, applied to the input ln_f receives.
    captured = {}
    hook = model.transformer.ln_f.register_forward_hook(lambda m, i, o: captured.update(x=i[0]))  # returns None: output kept
    ids = tokens()
    try:
        out = lf.adapted_call(model, adapter, ids)
    finally:
        hook.remove()
    weight, bias = adapter.params["transformer.ln_f.ln_weight"], adapter.params["transformer.ln_f.ln_bias"]
    want = F.linear(F.layer_norm(captured["x"], (32,), weight, bias, 1e-5), model.lm_head.weight)
    torch.testing.assert_close(out.logits, want)
    assert not torch.allclose(out.logits, model(ids).logits)


def test_ln_tuning_params_never_share_the_base_storage(models):
    model = models["gpt2"]
    adapter = lf.init_adapter(model, lf.AdapterSpec("ln_tuning", targets=["ln_f"]))
    for key, tensor in adapter.params.items():
        assert tensor.untyped_storage().data_ptr() != model.transformer.ln_f.weight.untyped_storage().data_ptr(), key
        assert tensor.untyped_storage().data_ptr() != model.transformer.ln_f.bias.untyped_storage().data_ptr(), key


def test_target_parameters_in_the_spec_round_trip_and_leave_old_json_alone():
    spec = lf.AdapterSpec("lora", targets=[], target_parameters=["mlp.experts.gate_up_proj"], r=2)
    assert lf.AdapterSpec.from_json(spec.to_json()) == spec
    plain = lf.AdapterSpec("lora", targets=["q_proj"])
    assert "target_parameters" not in plain.to_json()
    with pytest.raises(ValueError, match="non-empty list"):
        lf.AdapterSpec("lora", targets=[])


@pytest.mark.parametrize("kind", ["embedding", "conv", "experts"])
def test_native_save_load_per_kind(kind, models, tmp_path):
    model_name, targets, extra = NEW_KINDS[kind]
    model = models[model_name]
    adapter = _perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=2, **extra)))
    loaded = lf.load(lf.save(adapter, tmp_path / "a.safetensors"), model=model)
    assert loaded.layers == adapter.layers and loaded.spec == adapter.spec
    ids = tokens()
    assert torch.equal(lf.adapted_call(model, loaded, ids).logits, lf.adapted_call(model, adapter, ids).logits)
    other = tiny_model("llama" if model_name != "llama" else "gpt2")
    with pytest.raises((KeyError, ValueError)):
        lf.load(tmp_path / "a.safetensors", model=other)


def test_the_lazy_overlay_merges_the_new_kinds_once(models):
    """The new kinds enter the parameter dict as merged tensors (no stand-in whose every use would
    merge again: a MoE's eager loop reads its expert parameter once per expert)."""
    model = models["mixtral"]
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], target_parameters=["down_proj"], r=2))
    params = lf.overlay(lf.base_params(model), adapter)
    experts = "model.layers.0.mlp.experts.down_proj"
    assert type(params[experts]) is torch.Tensor
    assert type(params["model.layers.0.self_attn.q_proj.weight"]) is not torch.Tensor  # a lazy stand-in


def test_the_mixed_route_refuses_merged_only_kinds(models):
    model = models["llama"]
    a = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["embed_tokens"], r=2))
    with pytest.raises(ValueError, match=r"model.embed_tokens \(embedding\)"):
        lf.mixed_call(model, [a, a], torch.tensor([0, 1]), tokens(), batching="layers")


@pytest.mark.parametrize("kind", ["embedding", "conv", "experts"])
def test_rank_padded_stacks_keep_each_member(kind, models):
    """Adapters of ranks 2 and 3 stacked (zero-padded, masked): under vmap each member's merged
    weight is its own, on an expert parameter too (the rank axis sits after the expert axis)."""
    model_name, targets, extra = NEW_KINDS[kind]
    model = models[model_name]
    members = [
        _perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=r, **extra), generator=torch.Generator().manual_seed(r)), seed=r)
        for r in (2, 3)
    ]
    stacked = lf.stack(members)
    assert stacked.members is not None
    base = lf.base_params(model)
    keys = [layer.target.weight_key for layer in members[0].layers]
    batched = torch.func.vmap(lambda a: [lf.merge_overlay(base, a)[k] for k in keys])(stacked)
    for i, member in enumerate(members):
        merged = lf.merge_overlay(base, member)
        for j, key in enumerate(keys):
            torch.testing.assert_close(batched[j][i], merged[key], rtol=1e-6, atol=1e-6, msg=f"{key} member {i}")
    assert not torch.allclose(batched[0][0], batched[0][1])


def test_lora_on_an_embedding_is_a_gather_on_both_lazy_routes(models):
    """The lazy overlay (strict: any use of the table other than the lookup would raise) and the
    module route compute LoRA on the embedding by its gather form, never a merged (V, d) table,
    and equal the merged weight's outputs."""
    model = models["llama"]
    adapter = _perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["embed_tokens"], r=2)))
    base, ids = lf.base_params(model), tokens()
    merged = torch.func.functional_call(model, lf.merge_overlay(base, adapter), (ids,)).logits
    strict = torch.func.functional_call(model, lf.overlay(base, adapter, lazy_only=True), (ids,)).logits
    torch.testing.assert_close(strict, merged, rtol=1e-5, atol=1e-5)
    calls = []

    class NoTable(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # (detach: the call's base dict, the table itself and the head's weight, no new table)
            if isinstance(out, torch.Tensor) and func is not torch.Tensor.detach and tuple(out.shape) == tuple(base["model.embed_tokens.weight"].shape):
                calls.append(getattr(func, "__name__", func))
            return out

    with NoTable():
        for route in ("overlay", "module"):
            out = lf.adapted_call(model, adapter, ids, route=route).logits
            torch.testing.assert_close(out, merged, rtol=1e-5, atol=1e-5)
    assert calls == [], f"a (V, d) table was built: {calls}"


@pytest.mark.parametrize("kind", ["embedding", "conv", "experts"])
def test_export_and_merging_per_kind(kind, models):
    """merged_state_dict loads into a fresh model with the adapted outputs; merge_adapters (SVD to
    rank r) of an adapter with itself is that adapter, per expert too."""
    model_name, targets, extra = NEW_KINDS[kind]
    model = models[model_name]
    adapter = _perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=2, **extra)))
    ids = tokens()
    want = lf.adapted_call(model, adapter, ids).logits.detach()
    fresh = tiny_model(model_name)
    fresh.load_state_dict(lf.merged_state_dict(model, adapter))
    torch.testing.assert_close(fresh(ids).logits, want, rtol=1e-5, atol=1e-5)
    merged = lf.merge_adapters([adapter, adapter], weights=[0.5, 0.5], rank=2, method="svd")
    torch.testing.assert_close(lf.adapted_call(model, merged, ids).logits, want, rtol=1e-4, atol=1e-4)


def test_load_refuses_a_file_whose_variant_no_longer_adapts_a_kind(models, tmp_path, monkeypatch):
    import dataclasses

    import lora_func.io.native as native

    model = models["llama"]
    path = lf.save(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["embed_tokens"], r=2)), tmp_path / "a.safetensors")
    narrow = dataclasses.replace(lf.get_variant("lora"), kind_forms={"linear": None})
    monkeypatch.setattr(native, "get_variant", lambda name: narrow)
    with pytest.raises(ValueError, match=r"load\(.*\): variant 'lora' cannot adapt \['model.embed_tokens \(embedding\)'\]"):
        lf.load(path, model=model)


# ------------------------------------------------ LoHa / LoKr on conv kernels (issue 30)


class _Kernels(nn.Module):
    """A Conv3d (peft has no LyCORIS form for it; lora_func does), a Conv2d with a non-square
    kernel and a Conv1d, with channels that LoKr factors into W2's of more than 2r (W2 factored,
    so ``use_effective_conv2d`` gives its CP form)."""

    def __init__(self) -> None:
        super().__init__()
        self.vol = nn.Conv3d(24, 12, 2)
        self.grid = nn.Conv2d(24, 12, (2, 1), bias=False)
        self.seq = nn.Conv1d(12, 20, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.vol(x))  # (n, 12, 2, 2, 2)
        h = torch.tanh(self.grid(h.reshape(h.shape[0], 24, 2, 2)))  # (n, 12, 1, 2)
        return self.seq(h.flatten(2))  # (n, 20, 1)


def _kernel_delta(variant: str, p: dict, shape: tuple[int, ...], s: float) -> torch.Tensor:
    """peft's ΔW in the stored kernel's shape, written out from its layer code (a CP core's
    factors are lora_func's (d, r): peft's transposed)."""
    kernel = shape[2:]

    def cp(core, w_a, w_b):
        return torch.einsum("ij...,pi,jc->pc...", core.reshape(*core.shape[:2], *kernel), w_a, w_b)

    if variant == "loha":
        if "hada_t1" in p:
            return s * cp(p["hada_t1"], p["hada_w1_a"], p["hada_w1_b"]) * cp(p["hada_t2"], p["hada_w2_a"], p["hada_w2_b"])
        return s * ((p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"])).reshape(shape)
    w1 = p["lokr_w1"] if "lokr_w1" in p else p["lokr_w1_a"] @ p["lokr_w1_b"]
    if "lokr_t2" in p:
        w2 = cp(p["lokr_t2"], p["lokr_w2_a"], p["lokr_w2_b"])
    else:
        w2 = (p["lokr_w2"] if "lokr_w2" in p else p["lokr_w2_a"] @ p["lokr_w2_b"]).reshape(-1, shape[1] // w1.shape[1], *kernel)
    # copies in plain strides: torch.kron cannot view an einsum's size-1 axis of another stride
    plain = torch.contiguous_format
    return s * torch.kron(w1.reshape(*w1.shape, *[1] * len(kernel)).clone(memory_format=plain), w2.clone(memory_format=plain))


@pytest.mark.parametrize("effective", [False, True], ids=["flat", "cp"])
@pytest.mark.parametrize("variant", ["loha", "lokr"])
def test_lycoris_conv_kernels_follow_peft_s_formula_train_and_reload(variant, effective, tmp_path):
    """LoHa / LoKr on Conv1d/2d/3d: identity at init; after a perturbation every route (lazy and
    merged, overlay and module) gives the kernels of peft's formula, CP cores included; a few
    steps lower the loss; a native file reloads the same adapter (its kernels from the targets)."""
    torch.manual_seed(0)
    model = _Kernels().to(torch.float64)
    x = torch.randn(2, 24, 3, 3, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    spec = lf.AdapterSpec(variant, targets=["vol", "grid", "seq"], r=2, alpha=3.0, dtype=torch.float64, use_effective_conv2d=effective)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    assert ("hada_t1" if variant == "loha" else "lokr_t2") in str(adapter.params.keys()) if effective else "_t" not in str(adapter.params.keys())
    torch.testing.assert_close(lf.adapted_call(model, adapter, x), model(x), rtol=0, atol=1e-12)
    adapter = _perturbed(adapter, scale=0.5)
    base = lf.base_params(model)
    oracle = dict(base)
    for layer in adapter.layers:
        t = layer.target
        oracle[t.weight_key] = base[t.weight_key] + _kernel_delta(variant, adapter.layer_tensors(layer)[0], tuple(base[t.weight_key].shape), 1.5)
    want = torch.func.functional_call(model, oracle, (x,))
    assert (want - model(x)).abs().max() > 1e-2 * want.abs().max()
    for route in ("overlay", "module"):
        for merged in (False, True):
            got = lf.adapted_call(model, adapter, x, route=route, merged=merged)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{route} merged={merged}")

    def loss(params):
        return lf.adapted_call(model, adapter.with_params(params), x).square().mean()

    params = {k: v.detach() for k, v in adapter.params.items()}
    start = float(loss(params))
    for _ in range(5):
        grads = torch.func.grad(loss)(params)
        assert all(g.abs().max() > 0 for g in grads.values())
        params = {k: v - 0.05 * grads[k] for k, v in params.items()}
    assert float(loss(params)) < 0.9 * start
    loaded = lf.load(lf.save(adapter, tmp_path / "a.safetensors"), model=model)
    assert loaded.layers == adapter.layers and [layer.info.kernel for layer in loaded.layers] == [(2, 2, 2), (2, 1), (2,)]
    assert torch.equal(lf.adapted_call(model, loaded, x), lf.adapted_call(model, adapter, x))


def test_a_grouped_conv_is_adapted_in_its_grouped_kernel_or_refused_saying_why():
    model = nn.Sequential()
    model.add_module("depthwise", nn.Conv2d(4, 4, 3, groups=4))
    for variant in ("lora", "dora"):
        with pytest.raises(ValueError, match=r"depthwise \(grouped_conv\)'\]; .* a dense \(out, in, \*kernel\) update"):
            lf.init_adapter(model, lf.AdapterSpec(variant, targets=["depthwise"], r=2))
    for variant in ("loha", "lokr", "ia3"):
        adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=["depthwise"], r=2))
        assert adapter.layers[0].info.d_in == 9 and adapter.layers[0].info.kernel == (3, 3)  # (in / groups) · K


def test_the_kinds_table_in_docs_variants_is_the_registry_s():
    """docs/variants.md's table of the kinds each variant adapts is ``Variant.kinds``, row by row
    ("every other variant": the variants no row names)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "variants.md").read_text()
    lines = text[text.index("| variant | Linear | Conv1D |"):].splitlines()
    columns = {"Linear": "linear", "Conv1D": "conv1d", "Embedding": "embedding", "Conv1d/2d/3d": "conv",
               "grouped conv": "grouped_conv", "norm": "norm", "expert parameter": "experts", "2-D parameter": "parameter",
               "MultiheadAttention": "mha"}
    header = [cell.strip() for cell in lines[0].strip("|").split("|")][1:]
    assert {columns[h] for h in header} == set(KINDS)
    documented, rest = {}, None
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        kinds = {columns[h] for h, mark in zip(header, cells[1:], strict=True) if mark == "✓"}
        if cells[0] == "every other variant":
            rest = kinds
        for name in cells[0].replace("`", "").split(", ") if cells[0] != "every other variant" else ():
            documented[name] = kinds
    assert rest is not None
    for name in lf.list_variants():
        assert lf.get_variant(name).kinds == documented.get(name, rest), name
