"""No silent wrong answer (issue 48): bad inputs that used to give a result are refused, or give
the right one.

Each test here failed on the code before its fix (the commit message of the fix says how): a
file with NaN/inf or without a targeted layer loaded, an index shorter than the batch ran rows
with other rows' adapters, SVD merges gave NaN gradients, a NaN example made every DP-SGD
coordinate NaN, the accountant's inverse never returned, and so on. The refusals' messages
are checked by tests/test_error_catalogue.py; here, what the call does on both sides of the
line: refused where it must be, the same numbers as an independent oracle where it must run.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import lora_func as lf
from lora_func.io import load_peft, save_peft
from lora_func.io._validate import config_targets
from tests.models import tiny_model, tokens


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _trained(model, variant, targets=("q_proj", "v_proj"), seed=0, **options):
    """An adapter of ``variant`` whose tensors are moved off their init (every value matters)."""
    options.setdefault("r", 2)
    adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=list(targets), **options), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(100 + seed)
    return adapter.with_params({k: (v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype)).detach().requires_grad_() for k, v in adapter.params.items()})


def _edit_weights(directory: Path, edit) -> None:
    path = directory / "adapter_model.safetensors"
    save_file(edit(load_file(str(path))), str(path))


# ----------------------------------------------------------------------- files: NaN / inf


@pytest.mark.parametrize("variant", ["lora", "loha", "oft", "vera"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_load_peft_refuses_non_finite_tensors_naming_the_key_and_opts_out_explicitly(llama, tmp_path, variant, value):
    directory = save_peft(_trained(llama, variant), tmp_path / variant, model=llama)
    keys = sorted(load_file(str(directory / "adapter_model.safetensors")))
    culprit = keys[len(keys) // 2]

    def plant(tensors):
        tensors[culprit] = tensors[culprit].clone()
        tensors[culprit].view(-1)[1] = value
        return tensors

    _edit_weights(directory, plant)
    with pytest.raises(ValueError, match="holds non-finite values") as info:
        load_peft(directory, llama)
    assert culprit in str(info.value) and "check_finite=False" in str(info.value)
    assert [k for k in keys if k in str(info.value)] == [culprit]  # only the culprit is named
    loaded = load_peft(directory, llama, check_finite=False)  # the opt-out loads it as it is
    bad = [k for k, v in {**loaded.params, **loaded.buffers}.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert len(bad) == 1 and culprit.rsplit(".", 2)[0].removeprefix("base_model.model.") in bad[0], bad


@pytest.mark.parametrize("value", [float("nan"), -float("inf")])
def test_load_refuses_non_finite_tensors_of_its_own_format(llama, tmp_path, value):
    adapter = _trained(llama, "dora")
    key = "model.layers.1.self_attn.v_proj.lora_B"
    planted = adapter.params[key].detach().clone()
    planted[0, 0] = value
    path = lf.save(adapter.with_params({**adapter.params, key: planted}), tmp_path / "a.safetensors")
    for model in (None, llama):
        with pytest.raises(ValueError, match="holds non-finite values") as info:
            lf.load(path, model=model)
        assert f"non-finite values in ['params/{key}']:" in str(info.value)  # that key only
    again = lf.load(path, model=llama, check_finite=False)
    torch.testing.assert_close(again.params[key].detach(), planted, rtol=0, atol=0, equal_nan=True)
    lf.load(lf.save(adapter, tmp_path / "ok.safetensors"), model=llama)  # a finite file loads


# --------------------------------------------------------------- files: a layer with no tensor


@pytest.mark.parametrize(("variant", "suffix"), [("oft", "oft_R.weight"), ("lora", "lora_"), ("vera", "vera_lambda")])
def test_a_targeted_layer_with_none_of_its_tensors_is_refused_like_a_partial_one(llama, tmp_path, variant, suffix):
    directory = save_peft(_trained(llama, variant), tmp_path / variant, model=llama)
    gone = "model.layers.0.self_attn.q_proj"
    _edit_weights(directory, lambda t: {k: v for k, v in t.items() if not (f"{gone}." in k and suffix in k)})
    with pytest.raises(ValueError, match="holds no tensor for them") as info:
        load_peft(directory, llama)
    assert f"['{gone}']" in str(info.value)


def test_our_format_refuses_a_file_without_one_layers_tensors(llama, tmp_path):
    """A save file lists its layers in its metadata: a layer whose every tensor is gone is missing."""
    path = lf.save(_trained(llama, "oft"), tmp_path / "a.safetensors")
    tensors = load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    save_file({k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj." not in k}, str(tmp_path / "b.safetensors"), metadata=metadata)
    with pytest.raises(ValueError, match="missing tensors") as info:
        lf.load(tmp_path / "b.safetensors")
    assert "model.layers.0.self_attn.q_proj" in str(info.value)


def _peft_checkpoint(model, directory, **config):
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **config))
        peft_model.save_pretrained(directory)
        adapted = sorted(name.removeprefix("base_model.model.") for name, module in peft_model.named_modules() if hasattr(module, "lora_A") and name.endswith("proj"))
        peft_model.unload()
    return adapted


@pytest.mark.parametrize(
    "config",
    [
        {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]},
        {"target_modules": ["q_proj", "v_proj", "down_proj"], "layers_to_transform": 0, "layers_pattern": "layers"},
        {"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["model.layers.0.self_attn.v_proj"]},
        {"target_modules": r".*\.(q|k)_proj", "exclude_modules": r".*layers\.1\..*"},
    ],
    ids=["layers_to_transform", "layers_pattern", "exclude_list", "regex_exclude_regex"],
)
def test_peft_checkpoints_that_adapt_part_of_the_matches_load_and_their_targets_are_peft_s(tmp_path, config):
    """No false alarm: the layers a config targets are the ones peft adapts (its own matching, the
    oracle), and a peft checkpoint of such a config loads with exactly those layers."""
    model = tiny_model("llama")
    adapted = _peft_checkpoint(model, tmp_path / "ckpt", **config)
    saved = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert config_targets(saved, model) == adapted and 0 < len(adapted) < 8
    loaded = load_peft(tmp_path / "ckpt", model)
    assert sorted(layer.target.module for layer in loaded.layers) == adapted


# --------------------------------------------------------------------------------- indices


@pytest.fixture(scope="module")
def tenants(llama):
    return [_trained(llama, "lora", ("q_proj", "v_proj"), seed=s) for s in range(2)]


def test_mixed_adapted_call_refuses_an_index_shorter_than_the_batch(llama, tenants):
    ids = tokens(4)
    with pytest.raises(ValueError, match=r"the batch has 4 rows on dim 0, but len\(index\)=2"):
        lf.mixed_adapted_call(llama, tenants, torch.tensor([0, 1]), ids)
    with pytest.raises(ValueError, match=r"len\(index\)=3"):
        lf.mixed_adapted_call(llama, tenants, torch.tensor([0, 1, 1]), ids)
    assert all("forward" not in vars(m) for m in llama.modules())


def test_rows_per_index_asks_for_the_beam_expansion_explicitly(llama, tenants):
    ids, index = tokens(4), torch.tensor([1, 0])
    got = lf.mixed_adapted_call(llama, tenants, index, ids, rows_per_index=2).logits
    expanded = index.repeat_interleave(2)  # the oracle: one entry per row, rows 0-1 on tenant 1
    torch.testing.assert_close(got, lf.mixed_adapted_call(llama, tenants, expanded, ids).logits, rtol=0, atol=0)
    for row, k in enumerate(expanded.tolist()):
        alone = lf.adapted_call(llama, tenants[k], ids[row : row + 1]).logits[0]
        torch.testing.assert_close(got[row], alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"rows_per_index=3 = 6"):
        lf.mixed_adapted_call(llama, tenants, index, ids, rows_per_index=3)


def test_inside_mixed_adapted_only_generate_expands_the_index(llama, tenants):
    ids, index = tokens(2, 5), torch.tensor([1, 0])
    with torch.no_grad(), lf.mixed_adapted(llama, tenants, index):
        assert "generate" in vars(llama)
        beams = llama.generate(ids, max_new_tokens=3, num_beams=2, num_return_sequences=2, do_sample=False, pad_token_id=0)
        with pytest.raises(ValueError, match=r"the batch has 4 rows on dim 0, but len\(index\)=2"):
            llama(ids.repeat_interleave(2, 0))  # a direct call with twice the rows: not generate's
    assert "generate" not in vars(llama) and all("forward" not in vars(m) for m in llama.modules())
    assert beams.shape == (4, 8)
    for j, k in enumerate(index.tolist()):
        with torch.no_grad(), lf.adapted(llama, tenants[k]):
            alone = llama.generate(ids[j : j + 1], max_new_tokens=3, num_beams=2, num_return_sequences=2, do_sample=False, pad_token_id=0)
        assert torch.equal(beams[2 * j : 2 * j + 2], alone)
    with torch.no_grad(), lf.mixed_adapted(llama, tenants, index, rows_per_index=2):
        doubled = llama(ids.repeat_interleave(2, 0)).logits  # asked for: rows 0-1 with tenant 1
    for row, k in enumerate(index.repeat_interleave(2).tolist()):
        torch.testing.assert_close(doubled[row], lf.adapted_call(llama, tenants[k], ids[row // 2 : row // 2 + 1]).logits[0], rtol=1e-5, atol=1e-5)


def test_mixed_call_needs_one_index_entry_per_example_on_both_routes(llama, tenants):
    stacked = lf.stack(tenants)
    for route in ("layers", "vmap"):
        with pytest.raises(ValueError, match=r"the batch has 4 rows on dim 0, but len\(index\)=2"):
            lf.mixed_call(llama, stacked, torch.tensor([0, 1]), tokens(4), route=route, use_cache=False)


@pytest.mark.parametrize("chunk_size", [0, -1, 1.5, True])
def test_chunk_size_must_be_a_positive_integer(llama, tenants, chunk_size):
    stacked = lf.stack(tenants)
    with pytest.raises(ValueError, match="chunk_size"):
        lf.ensemble_call(llama, stacked, tokens(2), chunk_size=chunk_size)
    with pytest.raises(ValueError, match="chunk_size"):
        lf.per_example_grads(lambda a, x: lf.adapted_call(llama, a, x).logits.sum(), tenants[0], tokens(2), chunk_size=chunk_size)


def test_every_chunk_size_gives_the_ensemble_s_result(llama, tenants):
    stacked = lf.stack([*tenants, tenants[0]])
    whole = lf.ensemble_call(llama, stacked, tokens(2)).logits
    for chunk_size in (1, 2, 3, 5):
        torch.testing.assert_close(lf.ensemble_call(llama, stacked, tokens(2), chunk_size=chunk_size).logits, whole, rtol=0, atol=0)
