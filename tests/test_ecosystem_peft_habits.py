"""peft habits: targets="all-linear", the trainable-parameter summary, ``python -m lora_func``.

The oracle for the first two is peft itself: the same shorthand and the same counts.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer

import lora_func as lf
from tests.models import tiny_model, tokens


def _peft_lora_modules(model: torch.nn.Module, **config) -> tuple[list[str], object]:
    with warnings.catch_warnings():
        # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`; a tied head warns.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True`", category=UserWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)
        wrapped = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, lora_alpha=4, **config))
    names = [n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if isinstance(m, LoraLayer)]
    return names, wrapped


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_all_linear_adapts_what_peft_adapts_and_leaves_the_output_head(kind):
    model = tiny_model(kind)
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets="all-linear", r=2), generator=torch.Generator().manual_seed(0))
    expected, _ = _peft_lora_modules(model, target_modules="all-linear")
    got = [layer.target.module for layer in adapter.layers]
    assert sorted(got) == sorted(expected) and len(got) == (14 if kind == "llama" else 8)
    assert "lm_head" not in got
    # The adapter is applied on every one of them: perturb each B, and each layer's output moves.
    g = torch.Generator().manual_seed(1)
    moved = adapter.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in adapter.params.items()})
    with torch.no_grad():
        assert not torch.allclose(lf.adapted_call(model, moved, tokens()).logits, model(tokens()).logits, atol=1e-3)


def test_all_linear_still_filters_by_layer_types_and_refuses_a_model_without_linears():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="none of layer_types"):
        lf.init_adapter(model, lf.AdapterSpec("lora", targets="all-linear", r=2, layer_types=("linear",)))
    with pytest.raises(ValueError, match=r"targets='all-linear' found no nn.Linear .* in Sequential"):
        lf.init_adapter(torch.nn.Sequential(torch.nn.Embedding(4, 4)), lf.AdapterSpec("lora", targets="all-linear", r=2))


@pytest.mark.parametrize("targets", ["q_proj", ["q_prj"]])
def test_no_match_errors_point_to_all_linear_and_layer_types(targets):
    with pytest.raises(ValueError) as info:
        lf.init_adapter(tiny_model("llama"), lf.AdapterSpec("lora", targets=targets, r=2))
    assert "targets='all-linear'" in str(info.value) and "layer_types=('linear',)" in str(info.value)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_summary_counts_equal_peft_get_nb_trainable_parameters(targets):
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=2), generator=torch.Generator().manual_seed(0))
    _, wrapped = _peft_lora_modules(model, target_modules=targets)
    trainable, total = wrapped.get_nb_trainable_parameters()
    summary = lf.adapter_summary(model, adapter)
    assert (summary.trainable, summary.total) == (trainable, total)
    assert summary.percent == pytest.approx(100 * trainable / total)
    assert str(summary) == f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"


def test_summary_per_layer_composed_and_stacked():
    model = tiny_model("gpt2")  # tied lm_head/wte: counted once, as model.parameters() does
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["c_attn"], r=2))
    ia3 = lf.init_adapter(model, lf.AdapterSpec("ia3", targets=["c_fc"]))
    both = lf.compose(lora, ia3)
    summary = lf.adapter_summary(model, both, per_layer=True)
    n_model = sum(p.numel() for p in model.parameters())
    assert summary.trainable == lora.num_parameters() + ia3.num_parameters()
    assert summary.total == n_model + summary.trainable
    rows = {(row.part, row.module): row for row in summary.layers}
    # c_attn: lora_A (2, 32) + lora_B (96, 2); c_fc: one IA3 vector over the 128 outputs
    assert rows[(0, "transformer.h.0.attn.c_attn")].trainable == 2 * 32 + 96 * 2
    assert rows[(1, "transformer.h.1.mlp.c_fc")].trainable == 128 and rows[(1, "transformer.h.1.mlp.c_fc")].variant == "ia3"
    assert sum(row.trainable for row in summary.layers) == summary.trainable
    text = str(summary).splitlines()
    assert len(text) == 1 + 4 and "[0] transformer.h.0.attn.c_attn" in text[1] and "r=2" in text[1]
    stacked = lf.adapter_summary(model, lf.stack([lora, lora]))
    assert stacked.trainable == lora.num_parameters() and "per member of a stack of (2,)" in str(stacked)
    mixed = lf.adapter_summary(model, lf.combine([lora, lora], [0.5, 0.5]), per_layer=True)
    assert mixed.trainable == 2 * lora.num_parameters() + 2 and mixed.layers[-1].module == "(combine weights)"


def test_summary_names_the_argument_that_is_wrong():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    with pytest.raises(TypeError, match="model must be the nn.Module"):
        lf.adapter_summary(adapter, model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"adapter_summary\(model, adapter\): adapter must be an adapter"):
        lf.adapter_summary(model, adapter.params)  # type: ignore[arg-type]


def test_python_dash_m_lora_func_is_the_cli():
    result = subprocess.run([sys.executable, "-m", "lora_func", "demo", "--variants", "nope"], capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 2 and "unknown variant(s) ['nope']" in result.stderr


@pytest.mark.parametrize("scheme", ["bnb-nf4", "bnb-nf4-double", "bnb-int8", "torchao-nf4"])
def test_summary_counts_quantized_weights_by_their_logical_size_as_peft_does(scheme):
    """A 4-bit weight's storage holds two values per byte: counted by its numel() the base
    looked 4x smaller and the trainable share larger than in peft's print_trainable_parameters."""
    from peft import LoraConfig, get_peft_model

    from tests.peft_io_helpers import peft_warnings
    from tests.quantized_models import float_llama, quantized_llama

    model = quantized_llama(scheme)
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2), generator=torch.Generator().manual_seed(0))
    summary = lf.adapter_summary(model, adapter)
    # The same architecture in float: its parameter count is the quantized model's logical size.
    assert summary.total - summary.trainable == sum(p.numel() for p in float_llama().parameters())
    if scheme.startswith("bnb"):  # peft's count (its formula knows bitsandbytes' Params4bit)
        with peft_warnings():
            wrapped = get_peft_model(quantized_llama(scheme), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        assert (summary.trainable, summary.total) == wrapped.get_nb_trainable_parameters()


def test_summary_notes_a_targets_entry_that_matched_more_than_one_kind_of_module():
    """GPT-2's "c_proj" names the attention output and the MLP output: peft's suffix rule
    adapts both (kept, for peft compatibility), and the summary says so with the fix."""
    model = tiny_model("gpt2")
    both = lf.adapter_summary(model, lf.init_adapter(model, lf.AdapterSpec("lora", targets=["c_proj", "c_attn"], r=2)))
    assert both.broad_targets == (("c_proj", ("transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj")),)
    assert "note: targets entry 'c_proj' adapts 2 kinds of module" in str(both) and "'attn.c_proj'" in str(both)
    one = lf.adapter_summary(model, lf.init_adapter(model, lf.AdapterSpec("lora", targets=["attn.c_proj"], r=2)))
    assert one.broad_targets == () and "note" not in str(one)
    llama = tiny_model("llama")  # q_proj names one kind of module in every layer: no note
    assert lf.adapter_summary(llama, lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_proj"], r=2))).broad_targets == ()
