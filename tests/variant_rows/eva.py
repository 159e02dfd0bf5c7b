import math

from tests.variant_table import Row


def eva_w_eff(p, b, W, bias, info):
    # EVA is a LoRA init: W_eff = W + s·B A with the layer's own (possibly redistributed) rank
    # and alpha from its LayerInfo.
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    assert p["lora_A"].shape == (info.r, W.shape[1]) and p["lora_B"].shape == (W.shape[0], info.r)
    return W + s * p["lora_B"] @ p["lora_A"], bias


ROWS = (
    # rho=1.0: every layer computes exactly r components and the budget keeps them all, so no
    # layer is dropped (the contract expects every requested layer to be adapted); rank
    # redistribution and dropping are tested in tests/test_variant_eva.py.
    Row(
        variant="eva",
        w_eff=eva_w_eff,
        step0_nonzero=frozenset({"lora_B"}),
        spec_kwargs={"r": 4, "alpha": 6.0, "rho": 1.0},
        calibration=True,
    ),
)
