from tests.variant_table import Row


def beft_w_eff(p, buffers, W, bias, info):
    # variants.md (beft): y = base(x) + β, so W_eff = W and b_eff = b + β (the targets have a bias:
    # a bias-free layer has no merged form, tests/test_variant_beft.py).
    return W, bias + p["beft_bias"]


# The default targets (Llama q/v, GPT-2 c_attn) carry a bias; β = 0 at init and gets the output's
# gradient summed over the tokens at step 0.
ROW = Row(variant="beft", w_eff=beft_w_eff, step0_nonzero=frozenset({"beft_bias"}), perturb_scale=0.3)
