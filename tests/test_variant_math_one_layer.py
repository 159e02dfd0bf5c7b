"""Fast, exact checks of every variant's math on one layer, written to kill mutants.

tools/mutate.py runs this file first for every mutant (``-k <variant>``), so each test is cheap
(a one-layer model, float64 wherever the math allows tight tolerances) and compares against an
independent oracle: the row's explicit ``W_eff`` formula (tests/variant_rows) for outputs, and
autograd through that formula for gradients (with DoRA's norm detached, as the paper's §4.3).
Every test id starts with the variant name, so ``-k dora`` selects DoRA's.

The targeted tests at the end each kill a mutant that survived the general checks; their
docstrings name the mutant (see docs/testing.md).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

import lora_func as lf
from lora_func.variants import LayerInfo
from lora_func.targeting import canonical_weight
from lora_func.variants.antipasto import with_steering
from tests.one_layer import calibration, one_layer, oracle_forms, perturbed, run
from tests.variant_table import ROWS

# (variant, spec kwargs) per configuration; non-default alpha/options so a form that ignores them fails.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "lora": ("lora", {"r": 3, "alpha": 6.0}),
    "lora-rslora": ("lora", {"r": 3, "alpha": 6.0, "use_rslora": True}),
    "lora-gaussian": ("lora", {"r": 2, "alpha": 5.0, "init": "gaussian"}),
    "dora": ("dora", {"r": 3, "alpha": 6.0}),
    "dora-rslora": ("dora", {"r": 2, "alpha": 3.0, "use_rslora": True}),
    "pissa": ("pissa", {"r": 3, "alpha": 6.0}),
    "pissa-niter": ("pissa", {"r": 2, "alpha": 4.0, "niter": 2, "use_rslora": True}),
    "delora": ("delora", {"r": 3, "lambda0": 3.0}),
    "hra": ("hra", {"r": 4}),
    "hra-random": ("hra", {"r": 3, "init": "random"}),
    "antipasto": ("antipasto", {"r": 3, "rotate_u": True, "steer": -1.3, "max_rotation_angle": 2.0}),
    "antipasto-noclamp": ("antipasto", {"r": 2, "steer": 0.7, "max_rotation_angle": math.inf}),
    "ia3": ("ia3", {}),
    "ia3_ff": ("ia3_ff", {}),
    "eva": ("eva", {"r": 2, "alpha": 6.0, "rho": 1.0}),
    "eva-whiten": ("eva", {"r": 2, "alpha": 3.0, "rho": 1.0, "whiten": True, "use_rslora": True}),
}
LAYOUTS = {"linear": True, "linear_nobias": False, "conv1d": True}
D_IN, D_OUT = 6, 5  # non-square: a transposed weight or a swapped axis fails
CASES = [pytest.param(name, layout, id=f"{name}-{layout}") for name in CONFIGS for layout in LAYOUTS]


def build(name: str, layout: str, *, dtype: torch.dtype = torch.float64, adapter_dtype: torch.dtype = torch.float64, seed: int = 0):
    variant, kwargs = CONFIGS[name]
    model = one_layer(layout.split("_")[0], D_IN, D_OUT, LAYOUTS[layout], dtype, seed)
    spec = lf.AdapterSpec(variant, targets=["proj"], dtype=adapter_dtype, **kwargs)
    adapter = lf.init_adapter(
        model, spec, generator=torch.Generator().manual_seed(seed + 1), calibration=calibration(seed) if variant == "eva" else None
    )
    return model, adapter


def inputs(dtype: torch.dtype = torch.float64, seed: int = 5) -> Tensor:
    return torch.randn(2, 3, D_IN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _dora_detached(p, b, W, bias, info):
    # DoRA with the row norm treated as a constant for gradients (paper §4.3, peft, NVlabs)
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    V = W + s * p["lora_B"] @ p["lora_A"]
    return p["lora_magnitude_vector"][:, None] / V.norm(dim=1, keepdim=True).detach() * V, bias


def _delora_buffer_norm(p, b, W, bias, info):
    # DeLoRA's formula with the frozen column norms read from the buffer: they are computed in
    # fp32 at init (checked against W in test_delora_w_norm_buffer), so a float64 check of the
    # forms must take them as given.
    A, B, lam = p["delora_A"], p["delora_B"], p["delora_lambda"]
    a = torch.clamp(torch.sqrt((A * A).sum(dim=1)), min=1e-4)
    bn = torch.clamp(torch.sqrt((B * B).sum(dim=0)), min=1e-4)
    return W + (lam / A.shape[0]) * B @ torch.diag(1.0 / (a * bn)) @ A @ torch.diag(b["delora_w_norm"]), bias


def killer_oracle(variant: str):
    """The row's explicit formula, with the two adjustments above."""
    return {"dora": _dora_detached, "delora": _delora_buffer_norm}.get(variant, ROWS[variant].w_eff)


def oracle_out(model, adapter, x: Tensor, p: dict[str, Tensor] | None = None, w_eff_fn=None) -> Tensor:
    w_eff, b_eff = oracle_forms(model, adapter, p, w_eff_fn or killer_oracle(adapter.spec.variant))
    y = x.double() @ w_eff.T
    return y if b_eff is None else y + b_eff


OVERLAYS = (("merged", lf.merge_overlay), ("lazy", lf.overlay))


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_outputs_match_the_oracle_in_float64(name, layout):
    model, adapter = build(name, layout)
    adapter = perturbed(adapter, seed=7)
    x, base = inputs(), lf.base_params(model)
    want = oracle_out(model, adapter, x)
    assert (want - run(model, base, x)).abs().max() > 1e-2, "the perturbed adapter must move the output"
    for overlay_name, make in OVERLAYS:
        got = run(model, make(base, adapter), x)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=f"{overlay_name}")


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_merged_bias_entry(name, layout):
    """The merged overlay's bias entry: ``b_eff`` for IA3, the base's own tensor object otherwise."""
    model, adapter = build(name, layout)
    adapter = perturbed(adapter, seed=7)
    base = lf.base_params(model)
    merged = lf.merge_overlay(base, adapter)
    if "proj.bias" not in base:
        return
    _, b_eff = killer_oracle(adapter.spec.variant)(
        {k.removeprefix("proj."): v.detach().double() for k, v in adapter.params.items()},
        {k.removeprefix("proj."): v.detach().double() for k, v in adapter.buffers.items()},
        canonical_weight(base["proj.weight"], adapter.layers[0].target.layout).double(),
        base["proj.bias"].double(),
        adapter.layers[0].info,
    )
    if lf.get_variant(adapter.spec.variant).changes_bias:
        torch.testing.assert_close(merged["proj.bias"], b_eff, atol=1e-12, rtol=1e-12)
    else:
        assert merged["proj.bias"] is base["proj.bias"]
    lazy = lf.overlay(base, adapter)
    if lf.get_variant(adapter.spec.variant).changes_bias:
        # A bias stand-in: the base bias inside the layer's op, b_eff in any other op.
        assert lazy["proj.bias"]._weight is base["proj.bias"], "the lazy bias stand-in holds the base bias"
        torch.testing.assert_close(lazy["proj.bias"].merged(), merged["proj.bias"], atol=0, rtol=0)
    else:
        assert lazy["proj.bias"] is base["proj.bias"], "the lazy path reads the base bias as the model passes it"
    assert all(merged[k] is base[k] for k in base if k not in ("proj.weight", "proj.bias")), "untargeted entries are the base's"


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_gradients_match_autograd_through_the_oracle(name, layout):
    model, adapter = build(name, layout)
    adapter = perturbed(adapter, seed=7)
    x, base = inputs(), lf.base_params(model)
    target = torch.randn(2, 3, D_OUT, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    p64 = {k.removeprefix("proj."): v.detach().double().requires_grad_(True) for k, v in adapter.params.items()}
    loss = ((oracle_out(model, adapter, x, p64) - target) ** 2).sum()
    want = dict(zip(p64, torch.autograd.grad(loss, list(p64.values())), strict=True))
    for overlay_name, make in OVERLAYS:
        grads = torch.func.grad(lambda p, make=make: ((run(model, make(base, adapter.with_params(p)), x) - target) ** 2).sum())(adapter.params)
        for key, g in grads.items():
            short = key.removeprefix("proj.")
            torch.testing.assert_close(g, want[short], atol=1e-9 * max(1.0, float(want[short].abs().max())), rtol=1e-9, msg=f"{overlay_name} {key}")


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_bf16_base_fp32_adapter_dtype_policy(name, layout):
    """Adapter tensors fp32 on a bf16 base; outputs and merged weights bf16; values as the
    oracle up to bf16 round-off (a dropped cast changes a dtype or the precision)."""
    model, adapter = build(name, layout, dtype=torch.bfloat16, adapter_dtype=torch.float32)
    assert all(v.dtype == torch.float32 for v in adapter.params.values())
    assert all(v.dtype in (torch.float32, torch.bfloat16) for v in adapter.buffers.values())
    adapter = perturbed(adapter, seed=7)
    x, base = inputs(torch.bfloat16), lf.base_params(model)
    want = oracle_out(model, adapter, x)
    w_eff, b_eff = oracle_forms(model, adapter)
    bound = x.double().abs() @ w_eff.abs().T + (0 if b_eff is None else b_eff.abs())
    merged = lf.merge_overlay(base, adapter)
    assert merged["proj.weight"].dtype == torch.bfloat16
    for overlay_name, make in OVERLAYS:
        got = run(model, make(base, adapter), x)
        assert got.dtype == torch.bfloat16, overlay_name
        err = (got.double() - want).abs()
        assert (err <= 0.03 * bound + 1e-3).all(), f"{overlay_name}: {float((err / bound).max()):.3g}"


# bit-exact identity at init except where SVD/reflection round-off or a random init enters
NOT_EXACT_AT_INIT = {"pissa", "pissa-niter", "hra", "hra-random", "antipasto", "antipasto-noclamp"}


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_identity_at_init(name, layout):
    model, adapter = build(name, layout, dtype=torch.float32, adapter_dtype=torch.float32)
    x, base = inputs(torch.float32), lf.base_params(model)
    reference = run(model, base, x)
    if CONFIGS[name][0] == "antipasto":
        adapter = adapter.with_buffers(with_steering(adapter.buffers, 0.0))
    for overlay_name, make in OVERLAYS:
        out = run(model, make(base, adapter), x)
        if name == "hra-random":
            assert (out - reference).abs().max() > 1e-2, "random reflections are not the identity"
        elif name in NOT_EXACT_AT_INIT and not name.startswith("antipasto"):
            torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5, msg=overlay_name)
        else:
            assert torch.equal(out, reference), overlay_name


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_trainable_shapes_and_step0_gradients(name, layout):
    """Init shapes per the variant docs, and which tensors get a non-zero gradient at step 0."""
    variant = CONFIGS[name][0]
    model, adapter = build(name, layout)
    (layer,) = adapter.layers
    r = layer.info.r
    expected = {
        "lora": {"lora_A": (r, D_IN), "lora_B": (D_OUT, r)},
        "eva": {"lora_A": (r, D_IN), "lora_B": (D_OUT, r)},
        "pissa": {"lora_A": (r, D_IN), "lora_B": (D_OUT, r)},
        "dora": {"lora_A": (r, D_IN), "lora_B": (D_OUT, r), "lora_magnitude_vector": (D_OUT,)},
        "delora": {"delora_A": (r, D_IN), "delora_B": (D_OUT, r), "delora_lambda": (1,)},
        "hra": {"hra_u": (D_IN, r)},
        "ia3": {"ia3_l": (D_OUT,)},
        "ia3_ff": {"ia3_l": (D_IN,)},
        "antipasto": {"delta_s": (r,), "P": (r, r), "P_u": (r, r)},
    }[variant]
    if variant == "antipasto" and not layer.info.option("rotate_u"):
        del expected["P_u"]
    assert {k.removeprefix("proj."): tuple(v.shape) for k, v in adapter.params.items()} == expected
    x, base = inputs(), lf.base_params(model)
    grads = torch.func.grad(lambda p: (run(model, lf.overlay(base, adapter.with_params(p)), x) ** 2).sum())(adapter.params)
    nonzero = {k.removeprefix("proj.") for k, g in grads.items() if g.abs().max() > 0}
    assert nonzero >= ROWS[variant].step0_nonzero & set(expected), nonzero


# ----------------------------------------------------------------------- targeted killers


def test_lora_init_statistics():
    """Kills: kaiming ``a=√5`` -> ``√6``, gaussian ``/ r`` -> ``* r``, ``B = 0`` -> ``1``."""
    from lora_func.variants import lora

    info = LayerInfo(d_in=400, d_out=300, r=50, alpha=8.0, has_bias=False, options=(("init", "kaiming"), ("use_rslora", False)))
    w = torch.zeros(300, 400)
    p, _ = lora.init(w, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    bound = 1 / math.sqrt(400)  # kaiming_uniform(a=√5): gain √(2/6), bound = gain·√(3/fan_in) = 1/√fan_in
    assert p["lora_A"].abs().max() <= bound and p["lora_A"].abs().max() > 0.99 * bound
    assert torch.count_nonzero(p["lora_B"]) == 0
    info = LayerInfo(d_in=400, d_out=300, r=50, alpha=8.0, has_bias=False, options=(("init", "gaussian"), ("use_rslora", False)))
    p, _ = lora.init(w, None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    assert abs(float(p["lora_A"].std()) - 1 / 50) < 0.02 / 50  # N(0, 1/r²), peft's gaussian init


def test_dora_norm_is_detached_in_the_gradient_of_the_magnitude_path():
    """Kills: dropping any ``.detach()`` of DoRA's row norm (gradients through ‖W + sBA‖)."""
    model, adapter = build("dora", "linear")
    adapter = perturbed(adapter, seed=3)
    x, base = inputs(), lf.base_params(model)
    p64 = {k.removeprefix("proj."): v.detach().double().requires_grad_(True) for k, v in adapter.params.items()}
    target = torch.zeros(2, 3, D_OUT, dtype=torch.float64)
    undetached = ((oracle_out(model, adapter, x, p64, ROWS["dora"].w_eff) - target) ** 2).sum()
    g_und = torch.autograd.grad(undetached, [p64["lora_A"]])[0]
    grads = torch.func.grad(lambda p: ((run(model, lf.merge_overlay(base, adapter.with_params(p)), x) - target) ** 2).sum())(adapter.params)
    # the detached and the undetached gradients differ clearly here, so the check above decides
    assert (grads["proj.lora_A"] - g_und).abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_dora_lazy_on_a_bf16_base_rounds_once(layout):
    """With fp32 adapters on a bf16 base, DoRA's lazy path computes ``k ⊙ (y + s·x Aᵀ Bᵀ) +
    (1 − k) ⊙ b`` from the bf16 base output ``y`` in fp32 and rounds to bf16 once, as peft
    does (its fp32 DoRA term is added before the cast back). Kills rounding the inner sum to
    bf16 first: a second rounding, then rescaled by ``k``, moves about a third of the outputs
    by one bf16 step, which an error bound of a few bf16 steps cannot see."""
    model, adapter = build("dora", layout, dtype=torch.bfloat16, adapter_dtype=torch.float32)
    adapter = perturbed(adapter, seed=7)
    g = torch.Generator().manual_seed(8)
    params = dict(adapter.params)
    # magnitudes far from the norms, so that k = m / ‖W + sBA‖ rescales the rounded sum
    params["proj.lora_magnitude_vector"] = params["proj.lora_magnitude_vector"] * (0.5 + torch.rand(D_OUT, generator=g))
    adapter = adapter.with_params(params)
    x = torch.randn(200, D_IN, generator=g).bfloat16()
    p = {k.removeprefix("proj."): v.detach().double() for k, v in adapter.params.items()}
    w = canonical_weight(model.proj.weight, layout).double()
    s = 6.0 / 3
    k = p["lora_magnitude_vector"] / (w + s * p["lora_B"] @ p["lora_A"]).norm(dim=1)
    y = model(x=x).double()  # the bf16 base output, bias included
    want = (k * (y + s * (x.double() @ p["lora_A"].T) @ p["lora_B"].T) + (1 - k) * model.proj.bias.double()).bfloat16()
    got = run(model, lf.overlay(lf.base_params(model), adapter), x)
    assert got.dtype == torch.bfloat16 and not torch.equal(got, model(x=x))
    # fp32 round-off flips a correctly rounded result only next to a tie: rarely
    mismatched = float((got != want).double().mean())
    assert mismatched < 0.02, f"{mismatched:.1%} of the outputs are not the once-rounded exact value"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_delora_w_norm_buffer(dtype):
    """The frozen column norms ‖W[:, j]‖ of the base per input feature, computed in fp32 at
    least (a bf16 base's norms are not rounded to bf16). Kills a norm taken in the base dtype."""
    for layout in ("linear", "conv1d"):
        model, adapter = build("delora", layout, dtype=dtype, adapter_dtype=torch.float32)
        w = canonical_weight(lf.base_params(model)["proj.weight"], layout).double()
        torch.testing.assert_close(adapter.buffers["proj.delora_w_norm"].double(), w.norm(dim=0), atol=0, rtol=1e-6)


# The documented defaults (peft's where peft has the variant; docs/variants/<name>.md) and
# contract flags of every variant: a changed default silently changes every adapter built
# without that argument, and the oracles above read the resolved options, so they cannot see it.
DOCUMENTED = {
    # name: (default alpha, default options, uses_rank, changes_bias, records_base, rank_axes)
    "lora": (8.0, {"use_rslora": False, "init": "kaiming", "dropout": 0.0}, True, False, False, {"lora_A": 0, "lora_B": 1}),
    "dora": (8.0, {"use_rslora": False, "dropout": 0.0}, True, False, False, {"lora_A": 0, "lora_B": 1}),
    "pissa": (8.0, {"use_rslora": False, "niter": 0, "dropout": 0.0}, True, False, True, {"lora_A": 0, "lora_B": 1}),
    "delora": (8.0, {"lambda0": 15.0}, True, False, False, {"delora_A": 0, "delora_B": 1}),
    "hra": (8.0, {"init": "paired"}, True, False, False, {"hra_u": 1}),
    "ln_tuning": (1.0, {"weight": True}, False, True, False, {}),
    "antipasto": (
        1.0,
        {"max_rotation_angle": math.pi / 3, "rotate_u": False, "steer": 1.0},
        True,
        False,
        True,
        {"delta_s": 0, "P": (0, 1), "P_u": (0, 1), "U": 1, "S": 0, "V": 1},
    ),
    "ia3": (1.0, {}, False, True, False, {}),
    "ia3_ff": (1.0, {}, False, False, False, {}),
    "eva": (
        8.0,
        {"rho": 2.0, "tau": 0.99, "whiten": False, "use_rslora": False, "adjust_scaling_factors": True, "svd": "lowrank", "max_batches": 1000, "dropout": 0.0},
        True,
        False,
        False,
        {"lora_A": 0, "lora_B": 1},
    ),
    # issue 30, structured family (b): peft's defaults; no alpha in any of the four
    "oft": (
        1.0,
        {"oft_block_size": 32, "num_blocks": 0, "block_share": False, "coft": False, "eps": 6e-5, "use_cayley_neumann": True,
         "num_cayley_neumann_terms": 5, "module_dropout": 0.0, "init": "identity"},
        False,
        False,
        False,
        {},
    ),
    "boft": (1.0, {"boft_block_size": 4, "boft_block_num": 0, "boft_n_butterfly_factor": 1, "boft_dropout": 0.0, "init": "identity"}, False, False, False, {}),
    "road": (1.0, {"road_variant": "road_1", "group_size": 64, "init": "identity"}, False, True, False, {}),
    "hira": (1.0, {"init": "kaiming", "dropout": 0.0}, True, False, False, {"hira_A": 0, "hira_B": 1}),
}

# Issue 30, structured family (first part).
_LYCORIS = {"rank_dropout": 0.0, "module_dropout": 0.0, "use_effective_conv2d": False}
DOCUMENTED |= {
    "loha": (8.0, {**_LYCORIS, "init": "default"}, True, False, False, {"hada_w1_a": 1, "hada_w1_b": 0, "hada_w2_a": 1, "hada_w2_b": 0, "hada_t1": (0, 1), "hada_t2": (0, 1)}),
    "lokr": (
        8.0,
        {**_LYCORIS, "init": "default", "decompose_both": False, "decompose_factor": -1, "rank_dropout_scale": False},
        True,
        False,
        False,
        {"lokr_w1_a": 1, "lokr_w1_b": 0, "lokr_w2_a": 1, "lokr_w2_b": 0, "lokr_t2": (0, 1)},
    ),
    "gralora": (16.0, {"gralora_k": 2, "hybrid_r": 0, "dropout": 0.0, "init": "default"}, True, False, False, {"gralora_A": 2, "gralora_B": 1}),
    "miss": (8.0, {"init": "miss", "mini_r": 1, "dropout": 0.0}, True, False, False, {"miss_block": 0}),
}
DOCUMENTED.update(
    {
        # issue 30: r is SHiRA's r, FourierFT's n_frequency, C3A's block_size (no rank axes)
        "shira": (1.0, {"mask_type": "random", "random_seed": None, "init_weights": True}, True, False, False, {}),
        "fourierft": (1.0, {"scaling": 150.0, "random_loc_seed": 777, "init_weights": False}, False, False, False, {}),
        "c3a": (1.0, {"init": "zeros"}, False, False, False, {}),
    }
)


# Issue 31: AdaLoRA, the init variants and the shared-basis family (pinned from docs/variants/*.md's defaults).
DOCUMENTED.update(
    {
        "adalora": (8.0, {"beta1": 0.85, "beta2": 0.85, "deltaT": 1, "dropout": 0.0, "init": "default", "init_r": 8, "orth_reg_weight": 0.5, "target_r": 8, "tfinal": 0, "tinit": 0, "total_step": 1}, True, False, False, {"lora_A": 0, "lora_E": 0, "lora_B": 1}),
        "corda": (8.0, {"corda_method": "ipm", "dropout": 0.0, "use_rslora": False}, True, False, True, {"lora_A": 0, "lora_B": 1}),
        "mica": (8.0, {"dropout": 0.0, "use_rslora": False}, True, False, False, {"lora_A": 0, "lora_B": 1}),
        "olora": (8.0, {"dropout": 0.0, "use_rslora": False}, True, False, True, {"lora_A": 0, "lora_B": 1}),
        "adamss": (1.0, {"num_subspaces": 5, "subspace_rank": 1, "init": "orthogonal", "use_dynamic_rank": False, "svd_threshold": 0.1, "random_seed": 0, "use_asa": False, "asa_target_subspaces": 50, "init_warmup": 50, "final_warmup": 1000, "mask_interval": 100, "asa_importance_beta": 0.85, "asa_uncertainty_beta": 0.85, "asa_schedule_exponent": 3.0}, True, True, False, {}),
        "pvera": (1.0, {"d_initial": 0.1, "dropout": 0.0, "init": "zero", "projection_prng_key": 0, "sample_at_inference": False, "save_projection": True}, True, False, False, {"pvera_B": 1}),
        "randlora": (1.0, {"dropout": 0.0, "init": "zero", "projection_prng_key": 0, "randlora_alpha": 640.0, "save_projection": True, "sparse": False, "very_sparse": False}, True, False, False, {"randlora_lambda": 0, "randlora_A": 0, "randlora_B": 2}),
        "vblora": (1.0, {"dropout": 0.0, "init_logits_std": 0.1, "init_vector_bank_bound": 0.02, "num_vectors": 256, "save_only_topk_weights": False, "topk": 2, "vector_length": 256}, True, False, False, {"vblora_logits_A": 0, "vblora_logits_B": 1}),
        "vera": (1.0, {"d_initial": 0.1, "dropout": 0.0, "init": "zero", "projection_prng_key": 0, "save_projection": True}, True, False, False, {"vera_lambda_d": 0, "vera_A": 0, "vera_B": 1}),
    }
)

# Issue 30: WaveFT (r is peft's n_frequency; no rank axes), pinned from docs/variants/waveft.md.
DOCUMENTED["waveft"] = (
    1.0,
    {"init_weights": True, "proportional_parameters": False, "random_loc_seed": 777, "scaling": 25.0, "use_idwt": True, "wavelet_family": "db1"},
    False,
    False,
    False,
    {},
)


# Issue 31: the inits kasa, lora_ga, loftq (pinned from docs/variants/*.md's defaults).
DOCUMENTED.update(
    {
        "kasa": (8.0, {"beta": 1e-4, "dropout": 0.0, "gamma": 1e-3, "use_rslora": False}, True, False, True, {"lora_A": 0, "lora_B": 1, "lora_diag": 0}),
        "lora_ga": (8.0, {"direction": "ArB2r", "dropout": 0.0, "scale": "stable", "stable_gamma": 16, "use_rslora": False}, True, False, True, {"lora_A": 0, "lora_B": 1}),
        "loftq": (8.0, {"dropout": 0.0, "loftq_bits": 4, "loftq_iter": 1, "use_rslora": False}, True, False, True, {"lora_A": 0, "lora_B": 1}),
    }
)
REPLACES_WEIGHT = ("pissa", "olora", "corda", "ln_tuning", "kasa", "lora_ga", "loftq", "frod")
# The variants that take r directions of each target's weight: r <= min(d_in, d_out) is checked
# before any init. The others take any r, as peft does (issue 48: VeRA's r=256 on a small model).
RANK_WITHIN_LAYER = ("antipasto", "corda", "eva", "kasa", "loftq", "lora_ga", "mica", "olora", "pissa")


# Issue 31: TinyLoRA and Uni-LoRA (pinned from docs/variants/{tinylora,unilora}.md's defaults).
DOCUMENTED.update(
    {
        "tinylora": (1.0, {"dropout": 0.0, "init": "zero", "init_v_bound": 0.02, "projection_seed": 42, "save_projection": True, "u": 64, "weight_tying": 0.0}, True, False, False, {"tinylora_A": 0, "tinylora_B": 1, "tinylora_P": (1, 2)}),
        "unilora": (1.0, {"dropout": 0.0, "init": "uniform", "init_theta_d_bound": 0.02, "proj_seed": 42, "save_indices": False, "theta_d_length": 256}, True, False, False, {"unilora_indices_A": 0, "unilora_indices_B": 1, "unilora_scales_A": 0, "unilora_scales_B": 1}),
    }
)


# Issue 43: beft, glora, osf, psoft (pinned from docs/variants/{beft,glora,osf,psoft}.md's defaults;
# OSF's r is each layer's frozen count, resolved from effective_rank: no rank axes).
DOCUMENTED.update(
    {
        "beft": (1.0, {"init": "zero"}, False, True, False, {}),
        "glora": (
            1.0,
            {"config_A_B": "lora", "config_C": "lora", "config_D_E": "constant", "init": "zero"},
            True,
            True,
            False,
            {"glora_A_Xd": 1, "glora_A_Xu": 0, "glora_B_Xd": 1, "glora_B_Xu": 0, "glora_C_Xd": 1, "glora_C_Xu": 0},
        ),
        "osf": (1.0, {"effective_rank": None, "init": "svd"}, False, False, False, {}),
        "psoft": (
            32.0,
            {"ab_svd_init": "psoft_init", "psoft_svd": "full", "psoft_svd_lowrank_niter": 10, "random_seed": 0, "psoft_orth": True, "psoft_mag_b": True,
             "psoft_mag_a": True, "use_cayley_neumann": False, "num_cayley_neumann_terms": 5, "cayley_neumann_eps": None, "dropout": 0.0, "init": "identity"},
            True,
            False,
            False,
            {"psoft_vector_b": 0, "psoft_vector_a": 0, "psoft_A": 0, "psoft_B": 1},
        ),
    }
)
RANK_WITHIN_LAYER = (*RANK_WITHIN_LAYER, "psoft")
# Issue 43 (methods b): pinned from docs/variants/{deft,frod,peanut,supertuning}.md's defaults.
DOCUMENTED.update(
    {
        "deft": (1.0, {"decomposition_method": "relu", "para": False, "injection_alpha": None, "init": "identity", "init_scale": 1.0, "dropout": 0.0}, True, False, False, {}),
        "supertuning": (1.0, {"sparsity": 0.99, "select_top": True, "lora_r": None, "lora_alpha": None, "dropout": 0.0, "init": "identity", "save_precomputed_indices": True}, False, False, False, {}),
        "peanut": (1.0, {"depth": 0, "act_fn": "relu", "scaling": 1.0, "init": "identity"}, True, False, False, {"peanut_A": 0, "peanut_B": 1, **{f"peanut_{k}_{i}": (0, 1) for k in ("encoders", "decoders") for i in range(8)}}),
        # (no rank: U, V full rank; W replaced)
        "frod": (1.0, {"sparse_rate": 0.01, "regularization_alpha": 1e-3, "projection_prng_key": 0, "save_projection": True, "init": "identity", "dropout": 0.0}, False, False, False, {}),
    }
)
# Issue 43: LoRA's own variants (pinned from docs/variants/{lora_bias,bdlora,qalora,velora,monteclora,alora}.md) and trainable tokens.
_LORA = {"dropout": 0.0, "use_rslora": False}
DOCUMENTED.update(
    {
        "lora_bias": (8.0, _LORA, True, True, False, {"lora_A": 0, "lora_B": 1}),
        "bdlora": (8.0, {**_LORA, "nblocks": 1, "side": "a"}, True, False, False, {}),
        "qalora": (8.0, {**_LORA, "group_size": 16}, True, False, False, {"lora_A": 0, "lora_B": 1}),
        "trainable_tokens": (1.0, {"init_weights": True, "token_indices": ()}, False, False, False, {}),
        "velora": (8.0, {**_LORA, "init_type": "batch_average", "num_groups": 64, "scale": 1.0}, True, False, False, {"lora_A": 0, "lora_B": 1}),
        "monteclora": (
            8.0,
            {**_LORA, "dirichlet_prior": 0.1, "kl_loss_weight": 1e-5, "num_samples": 8, "sample_scaler": 1e-4, "use_entropy": False},
            True,
            False,
            False,
            {"lora_A": 0, "lora_B": 1, "monteclora_std_prior": 0, "monteclora_gaussian_var_prior": (0, 1)},
        ),
        "alora": (8.0, {**_LORA, "invocation_tokens": ()}, True, False, False, {"lora_A": 0, "lora_B": 1}),
    }
)


# Issue 43 (session 3): Lily, pinned from docs/variants/lily.md (peft's LilyConfig defaults; its
# A and B are shared within groups of layers, the router per layer).
DOCUMENTED["lily"] = (1.0, {"init": "zero", "num_B": 2, "scaling": 1.0, "stride_A": 1}, True, False, False, {"lily_A": 0, "lily_B": 1, "lily_router": 1})


@pytest.mark.parametrize("variant", sorted(DOCUMENTED))
def test_documented_defaults_and_flags(variant):
    assert sorted(DOCUMENTED) == lf.list_variants()
    alpha, options, uses_rank, changes_bias, records_base, rank_axes = DOCUMENTED[variant]
    v = lf.get_variant(variant)
    spec = lf.AdapterSpec(variant, targets=["proj"])
    assert spec.alpha == alpha and dict(spec.options) == options and spec.r == 8
    axes = {name: (axis,) if isinstance(axis, int) else axis for name, axis in rank_axes.items()}
    assert (v.changes_bias, v.records_base, dict(v.rank_axes)) == (changes_bias, records_base, axes)
    assert ("rank_within_layer" in v.traits) == (variant in RANK_WITHIN_LAYER) and (uses_rank or variant not in RANK_WITHIN_LAYER)
    # PiSSA's weight form discards W (W_res + s·BA), LN tuning's too (its trained copy): only
    # they must come first in compose()
    assert v.replaces_weight == (variant in REPLACES_WEIGHT)


@pytest.mark.parametrize("name", ["lora", "dora", "delora", "hra", "hra-random"])
def test_kaiming_uniform_init_of_the_first_factor(name):
    """Kills: ``kaiming_uniform(a=√5)`` -> ``a=√6`` (peft's bound ``1/√fan_in``, fan_in = d_in)
    and a wrong fan-in axis, in every variant that draws it."""
    variant, kwargs = CONFIGS[name]
    d_in, d_out = 400, 300
    info = LayerInfo(d_in=d_in, d_out=d_out, r=40, alpha=8.0, has_bias=False, options=lf.AdapterSpec(variant, ["x"], **kwargs).options)
    p, _ = lf.get_variant(variant).init(torch.randn(d_out, d_in), None, info, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    first = {"lora": "lora_A", "dora": "lora_A", "delora": "delora_A", "hra": "hra_u"}[variant]
    a = p[first]
    # kaiming's fan-in is dim 1 of the drawn tensor: (r, d_in) for A; HRA draws (d_in, r), or
    # (d_in, r/2) for its paired init (peft's half_u), then repeats each column.
    fan_in = {"hra": 20, "hra-random": 40}.get(name, d_in)
    bound = 1 / math.sqrt(fan_in)
    assert a.abs().max() <= bound and a.abs().max() > 0.98 * bound, (float(a.abs().max()), bound)


@pytest.mark.parametrize(("name", "layout"), [c for c in CASES if "nobias" not in c.id])
def test_half_precision_adapter_dtype_opt_out(name, layout):
    """``AdapterSpec(dtype=torch.bfloat16)`` on an fp32 base: every adapter tensor is bf16 (the
    residual keeps the base precision), both overlays run and agree with the oracle to bf16
    round-off. Kills dropped casts that leave an fp32 tensor in a bf16 product (a dtype error)
    or a param in fp32."""
    variant = CONFIGS[name][0]
    model, adapter = build(name, layout, dtype=torch.float32, adapter_dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in adapter.params.values()), {k: v.dtype for k, v in adapter.params.items()}
    expected_buffer_dtype = {"W_res": torch.float32}
    for key, value in adapter.buffers.items():
        assert value.dtype == expected_buffer_dtype.get(key.removeprefix("proj."), torch.bfloat16), key
    adapter = perturbed(adapter, seed=7)
    x, base = inputs(torch.float32), lf.base_params(model)
    want = oracle_out(model, adapter, x)
    w_eff, b_eff = oracle_forms(model, adapter) if variant != "delora" else (None, None)
    for overlay_name, make in OVERLAYS:
        got = run(model, make(base, adapter), x)
        assert got.dtype == torch.float32, overlay_name
        scale = float(want.abs().max())
        assert (got.double() - want).abs().max() <= 0.05 * scale, overlay_name
    del w_eff, b_eff


def test_hra_tiny_column_norm_threshold():
    """A column of norm 1.5e-30 is still a proper reflection; only below 1e-30 is it treated as
    the zero vector (identity). Kills a changed threshold."""
    from lora_func.variants.hra import unit_columns

    u = torch.zeros(4, 2, dtype=torch.float64)
    u[0, 0], u[1, 1] = 1.5e-30, 0.5e-30
    unit = unit_columns(u)
    assert torch.equal(unit[:, 0], torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))  # normalised
    torch.testing.assert_close(unit[:, 1], torch.tensor([0, 0.5, 0, 0], dtype=torch.float64))  # divided by 1e-30, not by its norm


@pytest.mark.parametrize(
    ("base_dtype", "adapter_dtype", "residual_dtype"),
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.float32),
        (torch.float64, torch.float32, torch.float64),
    ],
)
def test_pissa_residual_dtype_is_the_more_precise_of_base_and_adapter(base_dtype, adapter_dtype, residual_dtype):
    _model, adapter = build("pissa", "linear", dtype=base_dtype, adapter_dtype=adapter_dtype)
    assert adapter.buffers["proj.W_res"].dtype == residual_dtype
    assert all(v.dtype == adapter_dtype for v in adapter.params.values())


@pytest.mark.parametrize("shape", [(12, 12), (30, 12)], ids=["square", "tall"])
def test_eva_lowrank_svd_is_peft_default_svd_lowrank(shape):
    """EVA's default SVD is ``torch.svd_lowrank(x, q=2k, niter=4)`` (peft IncrementalPCA
    defaults) with the seeded test matrix, up to peft's sign flip. Kills another ``niter`` and
    a square matrix taken as wide (a transposed randomized SVD gives other round-off)."""
    from lora_func.variants import eva

    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    k = 3
    s, vh = eva._svd(x, k, "lowrank", seed=77)
    with torch.random.fork_rng():
        torch.manual_seed(77)
        _, s_ref, v_ref = torch.svd_lowrank(x, q=2 * k, niter=4)
    vh_ref = v_ref.mH
    signs = torch.sign(vh_ref.gather(1, vh_ref.abs().argmax(dim=1, keepdim=True)))
    assert torch.equal(s, s_ref)
    assert torch.equal(vh, vh_ref * signs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_antipasto_with_steering_keeps_each_buffer_dtype(dtype):
    """``with_steering`` writes alpha in each steer buffer's own dtype (an fp64 adapter keeps
    0.7 to fp64 precision); other buffers are the same objects."""
    _model, adapter = build("antipasto", "linear", dtype=torch.float64, adapter_dtype=dtype)
    steered = with_steering(adapter.buffers, 0.7)
    assert steered["proj.steer"].dtype == dtype and steered["proj.steer"].shape == ()
    assert steered["proj.steer"] == torch.tensor(0.7, dtype=dtype)
    assert all(steered[k] is v for k, v in adapter.buffers.items() if not k.endswith("steer"))
    # A tensor alpha of another dtype (here the one vmap would pass) is converted too.
    other = torch.float32 if dtype == torch.float64 else torch.float64
    steered = with_steering(adapter.buffers, torch.tensor(-0.3, dtype=other))
    assert steered["proj.steer"].dtype == dtype and steered["proj.steer"] == torch.tensor(-0.3, dtype=other).to(dtype)


def test_dora_on_top_of_another_part_detaches_the_norm_of_the_incoming_weight():
    """Composed lora -> dora: DoRA's row norm ‖W_a + sBA‖ is a constant for gradients, also
    with respect to the first part's params (its W is then the lora part's W_eff). Kills
    dropping the outer ``.detach()`` of DoRA's norm (the inner ones only cover its own B, A)."""
    model, lora_part = build("lora", "linear")
    _, dora_part = build("dora", "linear", seed=3)
    lora_part, dora_part = perturbed(lora_part, seed=7), perturbed(dora_part, seed=8)
    both = lf.compose(lora_part, dora_part)
    x, base = inputs(), lf.base_params(model)
    target = torch.randn(2, 3, D_OUT, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    w = base["proj.weight"].double()
    bias = base["proj.bias"].double()
    pa = {k.removeprefix("proj."): v.detach().double().requires_grad_(True) for k, v in lora_part.params.items()}
    pb = {k.removeprefix("proj."): v.detach().double().requires_grad_(True) for k, v in dora_part.params.items()}
    w_a, _ = ROWS["lora"].w_eff(pa, {}, w, bias, lora_part.layers[0].info)
    w_b, _ = _dora_detached(pb, {}, w_a, bias, dora_part.layers[0].info)
    loss = (((x @ w_b.T + bias) - target) ** 2).sum()
    want = dict(zip([f"0/proj.{k}" for k in pa] + [f"1/proj.{k}" for k in pb], torch.autograd.grad(loss, [*pa.values(), *pb.values()]), strict=True))
    for overlay_name, make in OVERLAYS:
        grads = torch.func.grad(lambda p, make=make: ((run(model, make(base, both.with_params(p)), x) - target) ** 2).sum())(both.params)
        assert sorted(grads) == sorted(want)
        for key, g in grads.items():
            torch.testing.assert_close(g, want[key], atol=1e-9 * max(1.0, float(want[key].abs().max())), rtol=1e-9, msg=f"{overlay_name} {key}")


@pytest.mark.parametrize("method", ["full", "lowrank"])
def test_eva_incremental_pca_equals_the_batch_pca_of_all_rows(method):
    """peft's IncrementalPCA (EVA's ``_partial_fit``) on rank-3 data with a non-zero mean,
    three unequal batches: the running mean and (biased) variance are those of all rows, and
    the singular values, principal directions and explained-variance ratios equal a direct
    SVD of all centred rows (exact: the data's rank does not exceed k)."""
    from lora_func.variants import eva

    g = torch.Generator().manual_seed(0)
    basis = torch.randn(3, 8, generator=g, dtype=torch.float64)
    batches = [(torch.randn(n, 3, generator=g, dtype=torch.float64) * torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)) @ basis + 5.0 for n in (7, 11, 5)]
    state = None
    for rows in batches:
        state = eva._partial_fit(state, rows, 3, method, seed=1)
    everything = torch.cat(batches)
    n = everything.shape[0]
    centred = everything - everything.mean(0)
    _, s_ref, vh_ref = torch.linalg.svd(centred, full_matrices=False)
    assert state["n"] == n
    torch.testing.assert_close(state["mean"], everything.mean(0), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state["var"], everything.var(0, unbiased=False), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state["singular"], s_ref[:3], atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(state["ratio"], s_ref[:3] ** 2 / (centred**2).sum(), atol=1e-10, rtol=1e-8)
    torch.testing.assert_close((state["components"] @ vh_ref[:3].T).abs(), torch.eye(3, dtype=torch.float64), atol=1e-8, rtol=0)


@pytest.mark.parametrize("adjust", [True, False])
def test_eva_alpha_follows_a_redistributed_rank_only_when_asked(adjust):
    """A layer whose rank is redistributed from 2 to 4 gets alpha·4/2 with
    ``adjust_scaling_factors=True`` and keeps alpha otherwise (peft). Layer 'low' has rank-4
    inputs, 'iso' isotropic noise: 'low' takes the whole budget of 4."""
    from lora_func.variants import eva

    g = torch.Generator().manual_seed(0)
    d = 12
    basis = torch.linalg.qr(torch.randn(d, 4, generator=g, dtype=torch.float64)).Q.float()
    batches = []
    for _ in range(3):
        low = (torch.randn(48, 4, generator=g) * torch.tensor([2.4, 2.2, 2.0, 1.8])) @ basis.T + 0.01 * torch.randn(48, d, generator=g)
        batches.append({"low": low, "iso": torch.randn(48, d, generator=g)})
    options = tuple(sorted({**eva.VARIANT.default_options, "adjust_scaling_factors": adjust}.items()))
    infos = {m: LayerInfo(d_in=d, d_out=8, r=2, alpha=6.0, has_bias=False, options=options) for m in ("iso", "low")}
    out = eva.calibrate(iter(batches * 20), infos, generator=torch.Generator().manual_seed(1))
    assert list(out) == ["low"]
    assert (out["low"][0].r, out["low"][0].alpha) == (4, 12.0 if adjust else 6.0)


def test_eva_distribute_keeps_the_largest_ratios_and_breaks_ties_by_order():
    """Pool every layer's ratios (a sharer contributes its owner's), keep the ``budget`` largest;
    equal ratios go to the earlier layer in (owners first, module order)."""
    from lora_func.variants.eva import _distribute

    ratios = {"a": torch.tensor([0.5, 0.2, 0.1]), "b": torch.tensor([0.4, 0.3, 0.05]), "c": torch.tensor([0.2, 0.2, 0.2])}
    owner = {"a": "a", "b": "b", "c": "c", "a2": "a"}
    k = dict.fromkeys(owner, 3)
    # pooled (owners a, b, c, then sharer a2): a .5 .2 .1 | b .4 .3 .05 | c .2 .2 .2 | a2 .5 .2 .1
    assert _distribute(ratios, owner, k, budget=4) == {"a": 1, "b": 2, "c": 0, "a2": 1}
    # budget 6 reaches the 0.2s: a's (earliest) first, then c's, then a2's
    assert _distribute(ratios, owner, k, budget=6) == {"a": 2, "b": 2, "c": 1, "a2": 1}
    assert _distribute(ratios, owner, k, budget=8) == {"a": 2, "b": 2, "c": 3, "a2": 1}


@pytest.mark.parametrize("variant", ["lora", "dora", "pissa"])
def test_rank_padded_stack_with_rslora_equals_each_alone(variant):
    """Members of ranks 2 and 4 with ``use_rslora``: inside the padded stack each keeps its own
    ``alpha/√r`` (the rank is a tensor there). Kills ``√r`` -> ``r`` on the stacked path."""
    model = one_layer("linear", D_IN, D_OUT, True, torch.float64, 0)
    members = []
    for i, r in enumerate((2, 4)):
        spec = lf.AdapterSpec(variant, targets=["proj"], r=r, alpha=3.0 + i, use_rslora=True, dtype=torch.float64)
        members.append(perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(i)), seed=10 + i, scale=0.3))
    stacked = lf.stack(members)
    x, base = inputs(), lf.base_params(model)
    for overlay_name, make in OVERLAYS:
        together = torch.func.vmap(lambda a, make=make: run(model, make(base, a), x))(stacked)
        for k, member in enumerate(members):
            torch.testing.assert_close(together[k], oracle_out(model, member, x), atol=1e-10, rtol=1e-10, msg=f"{overlay_name} member {k}")


def test_rank_padded_stack_of_float64_adapters_is_float64_exact():
    """An fp64 rank-padded stack keeps its rank mask and alpha in fp64, so each member's scale
    alpha/r is not fp32-rounded (~1e-8 off). Kills a hard-coded fp32 mask/alpha in stack()."""
    model = one_layer("linear", D_IN, D_OUT, True, torch.float64, 0)
    members = [
        perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", ["proj"], r=r, alpha=8.0, dtype=torch.float64), generator=torch.Generator().manual_seed(r)), seed=r, scale=0.3)
        for r in (3, 4)
    ]
    x, base = inputs(), lf.base_params(model)
    together = torch.func.vmap(lambda a: run(model, lf.merge_overlay(base, a), x))(lf.stack(members))
    torch.testing.assert_close(together[0], oracle_out(model, members[0], x), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(("dtype", "scale_dtype"), [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_rank_padded_stack_keeps_mask_and_alpha_in_the_adapter_dtype_but_at_least_fp32(dtype, scale_dtype):
    """The rank mask and alpha of a padded stack are in the adapter dtype, but never below
    fp32 (a bf16 alpha of 0.1 would be 0.10009765625, a bf16 rank above 256 inexact)."""
    model = one_layer("linear", D_IN, D_OUT, True, torch.float64, 0)
    members = [lf.init_adapter(model, lf.AdapterSpec("lora", ["proj"], r=r, alpha=0.1, dtype=dtype), generator=torch.Generator().manual_seed(r)) for r in (3, 4)]
    buffers = lf.stack(members).buffers
    assert buffers["proj.rank_mask"].dtype == scale_dtype and buffers["proj.rank_alpha"].dtype == scale_dtype
    assert torch.equal(buffers["proj.rank_alpha"], torch.tensor([0.1, 0.1], dtype=scale_dtype))
    assert torch.equal(buffers["proj.rank_mask"], torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=scale_dtype))


@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_three_part_compose_equals_the_chained_oracle(layout):
    """lora -> dora -> ia3 on one layer: each part sees the previous parts' effective weight
    (the middle one reads it for its norm). Kills a chain that treats only 2 parts right."""
    model, a = build("lora", layout)
    _, b = build("dora", layout, seed=3)
    _, c = build("ia3", layout, seed=5)
    parts = [perturbed(p, seed=20 + i) for i, p in enumerate((a, b, c))]
    x, base = inputs(), lf.base_params(model)
    w = canonical_weight(base["proj.weight"], layout).double()
    bias = base["proj.bias"].double()
    for part in parts:
        p = {k.removeprefix("proj."): v.detach().double() for k, v in part.params.items()}
        w, bias = ROWS[part.spec.variant].w_eff(p, {}, w, bias, part.layers[0].info)
    want = x @ w.T + bias
    both = lf.compose(*parts)
    for overlay_name, make in OVERLAYS:
        torch.testing.assert_close(run(model, make(base, both), x), want, atol=1e-10, rtol=1e-10, msg=overlay_name)


@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_combine_on_a_bf16_base_keeps_the_base_dtype(layout):
    """combine(): deltas are summed in fp32 and the result cast back, so merged weights, biases
    and outputs stay bf16 on a bf16 base (and match the float64 oracle to bf16 round-off)."""
    model, a = build("lora", layout, dtype=torch.bfloat16, adapter_dtype=torch.float32)
    _, b = build("ia3", layout, dtype=torch.bfloat16, adapter_dtype=torch.float32, seed=3)
    a, b = perturbed(a, seed=1), perturbed(b, seed=2)
    mixed = lf.combine([a, b], torch.tensor([0.6, -0.3]))
    x, base = inputs(torch.bfloat16), lf.base_params(model)
    merged = lf.merge_overlay(base, mixed)
    assert merged["proj.weight"].dtype == torch.bfloat16 and merged["proj.bias"].dtype == torch.bfloat16
    want = run(model, base, x).double() + sum(
        wk * (oracle_out(model, part, x) - oracle_out(model, part, x, w_eff_fn=lambda p, b_, w, bias, info: (w, bias)))
        for wk, part in ((0.6, a), (-0.3, b))
    )
    for overlay_name, make in OVERLAYS:
        got = run(model, make(base, mixed), x)
        assert got.dtype == torch.bfloat16, overlay_name
        assert (got.double() - want).abs().max() <= 0.05 * want.abs().max(), overlay_name


def _standin_and_merged(layout: str, d: int = 5):
    model = one_layer(layout, d, d, True, torch.float64, 0)
    _, adapter = model, None
    spec = lf.AdapterSpec("lora", targets=["proj"], r=2, dtype=torch.float64)
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0)), seed=1, scale=0.5)
    base = lf.base_params(model)
    return lf.overlay(base, adapter)["proj.weight"], lf.merge_overlay(base, adapter)["proj.weight"], base["proj.bias"]


def test_lazy_standin_takes_the_low_rank_path_only_for_the_layers_own_call():
    """Every op on a stand-in equals that op on the merged weight: the layer's own call
    (``F.linear`` for Linear, ``addmm(b, x, W)`` / ``x @ W`` for Conv1D) through the low-rank
    path, anything else (scaled addmm, the stand-in on the left, another layout's op) through
    the dense fallback. Kills weakened conditions in ``__torch_function__``."""
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y = torch.randn(5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    conv, conv_merged, b = _standin_and_merged("conv1d")
    lin, lin_merged, _ = _standin_and_merged("linear")
    F = torch.nn.functional
    calls = {
        "conv1d addmm": (lambda w: torch.addmm(b, x, w), conv, conv_merged),
        "conv1d addmm beta/alpha": (lambda w: torch.addmm(b, x, w, beta=0.5, alpha=2.0), conv, conv_merged),
        "conv1d matmul": (lambda w: torch.matmul(x, w), conv, conv_merged),
        "conv1d @": (lambda w: x @ w, conv, conv_merged),
        "conv1d on the left": (lambda w: torch.matmul(w, y), conv, conv_merged),
        "linear F.linear": (lambda w: F.linear(x, w, b), lin, lin_merged),
        "linear F.linear no bias": (lambda w: F.linear(x, w), lin, lin_merged),
        "linear in addmm": (lambda w: torch.addmm(b, x, w), lin, lin_merged),
        "linear in matmul": (lambda w: torch.matmul(x, w), lin, lin_merged),
        "linear as bias of addmm": (lambda w: torch.addmm(w, x.T @ x, x.T @ x), lin, lin_merged),
    }
    for what, (op, standin, merged) in calls.items():
        torch.testing.assert_close(op(standin), op(merged), atol=1e-12, rtol=1e-12, msg=what)


def test_conv1d_standin_in_f_linear_falls_back_to_the_merged_weight():
    """F.linear on a Conv1D-layout stand-in is not that layer's own call: it goes through the
    dense merged weight. Kills a missing layout check in the F.linear branch."""
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    conv, conv_merged, b = _standin_and_merged("conv1d")
    torch.testing.assert_close(torch.nn.functional.linear(x, conv, b), torch.nn.functional.linear(x, conv_merged, b), atol=1e-12, rtol=1e-12)


def test_combine_with_ia3_on_a_layer_without_bias():
    """A combined part that changes the bias (IA3), on a bias-free layer: no bias appears."""
    model = one_layer("linear", D_IN, D_OUT, False, torch.float64, 0)
    a = perturbed(lf.init_adapter(model, lf.AdapterSpec("ia3", ["proj"], dtype=torch.float64)), seed=1)
    b = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", ["proj"], r=2, dtype=torch.float64)), seed=2)
    mixed = lf.combine([a, b], torch.tensor([0.5, 0.5], dtype=torch.float64))
    x, base = inputs(), lf.base_params(model)
    merged = lf.merge_overlay(base, mixed)
    assert "proj.bias" not in merged
    want = 0.5 * oracle_out(model, a, x) + 0.5 * oracle_out(model, b, x)
    for overlay_name, make in OVERLAYS:
        torch.testing.assert_close(run(model, make(base, mixed), x), want, atol=1e-10, rtol=1e-10, msg=overlay_name)


def test_base_params_names_every_tied_name_with_one_object():
    """GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``: base_params lists both names,
    as one detached tensor sharing the model's storage."""
    from tests.models import tiny_model

    model = tiny_model("gpt2")
    base = lf.base_params(model)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)] + [n for n, _ in model.named_buffers(remove_duplicate=False)]
    assert sorted(base) == sorted(names) and "lm_head.weight" in base
    assert base["lm_head.weight"] is base["transformer.wte.weight"]
    assert not base["lm_head.weight"].requires_grad
    assert base["lm_head.weight"].data_ptr() == model.transformer.wte.weight.data_ptr()


def test_combine_of_parts_on_different_layers_uses_each_parts_own_weight():
    """combine([a on layer 1, b on layer 2], [w_a, w_b]): layer 2 gets w_b (not w_a, the first
    weight), i.e. W2 + w_b (W_eff_b − W2)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, D_IN), torch.nn.Tanh(), torch.nn.Linear(D_IN, D_OUT)).double().eval()
    a = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", ["0"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(1)), seed=2, scale=0.5)
    b = perturbed(lf.init_adapter(model, lf.AdapterSpec("ia3", ["2"], dtype=torch.float64), generator=torch.Generator().manual_seed(3)), seed=4, scale=0.5)
    w_a, w_b = 0.3, -0.8
    mixed = lf.combine([a, b], torch.tensor([w_a, w_b], dtype=torch.float64))
    base = lf.base_params(model)
    pa = {k.removeprefix("0."): v.detach() for k, v in a.params.items()}
    pb = {k.removeprefix("2."): v.detach() for k, v in b.params.items()}
    w1, b1 = base["0.weight"], base["0.bias"]
    w2, b2 = base["2.weight"], base["2.bias"]
    w1_eff = w1 + w_a * (ROWS["lora"].w_eff(pa, {}, w1, b1, a.layers[0].info)[0] - w1)
    w2_full, b2_full = ROWS["ia3"].w_eff(pb, {}, w2, b2, b.layers[0].info)
    w2_eff, b2_eff = w2 + w_b * (w2_full - w2), b2 + w_b * (b2_full - b2)
    x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want = torch.tanh(x @ w1_eff.T + b1) @ w2_eff.T + b2_eff
    for overlay_name, make in OVERLAYS:
        got = torch.func.functional_call(model, make(base, mixed), (x,))
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=overlay_name)


def test_base_params_names_every_name_of_a_shared_buffer():
    """A buffer registered under two names (shared tables, e.g. rotary frequencies) is listed
    under both, as one object, like a tied parameter."""
    shared = torch.arange(4.0)
    model = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module())
    model[0].register_buffer("table", shared)
    model[1].register_buffer("table", shared)
    base = lf.base_params(model)
    assert sorted(base) == ["0.table", "1.table"] and base["0.table"] is base["1.table"]


def test_adapted_call_and_adapted_default_paths_bit_for_bit():
    """``adapted_call`` defaults to the lazy path (non-strict: a tied lm_head falls back to the
    merged weight instead of raising), ``adapted`` to the merged one: each is bit-equal to its
    overlay through functional_call, and the two paths differ in the last bits here."""
    from tests.models import tiny_model, tokens

    model = tiny_model("gpt2")
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("dora", ["c_attn", "lm_head"], r=2, tied="both"), generator=torch.Generator().manual_seed(0)), seed=1, scale=0.1)
    base, ids = lf.base_params(model), tokens()
    lazy = torch.func.functional_call(model, lf.overlay(base, adapter), (ids,)).logits
    merged = torch.func.functional_call(model, lf.merge_overlay(base, adapter), (ids,)).logits
    assert not torch.equal(lazy, merged), "the two paths must be distinguishable for this test"
    assert torch.equal(lf.adapted_call(model, adapter, ids).logits, lazy)
    assert torch.equal(lf.adapted_call(model, adapter, ids, merged=True).logits, merged)
    with torch.no_grad():
        with lf.adapted(model, adapter):
            assert torch.equal(model(ids).logits, merged)
        with lf.adapted(model, adapter, merged=False):
            assert torch.equal(model(ids).logits, lazy)


def test_the_layers_own_call_never_builds_the_merged_weight(monkeypatch):
    """On the lazy path the layer's own op runs the low-rank form: with the dense fallback
    disabled, F.linear / addmm / matmul / @ on a stand-in still work. Kills conditions that
    would silently route the layer's call to the (correct but dense) fallback."""
    from lora_func._lazy import AdaptedWeight

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    conv, conv_merged, b = _standin_and_merged("conv1d")
    lin, lin_merged, _ = _standin_and_merged("linear")
    F = torch.nn.functional
    expected = {
        "F.linear": (lambda: F.linear(x, lin, b), F.linear(x, lin_merged, b)),
        "addmm": (lambda: torch.addmm(b, x, conv), torch.addmm(b, x, conv_merged)),
        "matmul": (lambda: torch.matmul(x, conv), x @ conv_merged),
        "@": (lambda: x @ conv, x @ conv_merged),
    }

    def refuse(self):
        raise AssertionError("the dense merged weight was built")

    monkeypatch.setattr(AdaptedWeight, "merged", refuse)
    for what, (call, want) in expected.items():
        torch.testing.assert_close(call(), want, atol=1e-12, rtol=1e-12, msg=what)


# ---------------------------------------------------------------- the shared low-rank update


def _low_rank_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    w, bias = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    h, b = torch.randn(2, 5, 3, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    return x, w, bias, h, b


def test_base_plus_low_rank_updates_the_fresh_base_output_in_place_in_eager_autograd():
    """The eager path accumulates ``h bᵀ`` into the base layer's own output (no copy of it) and
    keeps values and every gradient of ``base(x) + h bᵀ``; a mutant that drops the term, adds
    it twice, uses ``b`` untransposed or writes into a tensor autograd still needs fails."""
    from lora_func.variants._kernels import base_plus_low_rank

    x, w, bias, h, b = (t.requires_grad_(True) for t in _low_rank_case())
    outputs = []

    def base(x_):
        outputs.append(torch.nn.functional.linear(x_, w, bias))
        return outputs[-1]

    out = base_plus_low_rank(base, x, h, b)
    assert out.shape == (2, 5, 4) and out.untyped_storage().data_ptr() == outputs[0].untyped_storage().data_ptr()
    want = torch.nn.functional.linear(x, w, bias) + h @ b.T
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    upstream = torch.randn(2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * upstream).sum(), [x, w, bias, h, b])
    expected = torch.autograd.grad((want * upstream).sum(), [x, w, bias, h, b])
    for name, g_, e in zip(("x", "w", "bias", "h", "b"), got, expected):
        torch.testing.assert_close(g_, e, atol=1e-12, rtol=0, msg=name)


def test_base_plus_low_rank_under_vmap_with_an_unbatched_base_output():
    """Under ``vmap`` over adapters sharing one input, the base output is unbatched while ``h``
    and ``b`` are batched: an in-place update is impossible there (vmap raises), so the path
    must fall back. Oracle: a Python loop over the members."""
    from lora_func.variants._kernels import base_plus_low_rank

    x, w, bias, _, _ = _low_rank_case()
    g = torch.Generator().manual_seed(2)
    hs, bs = torch.randn(3, 2, 5, 2, generator=g, dtype=torch.float64), torch.randn(3, 4, 2, generator=g, dtype=torch.float64)

    def one(h, b):
        return base_plus_low_rank(lambda x_: torch.nn.functional.linear(x_, w, bias), x, h, b)

    got = torch.func.vmap(one)(hs, bs)
    want = torch.stack([torch.nn.functional.linear(x, w, bias) + hs[k] @ bs[k].T for k in range(3)])
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    grads = torch.func.grad(lambda h: one(h, bs[0]).square().sum())(hs[0])
    h0 = hs[0].clone().requires_grad_(True)
    (expected,) = torch.autograd.grad((torch.nn.functional.linear(x, w, bias) + h0 @ bs[0].T).square().sum(), [h0])
    torch.testing.assert_close(grads, expected, atol=1e-10, rtol=0)


def test_base_plus_low_rank_on_a_bf16_base_adds_the_fp32_product_once_rounded():
    """A bf16 base output with an fp32 low-rank path: the product is computed in fp32 and
    rounded once into the base dtype, as ``add_low_rank`` (and peft) do."""
    from lora_func.variants._kernels import add_low_rank, base_plus_low_rank

    x, w, bias, h, b = _low_rank_case(3)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), bias.bfloat16()

    def base(x_):
        return torch.nn.functional.linear(x_, wb, bb)

    got = base_plus_low_rank(base, xb, h.float(), b.float())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, add_low_rank(base(xb), h.float(), b.float()))
    assert torch.equal(got, base(xb) + (h.float() @ b.float().T).bfloat16())


# Issue 47: routed LoRA, pinned from docs/routed.md (peft's PolyConfig / ArrowConfig defaults; Arrow's
# rng_seed is always set, peft's None draws from the global RNG).
DOCUMENTED.update(
    {
        "poly": (1.0, {"init_weights": True, "n_skills": 4, "n_splits": 1, "n_tasks": 1, "poly_type": "poly"}, True, False, False, {"poly_lora_A": 3, "poly_lora_B": 2}),
        "arrow": (8.0, {"num_experts": 3, "rng_seed": 0, "router_temperature": 1.0, "top_k": 3}, True, False, False, {"lora_A": 1, "lora_B": 2}),
        # peft's XLoraConfig defaults (top_k_lora None is 0: every expert; num_experts from routed.xlora's list)
        "xlora": (8.0, {"num_experts": 2, "hidden_size": 4096, "enable_softmax": True, "enable_softmax_topk": False, "layerwise_scalings": False,
                        "xlora_depth": 1, "xlora_size": 2048, "xlora_dropout_p": 0.2, "use_trainable_adapters": False, "softmax_temperature": 1.0,
                        "top_k_lora": 0, "scaling_pass_value": 0.0, "global_scaling_weight": 1.0}, True, False, False, {"lora_A": 1, "lora_B": 2}),
    }
)

