from tests.variant_table import Row


def trainable_tokens_w_eff(p, b, W, bias, info):
    # The listed tokens' rows replaced by the trained copies: an embedding's rows are the columns
    # of its canonical (d, V) view, an output head's the rows of its (d_out, d_in).
    out = W.clone()
    for j, t in enumerate(dict(info.options)["token_indices"]):
        if info.kind == "embedding":
            out[:, t] = p["trainable_tokens_delta"][j]
        else:
            out[t, :] = p["trainable_tokens_delta"][j]
    return out, bias


ROWS = (
    Row(
        variant="trainable_tokens",
        w_eff=trainable_tokens_w_eff,
        step0_nonzero=frozenset({"trainable_tokens_delta"}),
        spec_kwargs={"token_indices": [15, 6, 10]},  # unsorted (a sort would move rows); in every test example
        # three rows of a table move the logits little: a larger step keeps the effect above a
        # bf16 base's own round-off (0.1 moved GPT-2's by 0.45, its bf16 logits err by 0.03)
        perturb_scale=0.5,
    ),
)
