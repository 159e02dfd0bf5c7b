"""LoKr beyond tests/test_variants_structured_a.py and tests/test_kinds_peft.py (peft oracles,
base and adapter in one dtype): an adapter in another dtype than its base on both forms of
the activation path (the Kronecker product on the activations and the dense update that many
rows on a small layer take), rank dropout in training on each, a rank-padded stack with both factors decomposed, and peft's
config checks. Written to kill mutants
(tools/mutate.py)."""

from __future__ import annotations

import peft
import pytest
import torch

import lora_func as lf
from tests.one_layer import one_layer, perturbed, run
from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype, saved_bytes


@pytest.mark.parametrize(("rows", "options"), [
    (3, {}),  # 3 rows · m=2 · k=4 < 8 · 8: the Kronecker identity on the activations
    (8, {}),  # 8 · 2 · 4 >= 8 · 8: the dense update
    (8, {"decompose_both": True, "decompose_factor": 4, "r": 1}),  # W1 and W2 factored, dense
    (3, {"decompose_both": True, "decompose_factor": 4, "r": 1}),
])
def test_an_adapter_in_another_dtype_than_the_base_on_each_activation_form(rows, options):
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("lokr", 8, 8, adapter_dtype=dtype, rows=rows, **{"r": 2, "alpha": 3.0, "init": "random", **options})


def test_peft_config_checks():
    assert_config_checks("lokr", peft.LoKrConfig, {
        "rank_dropout": [-0.1, 1.0, float("nan")], "module_dropout": [-0.1, 1.0], "use_effective_conv2d": [1],
        "init_weights": [1, "loha", None], "decompose_both": [1, "no"], "decompose_factor": [0, -2, 1.5, True],
        "rank_dropout_scale": [1, None],
    }, good={"decompose_factor": [-1, 1, 7], "init_weights": [True, False, "lycoris"], "rank_dropout": [0.0, 0.99]})


@pytest.mark.parametrize("rows", [3, 8])
@pytest.mark.parametrize(("base_dtype", "adapter_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_rank_dropout_in_training_with_the_adapter_in_another_dtype_on_each_form(rows, base_dtype, adapter_dtype):
    # rank dropout scales the update's output rows (peft's draw, from the global generator):
    # on the Kronecker form (3 rows) and the dense update (8 rows) the output keeps the base's
    # dtype and equals the float64 model under the same draw
    model = one_layer("linear", 8, 8, True, torch.float32, 0)
    spec = dict(targets=["proj"], r=2, alpha=3.0, init="random", rank_dropout=0.5, rank_dropout_scale=True)
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("lokr", **spec, dtype=adapter_dtype), generator=torch.Generator().manual_seed(1)), seed=2)
    model64 = one_layer("linear", 8, 8, True, torch.float32, 0).to(torch.float64).train()
    low = model.to(base_dtype).train()
    model64.load_state_dict({k: v.to(torch.float64) for k, v in low.state_dict().items()})
    adapter64 = lf.init_adapter(model64, lf.AdapterSpec("lokr", **spec, dtype=torch.float64)).with_params(
        {k: v.detach().to(torch.float64) for k, v in adapter.params.items()}
    )
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        outs, wants = [], []
        for seed in (0, 1):
            torch.manual_seed(seed)
            outs.append(lf.adapted_call(low, adapter, x=x.to(base_dtype)))
            torch.manual_seed(seed)
            wants.append(lf.adapted_call(model64, adapter64, x=x.double()))
        plain = lf.adapted_call(model64.eval(), adapter64, x=x.double())
    for got, want in zip(outs, wants, strict=True):
        assert got.dtype == base_dtype
        scale = float(want.abs().max())
        assert float((got.double() - want).abs().max()) <= 2e-2 * scale
    assert float((wants[0] - plain).abs().max()) > 0.1 * float(plain.abs().max()), "the dropout must act"
    assert not torch.equal(wants[0], wants[1]), "each seed draws its own rows"


def test_a_rank_padded_stack_with_both_factors_decomposed_equals_each_member_alone():
    # 256 = 16 · 16 on both sides (decompose_factor=16): W1 = W1a W1b and W2 = W2a W2b for every
    # r < 8, so each of the four factors is padded along its own rank axis
    model = one_layer("linear", 256, 256, True, torch.float64, 0)
    base = lf.base_params(model)
    members = []
    for i, r in enumerate((2, 3, 5)):
        spec = lf.AdapterSpec("lokr", targets=["proj"], r=r, alpha=2.0 + i, init="random", decompose_both=True, decompose_factor=16, dtype=torch.float64)
        members.append(perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(i)), seed=10 + i, scale=0.1))
    assert all(sorted(m.params) == ["proj.lokr_w1_a", "proj.lokr_w1_b", "proj.lokr_w2_a", "proj.lokr_w2_b"] for m in members)
    stacked = lf.stack(members)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for overlay in (lf.overlay, lf.merge_overlay):
        def loss(adapter, overlay=overlay):
            return run(model, overlay(base, adapter), x).sin().sum()

        def value_and_grad(adapter, loss=loss):
            return torch.func.grad_and_value(lambda p: loss(adapter.with_params(p)))(adapter.params)

        grads, values = torch.func.vmap(value_and_grad)(stacked)
        values = values.detach()
        for k, member in enumerate(members):
            g_alone, v_alone = value_and_grad(member)
            assert abs(float(values[k] - v_alone.detach())) <= 1e-12 * abs(float(v_alone.detach())) + 1e-12
            trimmed = lf.unstack(stacked.with_params(grads))[k]
            for key, g in g_alone.items():
                got, want = trimmed.params[key].detach(), g.detach()
                assert float((got - want).abs().max()) <= 1e-10 * float(want.abs().max()), (overlay.__name__, k, key)
    assert len({round(float(v), 6) for v in values}) == 3


def test_few_rows_take_the_kronecker_form_and_keep_less_than_the_dense_update():
    # 64 -> 64 (8 x 8 Kronecker factors, W2 = W2a W2b at r=2): over the base layer's own, 4 rows
    # keep (4, 8, 8) intermediates where the dense update alone would keep 64 x 64 values; 256
    # rows take the dense one
    model = one_layer("linear", 64, 64, True, torch.float32, 0)
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("lokr", targets=["proj"], r=2, init="random")), seed=1)
    dense_update = 64 * 64 * 4
    for rows, form_bytes in ((4, lambda b: b < dense_update / 2), (256, lambda b: b >= dense_update)):
        # x needs a gradient, as every layer's input past the first does: backward to x needs
        # the whole update on the dense form
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
        saved = saved_bytes(lambda x=x: lf.adapted_call(model, adapter, x=x).sum()) - saved_bytes(lambda x=x: model(x=x).sum())
        assert form_bytes(saved), (rows, saved)
