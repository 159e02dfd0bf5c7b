"""KaSA against peft 0.21 (LoraConfig(kasa_config=KasaConfig(...))) on a float64 tiny Llama (RMSNorm in
the input dtype on both sides): a peft checkpoint with perturbed trainables loads with load_peft (the
truncated base recomputed from the untouched base, as peft does on load) and gives peft's logits and
per-tensor gradients; kasa_penalty equals peft's _get_kasa_loss; save_peft output loads in peft;
init_adapter's truncated base and first draws equal peft's."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.config import KasaConfig

import lora_func as lf
from lora_func.variants import LayerInfo, get_variant
from tests import peft_helpers
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss
from tests.bank_oracle import rmsnorm_in_input_dtype

F64 = torch.float64
TARGETS = ["q_proj", "v_proj", "down_proj"]  # v_proj 32->16, down_proj 48->32
NAMES = ("lora_A", "lora_B", "lora_diag")
BETA, GAMMA = 0.05, 0.02




def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", dtype=F64)
    rmsnorm_in_input_dtype(m)
    return m


def _peft(model, **extra):
    config = LoraConfig(r=4, lora_alpha=6.0, target_modules=TARGETS, kasa_config=KasaConfig(beta=BETA, gamma=GAMMA), **extra)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        return get_peft_model(copy.deepcopy(model), config)


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
    """A peft KaSA model with every trainable perturbed, its checkpoint, and load_peft's adapter."""
    pm = _peft(model, use_rslora=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    path = tmp_path_factory.mktemp("kasa") / "peft"
    pm.save_pretrained(path)
    return pm, path, lf.load_peft(path, model)


def _peft_grads(pm) -> dict:
    return {peft_helpers.peft_key_to_lf(n, NAMES): p.grad for n, p in pm.named_parameters() if p.requires_grad}


def test_peft_checkpoint_gives_peft_logits_and_gradients(model, trained):
    pm, _, adapter = trained
    assert adapter.spec.variant == "kasa" and dict(adapter.spec.options) == {"beta": BETA, "dropout": 0.0, "gamma": GAMMA, "use_rslora": True}
    # The truncated base: peft's modified base weight is lora_func's buffer; lora_func's base is untouched.
    for name, layer in ((n.removeprefix("base_model.model."), m) for n, m in pm.named_modules() if hasattr(m, "lora_diag")):
        assert torch.equal(adapter.buffers[f"{name}.W_res"], layer.base_layer.weight), name
        assert not torch.equal(model.get_submodule(name).weight, layer.base_layer.weight)
    ids = tokens(2, 8, seed=4)
    for merged in (False, True):
        pm.zero_grad()
        out = pm(ids).logits
        ce_loss(out, ids).backward()
        want = _peft_grads(pm)
        params = {k: v.detach().requires_grad_(True) for k, v in adapter.params.items()}
        got = lf.adapted_call(model, adapter.with_params(params), ids, merged=merged).logits
        assert _rel(got, out) <= 1e-9, merged
        grads = torch.autograd.grad(ce_loss(got, ids), list(params.values()))
        assert sorted(want) == sorted(params)
        for key, grad in zip(params, grads, strict=True):
            assert want[key].abs().max() > 0, key
            assert _rel(grad, want[key]) <= 1e-9, (key, merged)


def test_kasa_penalty_equals_peft_get_kasa_loss(model, trained):
    pm, _, adapter = trained
    params = {k: v.detach().requires_grad_(True) for k, v in adapter.params.items()}
    got = lf.kasa_penalty(adapter.with_params(params))
    # An independent float64 formula, per layer: beta·Σd² + gamma·(‖BᵀB − I‖ + ‖AAᵀ − I‖).
    want = 0.0
    for layer in adapter.layers:
        a, b, d = (params[f"{layer.target.module}.{n}"] for n in NAMES)
        eye = torch.eye(4, dtype=F64)
        want = want + BETA * (d**2).sum() + GAMMA * (torch.sqrt(((b.T @ b - eye) ** 2).sum()) + torch.sqrt(((a @ a.T - eye) ** 2).sum()))
    assert got.dtype == F64 and abs(got.item() - want.item()) <= 1e-12 * want.item()
    torch.testing.assert_close(torch.autograd.grad(got, list(params.values())), torch.autograd.grad(want, list(params.values())), rtol=1e-12, atol=0)
    # peft computes its penalty in fp32 whatever the adapter dtype.
    assert abs(got.item() - pm.base_model._get_kasa_loss().item()) <= 1e-6 * got.item()
    with pytest.raises(ValueError, match="no kasa part"):
        lf.kasa_penalty(lf.init_adapter(model, lf.AdapterSpec("lora", targets=TARGETS, r=4)))


def test_save_peft_loads_in_peft(model, trained, tmp_path):
    pm, _, adapter = trained
    lf.save_peft(adapter, tmp_path)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        loaded = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path).eval()
    ids = tokens(2, 8, seed=5)
    assert loaded.peft_config["default"].kasa_config.gamma == GAMMA
    assert _rel(loaded(ids).logits, pm(ids).logits) <= 1e-12
    gpt2 = tiny_model("gpt2", dtype=F64)
    with pytest.raises(ValueError, match="Conv1D"):
        lf.save_peft(lf.init_adapter(gpt2, lf.AdapterSpec("kasa", targets=["c_attn"], r=4)), tmp_path / "gpt2")


def test_init_equals_peft():
    """On an fp32 Llama: the truncated base bit for bit (the same fp32 SVD); A and ΔΣ drawn as peft
    draws them (kaiming A, then randn ΔΣ, in fp32) from a generator seeded as peft's global RNG; B = 0;
    the model at init equals peft's (its truncated base)."""
    model = tiny_model("llama")
    pm = _peft(model).eval()
    for name, layer in ((n.removeprefix("base_model.model."), m) for n, m in pm.named_modules() if hasattr(m, "lora_diag")):
        weight = model.get_submodule(name).weight
        info = LayerInfo(d_in=weight.shape[1], d_out=weight.shape[0], r=4, alpha=6.0, has_bias=False,
                         options=(("beta", BETA), ("dropout", 0.0), ("gamma", GAMMA), ("use_rslora", False)))
        params, buffers = get_variant("kasa").init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(9))
        assert torch.equal(buffers["W_res"], layer.base_layer.weight), name
        torch.manual_seed(9)
        layer.reset_lora_parameters("default", True)  # peft's A init
        assert torch.equal(params["lora_A"], layer.lora_A["default"].weight), name
        assert torch.equal(params["lora_diag"], torch.randn(4)), name  # KasaLinearVariant.init's next draw
        assert not params["lora_B"].any()
    adapter = lf.init_adapter(model, lf.AdapterSpec("kasa", targets=TARGETS, r=4, alpha=6.0))
    ids = tokens(2, 8, seed=6)
    assert _rel(lf.adapted_call(model, adapter, ids).logits, pm(ids).logits) <= 1e-6
    with pytest.raises(ValueError, match="smaller than min"):
        lf.init_adapter(model, lf.AdapterSpec("kasa", targets=["v_proj"], r=16))


def test_init_on_a_bf16_base_and_in_a_wider_adapter_dtype():
    """A bf16 base with a float32 adapter: ``W_res`` is peft's truncation rounded to the base's
    bf16 (``_truncate_base_weight`` writes it into the bf16 weight), held in float32. A float64
    adapter on a float32 base: every tensor in float64, the float32 draws widened exactly."""
    from peft.tuners.lora.variants import KasaLinearVariant

    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(12, 8, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(8, 12, generator=g))
    info = LayerInfo(d_in=12, d_out=8, r=3, alpha=6.0, has_bias=False, options=(("beta", BETA), ("dropout", 0.0), ("gamma", GAMMA), ("use_rslora", False)))
    kasa = get_variant("kasa")
    _, buffers = kasa.init(linear.weight.detach().clone(), None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(1))

    class _Layer:  # peft's tuner layer, as far as _truncate_base_weight reads it
        def get_base_layer(self):
            return linear

    KasaLinearVariant._truncate_base_weight(_Layer(), 3)
    assert buffers["W_res"].dtype == torch.float32 and torch.equal(buffers["W_res"], linear.weight.float())

    weight = torch.randn(8, 12, generator=g)
    p32, b32 = kasa.init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
    p64, b64 = kasa.init(weight, None, info, dtype=F64, generator=torch.Generator().manual_seed(2))
    for name in NAMES:
        assert p64[name].dtype == F64 and torch.equal(p64[name], p32[name].double()), name
    assert b64["W_res"].dtype == F64 and torch.equal(b64["W_res"], b32["W_res"].double())
