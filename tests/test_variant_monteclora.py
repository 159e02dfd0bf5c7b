"""MonteCLoRA against peft 0.21 (``LoraConfig(monteclora_config=MontecloraConfig(...))``) on a float64
tiny Llama in training mode. peft pre-draws its noise in bulk at construction, so the oracle feeds
peft's samplers the draws lora_func's forward made (recorded, in the layers' order); peft computes
its two Cholesky factors in fp32, so the oracle is peft's sampler with those two methods computing
in the input dtype (copied below with the casts removed). A peft checkpoint with perturbed
trainables loads with load_peft; a training step gives peft's logits and per-tensor gradients (the
sampler's priors included), and the penalty of those draws peft's ``_get_monteclora_loss`` and its
gradients; outside training it is LoRA; save_peft output loads in peft; the init draws peft's
numbers; vmap follows ``randomness=`` as dropout does."""

from __future__ import annotations

import json

import pytest
import torch
from peft.tuners.lora.config import MontecloraConfig
from peft.tuners.lora.monteclora import MontecloraSampler
from peft.tuners.lora.variants import MontecloraLinearVariant

import lora_func as lf
from lora_func.variants import LayerInfo, monteclora
from tests.lora_family_oracle import ALPHA, R, TARGETS, lf_name, model64, peft_lora, reloaded_in_peft, rel, saved
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

CONFIG = {"num_samples": 3, "buffer_size": 2, "use_entropy": True, "sample_scaler": 0.5, "kl_loss_weight": 0.01, "dirichlet_prior": 0.25}  # exact in fp32 (peft holds it as an fp32 tensor)


def _multivariate_in_input_dtype(self, z_mvn, cov_matrix):
    # peft's multivariate_reparameterization without its fp32 cast of the Cholesky input
    varsum = torch.einsum("eio,op->eip", z_mvn, torch.linalg.cholesky(cov_matrix))
    return self.sample_scaler * torch.nan_to_num(varsum, nan=1e-3)


def _dirichlet_in_input_dtype(self, alpha, z_dirichlet):
    # peft's dirichlet_reparameterization without its fp32 cast of the Cholesky input
    eps = 1e-6
    alpha = torch.clamp(alpha, min=eps)
    mu = torch.log(alpha) - torch.log(alpha).mean()
    diag_term = 1 / alpha * (1 - 2 / self.num_samples) + 1 / (self.num_samples**2) * (1 / alpha).sum()
    sigma = torch.diag(torch.clamp(diag_term, min=eps)) + eps * torch.eye(len(alpha), device=alpha.device)
    return torch.linalg.cholesky(sigma) @ z_dirichlet + mu


@pytest.fixture(scope="module")
def model():
    return model64()


def _recorded(monkeypatch):
    """lora_func's draws, recorded in call order."""
    draws, draw = [], monteclora.draw

    def recording(*args, **kwargs):
        draws.append(draw(*args, **kwargs))
        return draws[-1]

    monkeypatch.setattr(monteclora, "draw", recording)
    return draws


def _feed(pm, draws, monkeypatch):
    """peft's samplers take ``draws`` in order (z_wishart as the diagonal matrix of χ: peft reads
    only its diagonal) and compute in the input dtype."""
    monkeypatch.setattr(MontecloraSampler, "multivariate_reparameterization", _multivariate_in_input_dtype)
    monkeypatch.setattr(MontecloraSampler, "dirichlet_reparameterization", _dirichlet_in_input_dtype)
    queue = list(draws)
    for module in pm.modules():
        if isinstance(module, MontecloraSampler):
            module.sampler.get = lambda: (lambda z, chi, zeta: {"z_mvn": z, "z_wishart": torch.diag(chi), "z_dirichlet": zeta})(*queue.pop(0))
    return queue


def test_a_training_step_and_the_penalty_equal_peft_s_with_the_same_draws(model, tmp_path, monkeypatch):
    pm = peft_lora(model, monteclora_config=MontecloraConfig(**CONFIG), use_rslora=True)
    adapter = saved(pm, tmp_path / "peft", model)
    assert adapter.spec.variant == "monteclora" and adapter.spec.option("num_samples") == 3
    assert {k.rsplit(".", 1)[-1] for k in adapter.buffers} == {"monteclora_gaussian_var_prior", "monteclora_expert_weights"}
    ids = tokens(2, 9, seed=3)
    draws = _recorded(monkeypatch)
    pm.train(), model.train()
    try:
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        ours = adapter.with_params(params)
        got = lf.adapted_call(model, ours, ids).logits
        assert len(draws) == 4  # one per layer: q and v of two blocks
        left = _feed(pm, draws, monkeypatch)
        want = pm(input_ids=ids).logits
        assert left == [] and rel(got, want) < 1e-9
        assert (got - lf.adapted_call(model, ours.with_params(params), ids, merged=True).logits).abs().max() > 1e-3, "sampling moves the output"
        # the penalty of these draws (peft keeps the last forward's variances and weights)
        layers = {layer.target.module: layer for layer in ours.layers}
        chis = dict(zip(layers, (d[1] for d in draws), strict=True))
        zetas = dict(zip(layers, (d[2] for d in draws), strict=True))
        penalty = torch.stack([monteclora.layer_penalty(ours.layer_tensors(layer)[0], layer.info, chis[m], zetas[m]) for m, layer in layers.items()]).mean()
        theirs = pm.base_model._get_monteclora_loss()
        assert rel(penalty, theirs) < 1e-9
        (ce_loss(want, ids) + theirs).backward()
        expected = {lf_name(n): p.grad for n, p in pm.named_parameters() if p.requires_grad}
        grads = torch.autograd.grad(ce_loss(got, ids) + penalty, list(params.values()))
        assert sorted(expected) == sorted(params)
        for key, grad in zip(params, grads, strict=True):
            assert expected[key].abs().max() > 0, key
            assert rel(grad, expected[key]) < 1e-9, key
        # outside training: LoRA (lazy = merged), no draws
        model.eval()
        before = len(draws)
        lazy = lf.adapted_call(model, ours, ids).logits
        assert len(draws) == before
        torch.testing.assert_close(lazy, lf.adapted_call(model, ours, ids, merged=True).logits, atol=1e-12, rtol=0)
        # the penalty with its own draws: finite, a differentiable function of the priors
        grads = torch.autograd.grad(monteclora.penalty(ours), [params[k] for k in params if "monteclora" in k])
        assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in grads)
    finally:
        pm.eval(), model.eval()


def test_save_peft_loads_in_peft(model, tmp_path):
    pm = peft_lora(model, monteclora_config=MontecloraConfig(**CONFIG))
    adapter = saved(pm, tmp_path / "peft", model)
    lf.save_peft(adapter, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert {k: v for k, v in config["monteclora_config"].items()} == {k: v for k, v in CONFIG.items() if k != "buffer_size"}
    loaded = reloaded_in_peft(model, tmp_path / "ours")
    ids = tokens(2, 8, seed=5)
    with torch.no_grad():
        assert rel(loaded(ids).logits, pm(ids).logits) <= 1e-12
    sampler = loaded.base_model.model.model.layers[1].self_attn.v_proj.lora_monteclora_sampler["default"]
    assert torch.equal(sampler.std_prior, adapter.params["model.layers.1.self_attn.v_proj.monteclora_std_prior"])


def test_init_draws_peft_s_numbers():
    model = tiny_model("llama")
    pm = peft_lora(model, perturbed=False)
    config = pm.peft_config["default"]
    config.monteclora_config = MontecloraConfig(num_samples=3, buffer_size=1)
    spec = lf.AdapterSpec("monteclora", targets=TARGETS, r=R, alpha=ALPHA, num_samples=3)
    for name, module in pm.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            weight = model.get_submodule(name.removeprefix("base_model.model.")).weight
            info = LayerInfo(d_in=weight.shape[1], d_out=weight.shape[0], r=R, alpha=ALPHA, has_bias=True, options=spec.options)
            params, buffers = lf.get_variant("monteclora").init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(9))
            torch.manual_seed(9)
            module.reset_lora_parameters("default", True)
            MontecloraLinearVariant.init(module, "default", config)
            sampler = module.lora_monteclora_sampler["default"]
            assert torch.equal(params["lora_A"], module.lora_A["default"].weight), name
            assert torch.equal(params["monteclora_std_prior"], sampler.std_prior), name
            assert torch.equal(params["monteclora_expert_weights_prior"], sampler.expert_weights_prior), name
            assert torch.equal(buffers["monteclora_gaussian_var_prior"], sampler.gaussian_var_prior)
            assert torch.equal(buffers["monteclora_expert_weights"], sampler.expert_weights)


def test_vmap_follows_randomness_as_dropout():
    model = tiny_model("llama").train()
    adapter = lf.init_adapter(model, lf.AdapterSpec("monteclora", targets=TARGETS, r=R, num_samples=3, sample_scaler=1.0))
    adapter = adapter.with_params({k: v.detach() + 0.3 for k, v in adapter.params.items()})
    stacked, ids = lf.stack([adapter, adapter]), tokens()

    def run(a):
        return lf.adapted_call(model, a, ids).logits

    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(run)(stacked)
    different = torch.func.vmap(run, randomness="different")(stacked)
    assert (different[0] - different[1]).abs().max() > 1e-3
    same = torch.func.vmap(run, randomness="same")(stacked)
    torch.testing.assert_close(same[0], same[1], atol=1e-5, rtol=0)
    model.eval()
    torch.func.vmap(run)(stacked)  # no draws outside training


def test_the_sampler_s_floors_are_peft_s():
    """The variances' floor (1e-3) and the mixture's (α ≥ 1e-6) at priors that reach them, against
    peft's wishart and dirichlet reparameterizations (the latter in the input dtype, as above)."""
    from types import SimpleNamespace

    std_prior = torch.tensor([-6.0, 0.0, 0.5, -3.5], dtype=torch.float64)
    chi = torch.tensor([0.5, 2.0, 1.0, 0.7], dtype=torch.float64)
    want = MontecloraSampler.wishart_reparameterization(None, torch.diag(std_prior.exp()), torch.diag(chi)).diag()
    got = monteclora.variances(std_prior, chi)
    assert (got == 1e-3).sum() == 2 and torch.equal(got, want)
    zeta = torch.tensor([0.4, -1.1, 0.8], dtype=torch.float64)
    # α floored at 1e-6 (tiny priors), the spread floored at 1e-6 (large priors: 1/α ≈ 1e-6)
    for expert_prior in ([-20.0, -14.5, 0.3], [14.0, 13.5, 15.0]):
        expert_prior = torch.tensor(expert_prior, dtype=torch.float64)
        logits = _dirichlet_in_input_dtype(SimpleNamespace(num_samples=3), expert_prior.exp(), zeta)
        torch.testing.assert_close(monteclora.mixture_weights(expert_prior, zeta), torch.softmax(logits, -1), rtol=1e-9, atol=0)  # relative: the floored weights are tiny


def test_init_gives_the_asked_dtype():
    from tests.variant_checks import init_params

    params, buffers = init_params(monteclora, "monteclora", 2, 6, 4, num_samples=3)
    assert {k: tuple(v.shape) for k, v in params.items() if k.startswith("monteclora")} == {"monteclora_std_prior": (2,), "monteclora_expert_weights_prior": (3,)}


def test_a_bf16_adapter_s_training_step_runs_in_bf16():
    """A bf16 adapter on a float32 layer in a training step: the sampled A stays bf16 (the square
    roots in fp32, cast back), the step runs and every trainable gets a bf16 gradient."""
    from tests.one_layer import one_layer

    model = one_layer("linear", 6, 4, True, torch.float32, 0).train()
    spec = lf.AdapterSpec("monteclora", ["proj"], r=2, num_samples=3, dtype=torch.bfloat16)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    params = {k.rsplit(".", 1)[-1]: v for k, v in adapter.params.items()}
    torch.manual_seed(0)
    assert monteclora.sampled_a(params, adapter.layers[0].info).dtype == torch.bfloat16
    torch.manual_seed(0)
    out = lf.adapted_call(model, adapter, x=x)
    grads = torch.autograd.grad(out.square().sum(), list(adapter.params.values()))
    assert out.dtype == torch.float32 and all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


def test_one_sample_is_accepted_as_peft_accepts_it():
    """peft's MontecloraConfig takes num_samples >= 1: one sample is one perturbation of A (its
    mixture weight 1), zero is refused."""
    with pytest.raises(ValueError, match="num_samples"):
        lf.AdapterSpec("monteclora", ["proj"], num_samples=0)
    MontecloraConfig(num_samples=1)
    zeta = torch.tensor([0.7], dtype=torch.float64)
    assert torch.equal(monteclora.mixture_weights(torch.tensor([0.3], dtype=torch.float64), zeta), torch.ones(1, dtype=torch.float64))
    lf.AdapterSpec("monteclora", ["proj"], num_samples=1)
