"""X-LoRA's edges (issue 47; killers of mutation survivors, in a file of their own beside
tests/test_routed_xlora.py): a float64 X-LoRA on a float32 tiny Llama (the classifier reads the
model's float32 hidden state) equals it on the float64 copy of the model, to the float32 model's
round-off; one expert with the classifier's softmax is that LoRA; ``xlora()`` without
``top_k_lora`` mixes every expert; the expert library's errors name what differs."""

from __future__ import annotations

import copy

import peft

import pytest
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


def _experts(model, ranks, dtype=torch.float32):
    g = torch.Generator().manual_seed(9)
    out = []
    for s, r in enumerate(ranks):
        a = lf.init_adapter(model, lf.AdapterSpec("lora", ["q_proj", "v_proj"], r=r, alpha=4.0, dtype=dtype), generator=torch.Generator().manual_seed(s))
        out.append(a.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in a.params.items()}))
    return out


def test_one_expert_is_its_lora_and_every_expert_mixes_by_default():
    model, ids = tiny_model("llama"), tokens(2, 7, seed=2)
    one, two = _experts(model, [2]), _experts(model, [2, 2])
    hidden = model.config.hidden_size
    with torch.no_grad():
        # a softmax over one expert is 1: the routed call is the expert's own LoRA
        got = routed.xlora_call(model, routed.xlora(one, hidden_size=hidden), ids).logits
        assert rel(got, lf.adapted_call(model, one[0], ids).logits) < 1e-6
        # top_k_lora left out (peft's None): every expert, as keeping the top 2 of 2
        every = routed.xlora_call(model, routed.xlora(two, hidden_size=hidden, generator=torch.Generator().manual_seed(3)), ids).logits
        top2 = routed.xlora_call(model, routed.xlora(two, hidden_size=hidden, top_k_lora=2, generator=torch.Generator().manual_seed(3)), ids).logits
        top1 = routed.xlora_call(model, routed.xlora(two, hidden_size=hidden, top_k_lora=1, generator=torch.Generator().manual_seed(3)), ids).logits
    assert torch.equal(every, top2) and (every - top1).abs().max() > 1e-4
    # one target: the classifier's layer count is 1
    g = torch.Generator().manual_seed(5)
    single = lf.init_adapter(model, lf.AdapterSpec("lora", ["layers.1.self_attn.v_proj"], r=2), generator=torch.Generator().manual_seed(6))
    single = single.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in single.params.items()})
    with torch.no_grad():
        got = routed.xlora_call(model, routed.xlora([single], hidden_size=hidden), ids).logits
        assert len(single.layers) == 1 and rel(got, lf.adapted_call(model, single, ids).logits) < 1e-6


def test_a_one_target_xlora_saves_and_loads(tmp_path):
    """save_xlora into a directory that does not exist yet (nested) and again into the same one;
    load_xlora gives the same logits, its classifier tensors trainable leaves, as init's."""
    model, ids = tiny_model("llama"), tokens(2, 5, seed=2)
    single = lf.init_adapter(model, lf.AdapterSpec("lora", ["layers.1.self_attn.v_proj"], r=2), generator=torch.Generator().manual_seed(6))
    single = single.with_params({k: v + 0.3 for k, v in single.params.items()})
    adapter = routed.xlora([single, single], hidden_size=model.config.hidden_size, xlora_depth=2, xlora_size=3)
    routed.save_xlora(adapter, tmp_path / "a" / "b")
    back = routed.load_xlora(routed.save_xlora(adapter, tmp_path / "a" / "b"), model)
    assert all(t.requires_grad and t.is_leaf for k, t in back.params.items() if "classifier" in k)
    with torch.no_grad():
        assert rel(routed.xlora_call(model, back, ids).logits, routed.xlora_call(model, adapter, ids).logits) < 1e-6


def test_the_expert_library_errors_name_what_differs():
    model = tiny_model("llama")
    (lora,) = _experts(model, [2])
    with pytest.raises(TypeError, match=r"experts\[1\] must be a plain LoRA adapter .*got a lora adapter stacked \(2,\)"):
        routed.xlora([lora, lf.stack([lora, lora])], hidden_size=model.config.hidden_size)
    # another rank on every layer: the first three differing layers, each as (module, r, d_in, d_out)
    other = _experts(model, [3])[0]
    with pytest.raises(ValueError, match="other layers, ranks or dtype") as err:
        routed.xlora([lora, other], hidden_size=model.config.hidden_size)
    mine = [(layer.target.module, 3, layer.info.d_in, layer.info.d_out) for layer in other.layers]
    assert len(mine) == 4 and all(str(m) in str(err.value) for m in mine[:3]) and str(mine[3]) not in str(err.value)


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_the_last_hidden_state_with_and_without_an_output_head():
    """The classifier reads the output head's input (no ``output_hidden_states``, which would leave
    transformers' hooks on the model's layers); a model without a head (a bare ``LlamaModel``)
    gives the same scalings from its last hidden state; ``logits_to_keep`` restricts the logits,
    never the scalings pass."""
    lm = tiny_model("llama")
    bare = lm.model  # the same weights, no head
    ids = tokens(2, 7, seed=3)
    xl, xb = (routed.xlora(_experts(m, [2, 2]), hidden_size=lm.config.hidden_size, generator=torch.Generator().manual_seed(4)) for m in (lm, bare))
    with torch.no_grad():
        full = routed.xlora_call(lm, xl, ids).logits
        assert _hooks(lm) == 0
        last = routed.xlora_call(lm, xl, ids, logits_to_keep=1).logits
        assert last.shape[1] == 1 and rel(last, full[:, -1:]) < 1e-6
        assert rel(routed.xlora_scalings(bare, xb, ids), routed.xlora_scalings(lm, xl, ids)) < 1e-6


def test_the_entry_points_name_what_they_were_given():
    model = tiny_model("llama")
    lora, other = _experts(model, [2, 2])
    adapter = routed.xlora([lora, other], hidden_size=model.config.hidden_size)
    ids = tokens(2, 5, seed=1)
    with pytest.raises(TypeError, match=r"must be one xlora adapter .*got a lora adapter, stack_shape \(\)"):
        routed.xlora_call(model, lora, ids)
    with pytest.raises(TypeError, match=r"must be one xlora adapter .*got str"):
        routed.xlora_classifier_keys("adapter")
    with pytest.raises(TypeError, match=r"must be a stack of xlora adapters .*got a xlora adapter, stack_shape \(\)"):
        routed.xlora_call(model, adapter, ids, index=torch.tensor([0, 1]))
    # an int32 row index is an index (as int64)
    stack = lf.stack([adapter, adapter])
    with torch.no_grad():
        assert torch.equal(routed.xlora_call(model, stack, ids, index=torch.tensor([1, 0], dtype=torch.int32)).logits,
                           routed.xlora_call(model, stack, ids, index=torch.tensor([1, 0])).logits)
    # a stack's classifier keys are its members'
    assert routed.xlora_classifier_keys(lf.stack([adapter, adapter])) == routed.xlora_classifier_keys(adapter) != []


@pytest.mark.parametrize(("depth", "dropout"), [(3, 0.0), (3, 0.2), (1, 0.0)])
def test_classifier_keys_are_peft_s_sequential_indices(depth, dropout):
    """The classifier's layers in peft's files are its ``nn.Sequential``'s Linear indices (a
    Dropout between them only where ``xlora_dropout_p > 0``): peft's own classifier is the oracle."""
    from peft.tuners.xlora.classifier import XLoraClassifier

    model = torch.nn.Linear(4, 4)
    config = peft.XLoraConfig(task_type="CAUSAL_LM", hidden_size=4, adapters={"0": "a"}, xlora_depth=depth, xlora_size=3, xlora_dropout_p=dropout)
    peft_layers = XLoraClassifier(model, config, n_classes=2, n_layers=1, device=torch.device("cpu")).layers
    want = [i for i, layer in enumerate(peft_layers) if isinstance(layer, torch.nn.Linear)]
    assert routed._classifier_index(depth, dropout) == want


def test_expert_paths_relative_to_the_checkpoint_or_to_the_caller(tmp_path, monkeypatch):
    """A config naming its experts by paths relative to its directory loads from any working
    directory; ``adapters=`` paths are the caller's (relative to the working directory)."""
    import json

    model = tiny_model("llama")
    adapter = routed.xlora(_experts(model, [2, 2]), hidden_size=model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    directory = routed.save_xlora(adapter, tmp_path / "ckpt")
    config = json.loads((directory / "adapter_config.json").read_text())
    config["adapters"] = {k: k for k in config["adapters"]}  # "0" -> "0": relative to the checkpoint
    (directory / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    ids = tokens(2, 5, seed=1)
    with torch.no_grad():
        want = routed.xlora_call(model, adapter, ids).logits
        assert rel(routed.xlora_call(model, routed.load_xlora(directory, model), ids).logits, want) < 1e-6
        monkeypatch.chdir(tmp_path)
        by_caller = routed.load_xlora(directory, model, adapters=["ckpt/0", "ckpt/1"])
        assert rel(routed.xlora_call(model, by_caller, ids).logits, want) < 1e-6


def test_init_draws_are_nn_linear_s_and_lora_s():
    """The classifier's layers as ``nn.Linear``'s default init (kaiming-uniform ``a = √5``, the
    bias uniform in ``±1/√fan_in``), a depth-2 classifier's shapes, and each expert's ``A`` as
    LoRA's kaiming draw (``B = 0``)."""
    from tests.variant_checks import assert_kaiming

    model = tiny_model("llama")
    spec = lf.AdapterSpec("xlora", ["q_proj", "v_proj"], r=8, num_experts=2, hidden_size=32, xlora_depth=2, xlora_size=64, layerwise_scalings=True,
                         dtype=torch.float64)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    assert all(t.dtype == torch.float64 for t in [*adapter.params.values(), *adapter.buffers.values()])  # the adapter dtype
    shared = adapter.shared_tensors()[0]
    assert shared["classifier_0_weight"].shape == (64, 32) and shared["classifier_1_weight"].shape == (2 * 4, 64) and "classifier_2_weight" not in shared
    for i, fan_in in ((0, 32), (1, 64)):
        assert_kaiming(shared[f"classifier_{i}_weight"], fan_in, f"classifier_{i}_weight")
        bias, bound = shared[f"classifier_{i}_bias"], fan_in**-0.5
        assert bias.abs().max() <= bound and (i == 1 or (bias.max() > 0.8 * bound and bias.min() < -0.8 * bound)), i  # (8 draws in layer 1)
    for layer in adapter.layers:
        assert_kaiming(adapter.params[f"{layer.target.module}.lora_A"], layer.info.d_in, layer.target.module)
        assert not adapter.params[f"{layer.target.module}.lora_B"].any()


def test_option_defaults_are_peft_s_xlora_config_defaults():
    """Each option with a peft field defaults to XLoraConfig's default (top_k_lora: peft's None is
    0, every expert)."""
    import dataclasses

    fields = {f.name: f.default for f in dataclasses.fields(peft.XLoraConfig)}
    variant = lf.get_variant("xlora")
    checked = []
    for name, option in variant.options.items():
        if option.peft is None or name == "hidden_size":  # (hidden_size: peft's None, required)
            continue
        want = 0 if name == "top_k_lora" and fields[option.peft] is None else fields[option.peft]
        assert variant.default_options[name] == want, (name, variant.default_options[name], want)
        checked.append(name)
    assert len(checked) >= 10, checked
