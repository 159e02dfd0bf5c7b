"""X-LoRA in another dtype than its base (issue 47; a mutation survivor of the classifier's input
cast): a float64 X-LoRA on a float32 tiny Llama runs the routed call (the classifier reads the
model's float32 hidden state), and its logits equal the same adapter's on the float64 copy of the
model, to the float32 model's round-off."""

from __future__ import annotations

import copy

import torch

import lora_func as lf
from lora_func import routed
from tests.bank_oracle import rel
from tests.models import tiny_model, tokens


def test_a_float64_xlora_on_a_float32_model_equals_it_on_the_float64_model():
    model = tiny_model("llama")
    model64 = copy.deepcopy(model).double()
    spec = lf.AdapterSpec("lora", ["q_proj", "v_proj"], r=2, alpha=4.0, dtype=torch.float64)
    g = torch.Generator().manual_seed(9)
    experts = [lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    experts = [a.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in a.params.items()}) for a in experts]
    adapter = routed.xlora(experts, hidden_size=model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = tokens(2, 7, seed=1)
    with torch.no_grad():
        got, want = routed.xlora_call(model, adapter, ids).logits, routed.xlora_call(model64, adapter, ids).logits
        assert got.dtype == torch.float32 and rel(got, want) < 1e-5
        assert (want - model64(ids).logits).abs().max() > 1e-3  # the experts act
