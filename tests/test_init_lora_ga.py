"""LoRA-GA against peft 0.21 (preprocess_loraga + init_lora_weights="lora_ga") on an fp32 tiny Llama: the
calibration gradients equal peft's, the adapter equals peft's and the residual buffer equals peft's
modified base weight (peft's randomized SVD fed the generator's draws), the effective model at init
equals peft's modified base plus its adapter, relative 1e-6; save_peft writes a rank-2r LoRA that
peft loads onto the untouched base."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.config import LoraGAConfig
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.lora.loraga import preprocess_loraga

import lora_func as lf
from lora_func.calibration import layer_gradient_batches
from lora_func.targeting import find_targets
from tests.models import tiny_model, tokens

TARGETS = ["q_proj", "v_proj", "down_proj"]  # v_proj 32->16, down_proj 48->32
# peft counts backward passes with full backward hooks, which warn when no layer input needs a gradient.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
R, ALPHA = 4, 6.0
BATCHES = [tokens(2, 10, seed=30 + i) for i in range(3)]


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _peft(model, monkeypatch, seed, **ga):
    """peft's LoRA-GA, each layer's lora_ga_init drawing from one stream seeded with ``seed`` (the
    global RNG swapped in around it), as lora_func's init draws from one generator: get_peft_model's
    other draws (nn.Linear's inits) fall between the layers' and would shift peft's."""
    base = copy.deepcopy(model)
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights="lora_ga", lora_ga_config=LoraGAConfig(**ga))

    def train_step():
        for ids in BATCHES:
            base(input_ids=ids, labels=ids).loss.backward()

    preprocess_loraga(base, config, train_step)
    grads = {n: m._peft_loraga_grad.clone() for n, m in base.named_modules() if hasattr(m, "_peft_loraga_grad")}
    stream = torch.Generator().manual_seed(seed)
    original = LoraLayer.lora_ga_init

    def seeded(self, *args, **kwargs):
        saved = torch.get_rng_state()
        torch.set_rng_state(stream.get_state())
        try:
            original(self, *args, **kwargs)
        finally:
            stream.set_state(torch.get_rng_state())
            torch.set_rng_state(saved)

    monkeypatch.setattr(LoraLayer, "lora_ga_init", seeded)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        pm = get_peft_model(base, config).eval()
    layers = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules() if isinstance(m, LoraLayer)}
    return pm, grads, layers


def test_gradients_equal_peft(model, monkeypatch):
    _, grads, _ = _peft(model, monkeypatch, 0)
    targets = find_targets(model, lf.AdapterSpec("lora_ga", targets=TARGETS, r=R))
    ours = list(layer_gradient_batches(model, targets, [{"input_ids": ids} for ids in BATCHES]))
    assert len(ours) == 3 and sorted(grads) == sorted(ours[0])
    for name, grad in grads.items():
        assert _rel(sum(batch[name] for batch in ours) / 3, grad) <= 1e-6, name
    assert all(p.grad is None for p in model.parameters())  # nothing of the model written


@pytest.mark.parametrize(
    "ga", [{}, {"direction": "random", "scale": "weight_svd"}, {"direction": "ArBr", "scale": "gd_scale"}, {"direction": "A2rBr", "scale": "unit"}]
)
def test_adapter_and_effective_model_equal_peft(model, monkeypatch, ga):
    pm, _, layers = _peft(model, monkeypatch, 5, **ga)
    spec = lf.AdapterSpec("lora_ga", targets=TARGETS, r=R, alpha=ALPHA, **ga)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(5), calibration=[{"input_ids": ids} for ids in BATCHES])
    assert [layer.target.module for layer in adapter.layers] == list(layers)  # the draws' order
    for name, layer in layers.items():
        assert _rel(adapter.params[f"{name}.lora_A"], layer.lora_A["default"].weight) <= 1e-6, name
        assert _rel(adapter.params[f"{name}.lora_B"], layer.lora_B["default"].weight) <= 1e-6, name
        assert _rel(adapter.buffers[f"{name}.W_res"], layer.base_layer.weight) <= 1e-6, name
        assert not torch.equal(layer.base_layer.weight, model.get_submodule(name).weight)
    # W_res + s·B A cancels: round-off grows with |s·B A| / |W| (3.7 with scale="weight_svd", where
    # B A takes W's top singular value: 1.03e-6 measured there; 5.5e-7 with the default "stable").
    cancel = max(1.0, max(((ALPHA / R) * adapter.params[f"{n}.lora_B"] @ adapter.params[f"{n}.lora_A"]).abs().max().item()
                          / model.get_submodule(n).weight.abs().max().item() for n in layers))
    ids = tokens(2, 8, seed=4)
    want = pm(ids).logits
    assert _rel(lf.adapted_call(model, adapter, ids).logits, want) <= 1e-6 * cancel
    assert _rel(lf.adapted_call(model, adapter, ids, merged=True).logits, want) <= 5e-6 * cancel


def test_converted_checkpoint_loads_in_peft(model, tmp_path):
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora_ga", targets=TARGETS, r=R, alpha=ALPHA), calibration=[{"input_ids": ids} for ids in BATCHES])
    g = torch.Generator().manual_seed(2)
    trained = adapter.with_params({k: v.detach() + 0.05 * torch.randn(v.shape, generator=g) for k, v in adapter.params.items()})
    lf.save_peft(trained, tmp_path, model=model)
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        loaded = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path).eval()
    assert loaded.peft_config["default"].r == 2 * R
    ids = tokens(2, 8, seed=5)
    assert _rel(loaded(ids).logits, lf.adapted_call(model, trained, ids).logits) <= 1e-5


@pytest.mark.parametrize("scale", ["stable", "weight_svd", "gd_scale"])
def test_init_on_a_bf16_base_and_in_a_wider_adapter_dtype(scale):
    """On a bf16 weight the init is the one on its float32 value (the SVDs in fp32) with the factors
    rounded to bf16 before the residual is taken (peft's order), the residual's product in fp32; a
    float64 adapter on a float32 weight holds the float32 init's numbers in float64."""
    from lora_func.variants import get_variant
    from tests.variant_checks import layer_info

    ga, info = get_variant("lora_ga"), layer_info("lora_ga", 2, 8, 6, alpha=ALPHA, scale=scale)
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(6, 8, generator=g).to(torch.bfloat16).float()  # bf16 values: both weights the same numbers
    grad = torch.randn(6, 8, generator=g)

    def init(weight, dtype):
        return ga.init(weight, None, info, dtype=dtype, generator=torch.Generator().manual_seed(1), calibration=grad)

    (p16, b16), (p32, b32), (p64, b64) = init(w32.bfloat16(), torch.float32), init(w32, torch.float32), init(w32, torch.float64)
    for name in ("lora_A", "lora_B"):
        assert p16[name].dtype == torch.float32 and torch.equal(p16[name], p32[name].bfloat16().float()), name
        assert p64[name].dtype == torch.float64 and torch.equal(p64[name], p32[name].double()), name
    assert b16["W_res"].dtype == torch.float32 and torch.equal(b16["W_res"], w32 - (ALPHA / 2) * (p16["lora_B"] @ p16["lora_A"]))
    assert b64["W_res"].dtype == torch.float64 and torch.equal(b64["W_res"], b32["W_res"].double())


def test_weight_svd_scale_at_small_and_zero_gradients():
    """``scale="weight_svd"`` scales B to the weight's top singular value whatever the gradient's
    size: the init on ``1e-3·G`` (singular values below 1) equals the one on ``G`` (the ratio
    cancels); on a zero gradient (a target the loss does not reach) B stays zero, as peft's
    ``if S_B[0] > 0``, and ``W_res`` is the weight."""
    from lora_func.variants import get_variant
    from tests.variant_checks import layer_info

    ga, info = get_variant("lora_ga"), layer_info("lora_ga", 2, 8, 6, alpha=ALPHA, scale="weight_svd")
    g = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)

    def init(calibration):
        return ga.init(weight, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(1), calibration=calibration)

    (big, _), (small, _), (zero, zero_res) = init(grad), init(1e-3 * grad), init(torch.zeros(6, 8))
    assert torch.linalg.svdvals(1e-3 * grad).max() < 1
    for name in ("lora_A", "lora_B"):
        assert _rel(small[name], big[name]) <= 1e-5, name
    assert not zero["lora_B"].any() and zero["lora_A"].isfinite().all() and torch.equal(zero_res["W_res"], weight)
    # rank 1: B's one singular value is the one the scale divides by
    one = layer_info("lora_ga", 1, 8, 6, alpha=ALPHA, scale="weight_svd")
    (big, _), (small, _) = (ga.init(weight, None, one, dtype=torch.float32, generator=torch.Generator().manual_seed(1), calibration=c) for c in (grad, 1e-3 * grad))
    assert _rel(small["lora_B"], big["lora_B"]) <= 1e-5


def test_stable_gamma_below_one_is_accepted_and_scales_b():
    """``stable_gamma`` is any positive number (peft's LoraGAConfig takes any): 0.5 gives
    ``B = B_unit · d_out^¼ / √0.5``; 0 and negative values are refused, naming the option."""
    from lora_func.variants import get_variant
    from tests.variant_checks import layer_info

    lf.AdapterSpec("lora_ga", targets=TARGETS, r=R, stable_gamma=0.5)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="stable_gamma"):
            lf.AdapterSpec("lora_ga", targets=TARGETS, r=R, stable_gamma=bad)
    ga, g = get_variant("lora_ga"), torch.Generator().manual_seed(0)
    weight, grad = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    (stable, _), (unit, _) = (
        ga.init(weight, None, layer_info("lora_ga", 2, 8, 6, scale=scale, stable_gamma=0.5), dtype=torch.float64, generator=torch.Generator().manual_seed(1), calibration=grad)
        for scale in ("stable", "unit")
    )
    assert torch.equal(stable["lora_A"], unit["lora_A"]) and _rel(stable["lora_B"], unit["lora_B"] * (6**0.25 / 0.5**0.5)) <= 1e-6
