"""Bad input: each error names the offending thing and the fix, is raised before any work,
and leaves the model (and the file system) untouched."""

from __future__ import annotations

import re

import pytest
import torch
from torch.func import functional_call

import lora_func as lf
from tests.contract_helpers import assert_unchanged, snapshot
from tests.models import tiny_model, tokens


@pytest.fixture
def llama():
    model = tiny_model("llama")
    snap = snapshot(model)
    yield model
    assert_unchanged(model, snap)


def test_unknown_variant_lists_known_ones():
    with pytest.raises(ValueError, match="unknown adapter variant 'loar'") as err:
        lf.AdapterSpec("loar", targets=["q_proj"])
    for name in lf.list_variants():
        assert name in str(err.value)


def test_target_matching_nothing_lists_close_module_names(llama):
    with pytest.raises(ValueError, match=r"\['q_prj'\] match no module") as err:
        lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_prj", "v_proj"]))
    assert "q_proj" in str(err.value)
    with pytest.raises(ValueError, match="matches no module") as err:
        lf.init_adapter(llama, lf.AdapterSpec("lora", targets=r"q_proj"))  # anchored: needs .*
    assert "must match the whole name" in str(err.value) and "q_proj" in str(err.value)


@pytest.mark.parametrize("targets", [["zzzz"], r".*\.zzzz"], ids=["list", "regex"])
def test_a_target_with_no_close_name_lists_the_layers_that_can_be_adapted(llama, targets):
    with pytest.raises(ValueError) as err:
        lf.init_adapter(llama, lf.AdapterSpec("lora", targets=targets))
    message = str(err.value)
    assert "none" not in message and "no module name is close" in message
    assert "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']" in message


@pytest.mark.parametrize("call", ["unstack", "take"])
def test_unstack_and_take_of_a_non_adapter_name_the_function(llama, call):
    adapter = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    args = (adapter.params,) if call == "unstack" else (adapter.params, 0)
    with pytest.raises(TypeError, match=rf"^{call}\(adapter.*\): expected an Adapter, Composed or Combined, got dict"):
        getattr(lf, call)(*args)


def test_overlay_key_that_is_not_a_model_tensor(llama):
    adapter = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    base = lf.base_params(llama)
    typo = dict(base)
    typo["model.layers.0.self_attn.q_proj.wieght"] = typo.pop("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(KeyError, match=re.escape("['model.layers.0.self_attn.q_proj.wieght'] are not parameters")) as err:
        lf.adapted_call(llama, adapter, tokens(), base=typo)
    assert "model.layers.0.self_attn.q_proj.weight" in str(err.value)
    partial = {k: v for k, v in base.items() if "layers.1" not in k}
    with pytest.raises(KeyError, match="lacks .*base_params"):
        lf.adapted_call(llama, adapter, tokens(), base=partial)
    # the adapter's own targets are checked against the base dict too
    gpt2_base = lf.base_params(tiny_model("gpt2"))
    for make in (lf.overlay, lf.merge_overlay):
        with pytest.raises(KeyError, match=r"adapter targets \[.*q_proj.weight.*\] are not tensors of this model"):
            make(gpt2_base, adapter)


def test_target_of_no_kind_or_of_a_kind_the_variant_refuses(llama):
    with pytest.raises(ValueError, match=r"variant 'hira' cannot adapt \['model.embed_tokens \(embedding\)'\]; hira adapts linear"):
        lf.init_adapter(llama, lf.AdapterSpec("hira", targets=["embed_tokens"]))
    with pytest.raises(ValueError, match=r"self_attn \(LlamaAttention\)'\] are of no kind"):
        lf.init_adapter(llama, lf.AdapterSpec("lora", targets=r".*self_attn"))
    # an explicit layer_types filter keeps only those kinds instead
    adapter = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=r"model\.layers\.0\..*", layer_types=("linear",), r=2))
    assert len(adapter.layers) == 7


@pytest.mark.parametrize("r", [0, -1, 2.0, True])
def test_rank_below_one_or_not_an_integer(r):
    with pytest.raises(ValueError, match=rf"r must be an integer >= 1, got r={r!r}"):
        lf.AdapterSpec("lora", targets=["q_proj"], r=r)


def test_rank_above_min_dims_names_the_layers(llama):
    # q_proj is 32 x 32; k_proj is 32 -> 16 (2 kv heads of 8). PiSSA takes r singular directions
    # of each weight (the rank_within_layer trait); LoRA has no such limit, as in peft (issue 48).
    with pytest.raises(ValueError, match=r"r=17 exceeds min\(d_in, d_out\).*k_proj \(d_in=32, d_out=16\)") as err:
        lf.init_adapter(llama, lf.AdapterSpec("pissa", targets=["q_proj", "k_proj"], r=17))
    assert "q_proj" not in str(err.value)
    lf.init_adapter(llama, lf.AdapterSpec("pissa", targets=["k_proj"], r=16))
    lora = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_proj", "k_proj"], r=17))
    assert dict(lora.layers[1].param_shapes) == {"lora_A": (17, 32), "lora_B": (16, 17)}


def test_unknown_and_mistyped_options():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['use_rs_lora'\] for variant 'lora'; it accepts \['dropout', 'init', 'use_rslora'\]"):
        lf.AdapterSpec("lora", targets=["q_proj"], use_rs_lora=True)
    with pytest.raises(TypeError, match="option use_rslora=1 for variant 'lora' must be a bool"):
        lf.AdapterSpec("lora", targets=["q_proj"], use_rslora=1)
    with pytest.raises(ValueError, match="init='xavier' is not one of"):
        lf.AdapterSpec("lora", targets=["q_proj"], init="xavier")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        lf.AdapterSpec("lora", targets="q_proj(")
    with pytest.raises(TypeError, match="floating dtype"):
        lf.AdapterSpec("lora", targets=["q_proj"], dtype=torch.int8)


def test_loading_onto_a_model_with_different_target_shapes(llama, tmp_path):
    adapter = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    path = lf.save(adapter, tmp_path / "a.safetensors")
    wider = tiny_model("llama")
    wider_config = wider.config
    wider_config.hidden_size, wider_config.intermediate_size = 48, 64
    from transformers import LlamaForCausalLM

    wider = LlamaForCausalLM(wider_config)
    with pytest.raises(ValueError, match=r"does not fit LlamaForCausalLM.*q_proj.weight: adapter built for \(32, 32\), model has \(32, 48\)"):
        lf.load(path, model=wider)
    with pytest.raises(ValueError, match=r"adapter does not fit this model's target shapes"):
        lf.adapted_call(wider, adapter, tokens())


def test_stacked_adapter_outside_vmap_says_how_to_use_it(llama):
    adapter = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    stacked = lf.stack([adapter, adapter])
    with pytest.raises(ValueError, match="stacked: call it under torch.func.vmap"):
        lf.adapted_call(llama, stacked, tokens())
    with pytest.raises(ValueError, match="not stacked"):
        lf.take(adapter, 0)


def test_stack_refuses_different_targets_variants_and_kinds(llama):
    a = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    b = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["v_proj"], r=2))
    c = lf.init_adapter(llama, lf.AdapterSpec("dora", targets=["q_proj"], r=2))
    with pytest.raises(ValueError, match=r"adapter 1 has spec .* only adapters of one variant, targets"):
        lf.stack([a, b])
    with pytest.raises(ValueError, match=r"adapter 1 has spec .*variant='dora'"):
        lf.stack([a, c])
    with pytest.raises(TypeError, match=r"mixed kinds \['Adapter', 'Composed'\]"):
        lf.stack([a, lf.compose(a)])
    with pytest.raises(ValueError, match="is itself stacked"):
        lf.stack([a, lf.stack([a, a])])


def test_with_params_lists_missing_and_unexpected_keys(llama):
    adapter = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    params = dict(adapter.params)
    key = sorted(params)[0]
    params[key + "x"] = params.pop(key)
    with pytest.raises(KeyError, match=re.escape(f"missing keys ['{key}'], unexpected keys ['{key}x']")):
        adapter.with_params(params)
    with pytest.raises(AttributeError, match="immutable"):
        adapter.params = {}


def test_tied_weight_target_is_refused_by_default():
    gpt2 = tiny_model("gpt2")
    snap = snapshot(gpt2)
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to \['transformer.wte.weight'\].*tied='both'"):
        lf.init_adapter(gpt2, lf.AdapterSpec("lora", targets=["lm_head"]))
    assert_unchanged(gpt2, snap)


def test_bad_files(llama, tmp_path):
    adapter = lf.init_adapter(llama, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    path = lf.save(adapter, tmp_path / "a.safetensors")
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        lf.load(truncated)
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match="is not a lora_func adapter file"):
        lf.load(foreign)
    with pytest.raises(FileNotFoundError, match="no adapter file at"):
        lf.load(tmp_path / "missing.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "foreign.safetensors", "truncated.safetensors"]


def test_functional_call_on_lazy_overlay_with_strict_fallback_refused():
    gpt2 = tiny_model("gpt2")
    adapter = lf.init_adapter(gpt2, lf.AdapterSpec("lora", targets=["lm_head"], tied="both", r=2))
    over = lf.overlay(lf.base_params(gpt2), adapter, lazy_only=True)
    with pytest.raises(RuntimeError, match=r"embedding on adapted weight\(s\) \['lm_head.weight'\].*merge_overlay"):
        functional_call(gpt2, over, (tokens(),))
