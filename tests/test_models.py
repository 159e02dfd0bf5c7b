"""The tiny test models themselves: their attention must not be degenerate, or adapters on
q_proj/k_proj could be wrong without any test noticing."""

from __future__ import annotations

import pytest
import torch

from tests.models import tiny_model, tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_queries_of_the_last_layer_move_the_logits(kind):
    """Scaling the last layer's query weights by 1.1 moves the logits by 1.3e-2 to 3.5e-2 of
    max |logit| at initializer_range=0.2; at the transformers default (0.02) attention scores
    are ~0 and the same change moved them by 1e-6 (GPT-2) to 3e-4 (Qwen2)."""
    model = tiny_model(kind)
    ids = tokens()
    reference = model(ids).logits
    with torch.no_grad():
        if kind == "gpt2":
            model.transformer.h[-1].attn.c_attn.weight[:, :32] *= 1.1  # Conv1D (d_in, 3·d): the query columns
        else:
            model.model.layers[-1].self_attn.q_proj.weight.mul_(1.1)
    moved = (model(ids).logits - reference).abs().max()
    assert moved > 3e-3 * reference.abs().max(), f"{kind}: attention is (nearly) uniform, q/k adapters would go unseen"
