"""LoHa beyond tests/test_variants_structured_a.py and tests/test_kinds_peft.py (peft oracles,
base and adapter in one dtype): an adapter in another dtype than its base on both forms of
the activation path (the rank-r² face-splitting product and the dense update), the rank
dropout's rescale (shared with LoKr), and peft's config checks. Written to kill mutants (tools/mutate.py)."""

from __future__ import annotations

import types

import peft
import pytest
import torch

import lora_func as lf
from lora_func.variants._lycoris import output_keep
from lora_func.variants.loha import uses_face_splitting
from tests.one_layer import one_layer
from tests.variant_checks import assert_config_checks, assert_other_adapter_dtype, saved_bytes


@pytest.mark.parametrize(("r", "face_splitting"), [(1, True), (2, False)])
def test_an_adapter_in_another_dtype_than_the_base_on_each_activation_form(r, face_splitting):
    # a (3, 6) input on a 6 -> 8 layer: r=1 takes the (rows, r²) product, r=2 the dense update
    assert uses_face_splitting(r, 6, 8, 3) is face_splitting
    for dtype in (torch.float64, torch.bfloat16):
        assert_other_adapter_dtype("loha", 6, 8, adapter_dtype=dtype, r=r, alpha=3.0, init="random")


def test_peft_config_checks():
    assert_config_checks("loha", peft.LoHaConfig, {
        "rank_dropout": [-0.1, 1.0, float("nan"), "0.1"], "module_dropout": [-0.1, 1.0, float("inf")],
        "use_effective_conv2d": [1, "yes"], "init_weights": [1, "lycoris", None],
    }, good={"rank_dropout": [0.0, 0.99], "module_dropout": [0.0, 0.5], "init_weights": [True, False]})


def test_rank_dropout_rescales_by_the_kept_fraction_and_an_all_dropped_draw_leaves_zero():
    # peft: rows = rand(d_out) > p, divided by their mean (LoHa always, LoKr with
    # rank_dropout_scale); where every row is dropped peft divides 0 by 0, here the update is 0
    model = one_layer("linear", 6, 8, True, torch.float32, 0)
    adapter = lf.init_adapter(model, lf.AdapterSpec("loha", targets=["proj"], r=2, rank_dropout=0.85))
    info = adapter.layers[0].info
    training = types.SimpleNamespace(training=True)
    seen = set()
    for seed in range(40):
        torch.manual_seed(seed)
        keep = output_keep(training, info, dtype=torch.float64, device=torch.device("cpu"), rescale=True)
        torch.manual_seed(seed)
        assert bool(torch.rand(1) > 0.0)  # module_dropout 0: the whole update is kept
        rows = (torch.rand(8) > 0.85).to(torch.float64)
        want = rows / rows.mean() if rows.any() else rows
        assert keep.dtype == torch.float64 and torch.equal(keep, want), seed
        seen.add(min(int(rows.sum()), 2))
    assert seen == {0, 1, 2}, "the draws must cover no row, one row and several rows kept"
    assert output_keep(types.SimpleNamespace(training=False), info, dtype=torch.float64, device=torch.device("cpu"), rescale=True) is None


def test_the_face_splitting_product_keeps_less_than_the_dense_update_where_it_is_taken():
    # 64 -> 64: r=2 and 4 rows take U V (rank r² = 4), r=8 and 256 rows the dense update; over
    # the base layer's own, the first keeps well under the 64 x 64 update, the second all of it
    model = one_layer("linear", 64, 64, True, torch.float32, 0)
    dense_update = 64 * 64 * 4
    for r, rows, form_bytes in ((2, 4, lambda b: b < dense_update / 2), (8, 256, lambda b: b >= dense_update)):
        assert uses_face_splitting(r, 64, 64, rows) is (rows == 4)
        adapter = lf.init_adapter(model, lf.AdapterSpec("loha", targets=["proj"], r=r, init="random"))
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
        saved = saved_bytes(lambda x=x, a=adapter: lf.adapted_call(model, a, x=x).sum()) - saved_bytes(lambda x=x: model(x=x).sum())
        assert form_bytes(saved), (r, rows, saved)
