from tests.variant_table import Row


def ln_tuning_w_eff(p, b, W, bias, info):
    # The trained copy replaces the layer: its weight, and its bias where the layer has one.
    return p["ln_weight"], p["ln_bias"] if "ln_bias" in p else bias


ROWS = (
    Row(
        variant="ln_tuning",
        w_eff=ln_tuning_w_eff,
        step0_nonzero=frozenset({"ln_weight", "ln_bias"}),
        # an embedding has no bias; on the conv models the conv with a bias (its copy trains both)
        step0_by_kind={"embedding": frozenset({"ln_weight"})},
        targets={"convlm": ["seq"], "gconvlm": ["seq"]},
        # On GPT-2 Conv1D the activation form's F.linear rounds differently from the layer's addmm.
        identity_rtol=1e-6,
    ),
)
