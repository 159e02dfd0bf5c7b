"""PiSSA beyond the contract suite: the init against an independent float64 SVD and against
HF peft (full SVD bit for bit, ``pissa_niter_K`` by reconstruction quality), the randomized
SVD against ``torch.svd_lowrank``, the residual's dtype, the base fingerprint, bad input."""

from __future__ import annotations

import math

import pytest
import torch

import lora_func as lf
from lora_func.targeting import canonical_weight
from lora_func.variants.pissa import svd_lowrank
from tests.contract_helpers import assert_unchanged, snapshot
from tests.models import tiny_model, tokens
from tests.test_peft_oracle_lora import ALPHA, KINDS, PEFT_TARGETS, R, assert_matches_peft, make_peft, perturb_peft


def _weights(model, adapter: lf.Adapter) -> dict[str, torch.Tensor]:
    """Canonical (d_out, d_in) base weight of every target, by module name."""
    modules = dict(model.named_modules())
    return {
        layer.target.module: canonical_weight(modules[layer.target.module].weight.detach(), layer.target.layout)
        for layer in adapter.layers
    }


def _scale(alpha: float, r: int, rslora: bool) -> float:
    return alpha / (math.sqrt(r) if rslora else r)


@pytest.mark.parametrize("rslora", [False, True], ids=["lora-scale", "rslora-scale"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_init_against_float64_svd(kind, rslora):
    """s·B A is the top-r SVD part, W_res the rest; A, B split √(S_r/s) evenly (orthogonal
    rows of A, columns of B); W_res does not depend on alpha."""
    model = tiny_model(kind, seed=2)
    r, alpha = 3, 5.0
    s = _scale(alpha, r, rslora)
    spec = lf.AdapterSpec("pissa", targets=PEFT_TARGETS[kind], r=r, alpha=alpha, use_rslora=rslora)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    other_alpha = lf.init_adapter(model, lf.AdapterSpec("pissa", targets=PEFT_TARGETS[kind], r=r, alpha=1.0))
    for module, w in _weights(model, adapter).items():
        w64 = w.double()
        u, sv, vh = torch.linalg.svd(w64, full_matrices=False)
        top = u[:, :r] @ torch.diag(sv[:r]) @ vh[:r]
        a, b = adapter.params[f"{module}.lora_A"].double(), adapter.params[f"{module}.lora_B"].double()
        w_res = adapter.buffers[f"{module}.W_res"]
        assert w_res.dtype == torch.float32 and w_res.shape == w.shape, module
        # fp32 SVD round-off, ~eps / (relative singular gap ~2e-2): measured <= 7.1e-6 · max |W|;
        # a missing or wrong component (the 3rd, or the 3rd swapped with the 4th) is >= 0.3 · max |W|.
        atol = 2e-5 * w.abs().max()
        torch.testing.assert_close(s * b @ a, top, atol=atol, rtol=0, msg=module)
        torch.testing.assert_close(w_res.double(), w64 - top, atol=atol, rtol=0, msg=module)
        torch.testing.assert_close(a @ a.T, torch.diag(sv[:r] / s), atol=1e-6, rtol=1e-5, msg=module)
        torch.testing.assert_close(b.T @ b, torch.diag(sv[:r] / s), atol=1e-6, rtol=1e-5, msg=module)
        torch.testing.assert_close(other_alpha.buffers[f"{module}.W_res"], w_res, atol=1e-6, rtol=0, msg=module)


@pytest.mark.parametrize("kind", KINDS)
def test_full_svd_init_and_training_math_match_peft(kind):
    """Same A, B as peft's init_lora_weights="pissa", W_res equal to the base weight peft
    overwrote, then logits and gradients equal peft's after a random perturbation."""
    peft_model, lf_model = make_peft(kind, init_lora_weights="pissa")
    snap = snapshot(lf_model)
    spec = lf.AdapterSpec("pissa", targets=PEFT_TARGETS[kind], r=R, alpha=ALPHA)
    adapter = lf.init_adapter(lf_model, spec, generator=torch.Generator().manual_seed(0))
    peft_tensors = dict(peft_model.named_parameters())
    for layer in adapter.layers:
        module, layout = layer.target.module, layer.target.layout
        for name in ("lora_A", "lora_B"):
            ours = adapter.params[f"{module}.{name}"]
            torch.testing.assert_close(ours, peft_tensors[f"base_model.model.{module}.{name}.default.weight"], atol=1e-6, rtol=0)
        residual = canonical_weight(peft_tensors[f"base_model.model.{module}.base_layer.weight"].detach(), layout)
        torch.testing.assert_close(adapter.buffers[f"{module}.W_res"], residual, atol=1e-6, rtol=0, msg=module)
        assert (residual - _weights(lf_model, adapter)[module]).abs().max() > 1e-2, "peft should have residualised"
    perturb_peft(peft_model)
    assert_matches_peft(peft_model, lf_model, adapter)
    assert_unchanged(lf_model, snap)


@pytest.mark.parametrize("shape", [(20, 12), (12, 20)], ids=["tall", "wide"])
def test_randomized_svd_is_torch_svd_lowrank_with_the_generator(shape):
    """Same steps as torch.svd_lowrank, test matrix from the generator: bit-equal to torch's
    after torch.manual_seed(same seed), and the global RNG is left alone."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    state = torch.get_rng_state()
    ours = svd_lowrank(w, 4, 3, torch.Generator().manual_seed(123))
    assert torch.equal(torch.get_rng_state(), state), "svd_lowrank must not use the global RNG"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        theirs = torch.svd_lowrank(w, q=4, niter=3)
    for x, y in zip(ours, theirs, strict=True):
        assert torch.equal(x, y)
    other = svd_lowrank(w, 4, 3, torch.Generator().manual_seed(124))
    assert not torch.equal(other[0], ours[0]), "a different generator should give a different sketch"


def test_niter_init_is_the_generator_driven_svd_lowrank_in_target_order():
    """niter=K runs svd_lowrank(W, r, K) per target in adapter order, drawing from the one
    generator: replaying torch.svd_lowrank with the global RNG seeded alike reproduces it."""
    model = tiny_model("llama", seed=1)
    r, alpha, niter = 4, 6.0, 2
    s = alpha / r
    spec = lf.AdapterSpec("pissa", targets=["q_proj", "v_proj", "down_proj"], r=r, alpha=alpha, niter=niter)
    state = torch.get_rng_state()
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(77))
    assert torch.equal(torch.get_rng_state(), state), "init must not touch the global RNG"
    full = lf.init_adapter(model, lf.AdapterSpec("pissa", targets=["q_proj", "v_proj", "down_proj"], r=r, alpha=alpha))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(77)
        for module, w in _weights(model, adapter).items():
            u, sv, v = torch.svd_lowrank(w.float(), q=r, niter=niter)
            a = torch.diag(torch.sqrt(sv / s)) @ v.T
            b = u @ torch.diag(torch.sqrt(sv / s))
            torch.testing.assert_close(adapter.params[f"{module}.lora_A"], a, atol=1e-6, rtol=0, msg=module)
            torch.testing.assert_close(adapter.params[f"{module}.lora_B"], b, atol=1e-6, rtol=0, msg=module)
            torch.testing.assert_close(adapter.buffers[f"{module}.W_res"], w - s * b @ a, atol=1e-6, rtol=0, msg=module)
            assert not torch.allclose(adapter.params[f"{module}.lora_A"].abs(), full.params[f"{module}.lora_A"].abs(), atol=1e-6), (
                "niter>0 should not be the full SVD"
            )
    again = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(77))
    for key, value in {**adapter.params, **adapter.buffers}.items():
        assert torch.equal(again.params.get(key, again.buffers.get(key)), value), key


@pytest.mark.parametrize("kind", KINDS)
def test_niter_reconstruction_quality_matches_peft(kind):
    """pissa_niter_K vs peft's (global-RNG) one: not bit-equal, so compare what matters, the
    share of the optimal (full-SVD) top-r energy ‖W‖² − ‖W_res‖² that the sketch captures:
    >= 0.85 per layer and, averaged over layers, within 0.03 of peft's (the tiny models'
    spectra are flat, so K=4 gives ~0.91-0.99, K=1 ~0.74-0.90, a random subspace ~0.3).
    W_res + s·B A must reconstruct W."""
    niter = 4
    peft_model, lf_model = make_peft(kind, init_lora_weights=f"pissa_niter_{niter}")
    spec = lf.AdapterSpec("pissa", targets=PEFT_TARGETS[kind], r=R, alpha=ALPHA, niter=niter)
    adapter = lf.init_adapter(lf_model, spec, generator=torch.Generator().manual_seed(0))
    peft_tensors = dict(peft_model.named_parameters())
    s = ALPHA / R
    ours_share, peft_share = [], []
    for layer in adapter.layers:
        module = layer.target.module
        w = _weights(lf_model, adapter)[module]
        total = w.double().square().sum()
        optimum = torch.linalg.svdvals(w.double())[:R].square().sum()
        ours = adapter.buffers[f"{module}.W_res"]
        theirs = canonical_weight(peft_tensors[f"base_model.model.{module}.base_layer.weight"].detach(), layer.target.layout)
        ours_share.append(float((total - ours.double().square().sum()) / optimum))
        peft_share.append(float((total - theirs.double().square().sum()) / optimum))
        assert 0.85 <= ours_share[-1] <= 1 + 1e-6, (module, ours_share[-1])
        a, b = adapter.params[f"{module}.lora_A"], adapter.params[f"{module}.lora_B"]
        torch.testing.assert_close(ours + s * b @ a, w, atol=1e-6, rtol=0, msg=module)
    mean = sum(ours_share) / len(ours_share)
    assert abs(mean - sum(peft_share) / len(peft_share)) <= 0.03, (ours_share, peft_share)


def test_residual_is_kept_in_fp32_so_a_bf16_merge_is_exactly_the_base():
    """On a bf16 base, W_res stays fp32: W_res + s·B A rounds back to the bf16 W exactly
    (peft's bf16 residual is only identity to ~7e-2 on logits of max |logit| ~4)."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    adapter = lf.init_adapter(model, lf.AdapterSpec("pissa", targets=["q_proj", "v_proj"], r=4, alpha=6.0))
    base = lf.base_params(model)
    merged = lf.merge_overlay(base, adapter)
    for layer in adapter.layers:
        assert adapter.buffers[f"{layer.target.module}.W_res"].dtype == torch.float32
        key = layer.target.weight_key
        assert merged[key].dtype == torch.bfloat16 and torch.equal(merged[key], base[key]), key
    ids = tokens()
    reference = model(ids).logits
    assert torch.equal(lf.adapted_call(model, adapter, ids, merged=True).logits, reference)
    lazy = lf.adapted_call(model, adapter, ids).logits
    # the lazy form rounds x W_resᵀ and s (x Aᵀ) Bᵀ to bf16 separately: measured 0.019 · max |logit|;
    # dropping or double-counting the top-r part moves the logits by O(max |logit|).
    scale = reference.float().abs().max()
    assert lazy.dtype == torch.bfloat16 and (lazy.float() - reference.float()).abs().max() < 0.05 * scale


def test_reload_onto_a_different_base_is_refused(tmp_path):
    """The residual is only valid for the base it came from: load() checks the fingerprint."""
    model = tiny_model("gpt2")
    adapter = lf.init_adapter(model, lf.AdapterSpec("pissa", targets=["c_attn"], r=4))
    assert all(layer.base_fingerprint for layer in adapter.layers)
    path = lf.save(adapter, tmp_path / "pissa.safetensors")
    lf.load(path, model=tiny_model("gpt2"))  # same weights: fine
    changed = tiny_model("gpt2")
    with torch.no_grad():
        changed.transformer.h[1].attn.c_attn.weight[0, 0] += 1e-3
    with pytest.raises(ValueError, match="fingerprint"):
        lf.load(path, model=changed)


def _int8_llama():
    model = tiny_model("llama")
    q = model.model.layers[1].self_attn.q_proj
    q.weight = torch.nn.Parameter(torch.randint(-5, 5, q.weight.shape, dtype=torch.int8), requires_grad=False)
    return model


def test_non_float_base_is_refused_clearly():
    model = _int8_llama()
    snap = snapshot(model)
    with pytest.raises(TypeError, match=r"pissa needs a floating-point base weight.*torch\.int8.*dequantize"):
        lf.init_adapter(model, lf.AdapterSpec("pissa", targets=["q_proj"], r=4))
    assert_unchanged(model, snap)


def test_non_float_base_error_names_the_layer():
    with pytest.raises(TypeError, match=r"model\.layers\.1\.self_attn\.q_proj"):
        lf.init_adapter(_int8_llama(), lf.AdapterSpec("pissa", targets=["q_proj"], r=4))


def test_bad_niter_is_refused():
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match="niter"):
            lf.AdapterSpec("pissa", targets=["q_proj"], niter=bad)
    with pytest.raises(TypeError, match="niter"):
        lf.AdapterSpec("pissa", targets=["q_proj"], niter=True)
