"""OFT beyond tests/test_variants_structured_b.py and tests/test_orthogonal.py (peft oracles,
the Cayley–Neumann series, the dropout's draws): module dropout only in a training step's
lazy path (never in eval mode, never in the merged weight), and peft's config checks. Written
to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import peft
import torch

import lora_func as lf
from tests.one_layer import one_layer, perturbed
from tests.variant_checks import assert_config_checks


def test_module_dropout_acts_only_on_a_training_steps_lazy_path():
    model = one_layer("linear", 8, 8, True, torch.float32, 0)
    spec = lf.AdapterSpec("oft", targets=["proj"], oft_block_size=2, module_dropout=0.5, init="random")
    adapter = perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1)), seed=2, scale=0.5)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = lf.adapted_call(model.eval(), adapter, x=x)
        assert float((plain - model(x=x)).abs().max()) > 1e-2, "the adapter must act"
        lazy_train = set()
        for seed in range(6):
            for merged in (False, True):
                torch.manual_seed(seed)
                evaluated = lf.adapted_call(model.eval(), adapter, x=x, merged=merged)
                torch.manual_seed(seed)
                got = lf.adapted_call(model.train(), adapter, x=x, merged=merged)
                for out in (evaluated, got) if merged else (evaluated,):
                    # the merged weight: the same rotation, another order of round-off
                    torch.testing.assert_close(out, plain, rtol=0, atol=1e-6 * float(plain.abs().max()), msg=f"{seed} {merged}")
                if not merged:
                    assert torch.equal(evaluated, plain)
                    lazy_train.add(tuple(got.flatten().tolist()))
            model.eval()
    # 2 of the 4 blocks dropped per step, at positions drawn anew: the outputs differ per seed
    assert len(lazy_train) > 1 and tuple(plain.flatten().tolist()) not in lazy_train


def test_peft_config_checks():
    assert_config_checks("oft", peft.OFTConfig, {
        "r": [-1, 1.5, True], "oft_block_size": [-1, 2.0, False], "block_share": [1], "coft": [0],
        "eps": [0, -0.1, float("nan"), "1"], "use_cayley_neumann": [1], "num_cayley_neumann_terms": [0, 1.5, True],
        "module_dropout": [-0.1, 1.0, float("inf")], "init_weights": [1, None],
    }, good={"r": [0, 4], "oft_block_size": [0, 32], "eps": [1e-9, 0.5], "num_cayley_neumann_terms": [1, 5], "module_dropout": [0.0, 0.99]})
