"""C3A beyond tests/test_variants_structured_c.py (peft oracles, base and adapter in one
dtype): an adapter in another dtype than its base (wider, narrower) on both overlays, peft's
config checks, peft's seeded init draws, the block-size error and the Conv1D refusal. Written
to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import peft
import pytest
import torch

import lora_func as lf
from lora_func.io import peft_problems
from tests.models import tiny_model
from tests.one_layer import one_layer
from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype


def test_an_adapter_in_another_dtype_than_the_base():
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("c3a", 6, 8, adapter_dtype=dtype, r=2, init="gaussian")


def test_peft_config_checks():
    assert_config_checks("c3a", peft.C3AConfig, {
        "block_size": [0, 2.0, True], "block_size_pattern": [{"q": 0}, [2]], "init_weights": ["ones", 1, "zeros"],
    }, good={"block_size": [1, 64], "block_size_pattern": [{}, {"q": 4}], "init_weights": [True, False, "gaussian", "xavier_uniform", "kaiming_uniform"]},
       peft_defaults={"init": "xavier_uniform"})  # C3AConfig's default init_weights; lora_func's default is zeros (the identity)


def _peft_kernel(d_in: int, d_out: int, block: int, init, seed: int) -> torch.Tensor:
    base = one_layer("linear", d_in, d_out, True, torch.float32, 0)
    torch.manual_seed(seed)  # peft's init draws from the global generator
    pm = peft.get_peft_model(base, peft.C3AConfig(target_modules=["proj"], block_size=block, init_weights=init))
    return next(p for n, p in pm.named_parameters() if "c3a_kernel" in n).detach()


@pytest.mark.parametrize("init", ["xavier_uniform", "kaiming_uniform", "gaussian"])
def test_a_seeded_init_draws_peft_kernel_bit_for_bit(init):
    # d_in != d_out, so a bound that mixes them up (xavier: both, kaiming: d_in) shows
    model = one_layer("linear", 8, 12, True, torch.float32, 0)
    adapter = lf.init_adapter(model, lf.AdapterSpec("c3a", targets=["proj"], r=4, init=init), generator=torch.Generator().manual_seed(7))
    kernel = adapter.params["proj.c3a_kernel"].detach()
    assert kernel.shape == (3, 2, 4)
    assert torch.equal(kernel, _peft_kernel(8, 12, 4, init, 7))
    assert float(kernel.min()) < 0 < float(kernel.max())


def test_peft_init_weights_read_and_written_as_peft_means_them():
    from lora_func.io._peft_config import config_of
    from tests.variant_checks import read_options

    fmt = lf.variants.peft_format("c3a")
    # peft: True keeps the zeros (the identity), False means xavier_uniform, a name that init
    assert read_options("c3a", {"init_weights": True}) == {"init": "zeros"}
    assert read_options("c3a", {"init_weights": False}) == {"init": "xavier_uniform"}
    for init in ("zeros", "xavier_uniform", "kaiming_uniform", "gaussian"):
        written = config_of(lf.get_variant("c3a"), fmt, {"init": init})
        assert written == {**fmt.method.fixed, "init_weights": True if init == "zeros" else init}
        assert read_options("c3a", written) == {"init": init}


@pytest.mark.parametrize(("d_in", "d_out", "r", "largest"), [(32, 48, 5, 16), (32, 48, 32, 16), (48, 32, 3, 16), (5, 7, 2, 1)])
def test_a_block_size_must_divide_both_sides_and_the_error_names_the_largest_that_does(d_in, d_out, r, largest):
    # r=32 divides d_in only, r=3 d_in only (of 48, 32): each side is checked
    model = one_layer("linear", d_in, d_out, True, torch.float32, 0)
    with pytest.raises(ValueError, match=rf"c3a: r={r} \(peft's block_size\) must divide d_in={d_in} and d_out={d_out}; the largest that does is r={largest}$"):
        lf.init_adapter(model, lf.AdapterSpec("c3a", targets=["proj"], r=r))


def test_peft_refuses_conv1d_lora_func_adapts_it_and_save_peft_says_so():
    """Keeps docs/variants.md's table honest: peft 0.21 refuses C3A on GPT-2 Conv1D."""
    with pytest.raises((TypeError, ValueError)):
        peft.get_peft_model(tiny_model("gpt2"), peft.C3AConfig(target_modules=["c_attn"], block_size=4))
    adapter = lf.init_adapter(tiny_model("gpt2"), lf.AdapterSpec("c3a", targets=["c_attn"], r=4))
    assert {layer.target.layout for layer in adapter.layers} == {"conv1d"}
    assert lf.variants.peft_format("c3a").conv1d is False
    assert any("Conv1D" in problem for problem in peft_problems(adapter))
