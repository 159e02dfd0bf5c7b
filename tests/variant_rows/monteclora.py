import math

from tests.variant_table import Row


def monteclora_w_eff(p, b, W, bias, info):
    # Outside training MonteCLoRA is LoRA (the sampling of A in training steps and its priors are
    # checked against peft in tests/test_variant_monteclora.py)
    s = info.alpha / (math.sqrt(info.r) if dict(info.options)["use_rslora"] else info.r)
    return W + s * p["lora_B"] @ p["lora_A"], bias


ROWS = (
    Row(
        variant="monteclora",
        w_eff=monteclora_w_eff,
        step0_nonzero=frozenset({"lora_B"}),
        spec_kwargs={"r": 4, "alpha": 6.0, "num_samples": 3},
        training_only=frozenset({"monteclora_std_prior", "monteclora_expert_weights_prior"}),
    ),
)
