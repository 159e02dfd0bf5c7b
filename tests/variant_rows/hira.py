from tests.variant_table import Row


def hira_w_eff(p, buffers, W, bias, info):
    # variants.md (hira): W_eff = W ⊙ (1 + B A), no scale; bias unchanged.
    return W * (1 + p["hira_B"] @ p["hira_A"]), bias


ROWS = (
    Row(
        variant="hira",
        w_eff=hira_w_eff,
        step0_nonzero=frozenset({"hira_B"}),
        spec_kwargs={"r": 4},
        perturb_scale=0.3,
    ),
)
