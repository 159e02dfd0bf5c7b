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
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import lora_func as lf
from lora_func.io import load_peft, save_peft
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


def test_a_prompt_file_with_nan_is_refused_in_both_formats(llama, tmp_path):
    """The prompt family (lora_func.prompts) loads through the same two calls: the same check."""
    prompt = lf.init_prompt(llama, lf.PromptSpec("prompt_tuning", 3), generator=torch.Generator().manual_seed(0))
    prompt = prompt.with_params({k: v.detach().clone().fill_(float("nan")).requires_grad_() for k, v in prompt.params.items()})
    path = lf.save(prompt, tmp_path / "prompt.safetensors")
    with pytest.raises(ValueError, match="holds non-finite values"):
        lf.load(path, model=llama)
    assert not torch.isfinite(next(iter(lf.load(path, model=llama, check_finite=False).params.values()))).any()
    directory = lf.save_peft(prompt, tmp_path / "peft")
    with pytest.raises(ValueError, match="holds non-finite values"):
        load_peft(directory, llama)


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
    from lora_func.io._validate import config_targets

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


def test_mixed_call_refuses_an_index_shorter_than_the_batch(llama, tenants):
    ids = tokens(4)
    with pytest.raises(ValueError, match=r"the batch has 4 rows on dim 0, but len\(index\)=2"):
        lf.mixed_call(llama, tenants, torch.tensor([0, 1]), ids, batching="layers")
    with pytest.raises(ValueError, match=r"len\(index\)=3"):
        lf.mixed_call(llama, tenants, torch.tensor([0, 1, 1]), ids, batching="layers")
    assert all("forward" not in vars(m) for m in llama.modules())


def test_rows_per_index_asks_for_the_beam_expansion_explicitly(llama, tenants):
    ids, index = tokens(4), torch.tensor([1, 0])
    got = lf.mixed_call(llama, tenants, index, ids, rows_per_index=2, batching="layers").logits
    expanded = index.repeat_interleave(2)  # the oracle: one entry per row, rows 0-1 on tenant 1
    torch.testing.assert_close(got, lf.mixed_call(llama, tenants, expanded, ids, batching="layers").logits, rtol=0, atol=0)
    for row, k in enumerate(expanded.tolist()):
        alone = lf.adapted_call(llama, tenants[k], ids[row : row + 1]).logits[0]
        torch.testing.assert_close(got[row], alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"rows_per_index=3 = 6"):
        lf.mixed_call(llama, tenants, index, ids, rows_per_index=3, batching="layers")


def test_inside_mixed_adapted_only_generate_expands_the_index(llama, tenants):
    ids, index = tokens(2, 5), torch.tensor([1, 0])
    with torch.no_grad(), lf.mixed_adapted(llama, tenants, index):
        with pytest.raises(ValueError, match=r"the batch has 4 rows on dim 0, but len\(index\)=2"):
            llama(ids.repeat_interleave(2, 0))  # a direct call with twice the rows: not generate's
        beams = llama.generate(ids, max_new_tokens=3, num_beams=2, num_return_sequences=2, do_sample=False, pad_token_id=0)
        with pytest.raises(ValueError, match=r"the batch has 4 rows on dim 0, but len\(index\)=2"):
            llama(ids.repeat_interleave(2, 0))  # and after generate (its row counts are not cached for others)
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


def test_per_row_prompts_refuse_an_index_shorter_than_the_batch_too(llama):
    prompts = [lf.init_prompt(llama, lf.PromptSpec("prompt_tuning", 3), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    ids = tokens(4)
    with pytest.raises(ValueError, match=r"the batch has 4 rows on dim 0, but len\(index\)=2"):
        lf.mixed_call(llama, prompts, torch.tensor([0, 1]), ids, batching="layers")
    got = lf.mixed_call(llama, prompts, torch.tensor([1, 0]), ids, rows_per_index=2, batching="layers").logits
    torch.testing.assert_close(got, lf.mixed_call(llama, prompts, torch.tensor([1, 1, 0, 0]), ids, batching="layers").logits, rtol=0, atol=0)


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


# --------------------------------------------------------------------------------- merging


@pytest.fixture(scope="module")
def loras64(llama):
    """Two distinct LoRAs of rank 2 on q_proj/v_proj in float64, and a float64 base."""
    adapters = [_trained(llama, "lora", ("q_proj", "v_proj"), seed=s, dtype=torch.float64) for s in (1, 2)]
    adapters = [a.with_params({k: (3 * v).detach() for k, v in a.params.items()}) for a in adapters]
    base = {k: v.double() for k, v in lf.base_params(llama).items()}
    return adapters, base


def _probe_loss(merged, base, probes, factors=True):
    """A loss of the merged LoRA: through the weights it makes (any adapter's meaning: B A), and,
    with ``factors``, through A and B themselves (what the factors' own gauge decides)."""
    weights = lf.merge_overlay(base, merged)
    loss = sum((weights[key] * p).sum() for key, p in probes["weights"].items())
    if factors:
        loss = loss + sum((t[..., :1, :] ** 3 * probes["factors"][k][..., :1, :]).sum() for k, t in merged.params.items())
    return loss


def _probes(base, merged):
    g = torch.Generator().manual_seed(5)
    weights = {f"{layer.target.module}.weight": torch.randn(base[f"{layer.target.module}.weight"].shape, generator=g, dtype=torch.float64) for layer in merged.layers}
    return {"weights": weights, "factors": {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in merged.params.items()}}


MERGES = {
    # name: (merge of (adapters, weights), whether the factors are differentiable: distinct top singular values and a gap)
    "svd of one LoRA twice, rank 2 = rank of the sum": (lambda ad, w, base: lf.merge_adapters([ad[0], ad[0]], w, method="svd", rank=2), True),
    "svd, rank 3 < rank 4 of the sum": (lambda ad, w, base: lf.merge_adapters(ad[:2], w, method="svd", rank=3), True),
    "svd, rank 6 > rank 4 of the sum": (lambda ad, w, base: lf.merge_adapters(ad[:2], w, method="svd", rank=6), False),
    "cat, rank 3": (lambda ad, w, base: lf.merge_adapters(ad[:2], w, method="cat", rank=3), True),
    "ties, rank 5": (lambda ad, w, base: lf.merge_adapters(ad[:2], w, method="ties", density=0.5, rank=5, base=base), True),
    "linear of a dora, rank 3": (lambda ad, w, base: lf.merge_adapters([ad[0], ad[2]], w, method="linear", rank=3, base=base), True),
}


@pytest.mark.parametrize("case", list(MERGES))
def test_rank_k_merges_have_finite_gradients_equal_to_finite_differences(llama, loras64, case):
    adapters, base = loras64
    adapters = [*adapters, _trained(llama, "dora", ("q_proj", "v_proj"), seed=3, dtype=torch.float64).detach()]
    merge, factors = MERGES[case]
    w0 = torch.tensor([0.7, -0.4], dtype=torch.float64)
    probes = _probes(base, merge(adapters, w0, base))

    def loss(w):
        return _probe_loss(merge(adapters, w, base), base, probes, factors)

    grad = torch.func.grad(loss)(w0)
    assert torch.isfinite(grad).all() and grad.abs().min() > 1e-3, grad
    eps = 1e-6
    fd = torch.stack([(loss(w0 + eps * e) - loss(w0 - eps * e)) / (2 * eps) for e in torch.eye(2, dtype=torch.float64)])
    torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-8)


def test_to_lora_has_finite_gradients_equal_to_finite_differences(llama, loras64):
    """to_lora's gradient w.r.t. the adapter's own tensors, along a random direction."""
    adapter = _trained(llama, "lora", ("q_proj", "v_proj"), seed=4, r=4, dtype=torch.float64).detach()
    params = {k: v.detach() for k, v in adapter.params.items()}
    base = loras64[1]
    probes = _probes(base, lf.to_lora(adapter, rank=2).adapter)

    def loss(p):
        return _probe_loss(lf.to_lora(adapter.with_params(p), rank=2).adapter, base, probes)

    grads = torch.func.grad(loss)(params)
    assert all(torch.isfinite(g).all() for g in grads.values())
    g = torch.Generator().manual_seed(9)
    direction = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}
    eps = 1e-6
    fd = (loss({k: v + eps * direction[k] for k, v in params.items()}) - loss({k: v - eps * direction[k] for k, v in params.items()})) / (2 * eps)
    along = sum((grads[k] * direction[k]).sum() for k in params)
    torch.testing.assert_close(along, fd, rtol=1e-6, atol=0)


def test_svd_merge_of_loras_in_float32_has_finite_gradients(llama):
    """The case the trial found: float32 LoRAs, rank=k merge and to_lora, backward: NaN before."""
    adapters = [_trained(llama, "lora", ("q_proj",), seed=s) for s in (1, 2)]
    w = torch.tensor([0.5, 0.7], requires_grad=True)
    merged = lf.merge_adapters(adapters, w, method="svd", rank=2)
    sum(v.square().sum() for v in merged.params.values()).backward()
    assert torch.isfinite(w.grad).all() and w.grad.abs().min() > 0
    single = adapters[0].detach().with_params({k: v.detach().requires_grad_() for k, v in adapters[0].params.items()})
    loss = sum(v.square().sum() for v in lf.to_lora(single, rank=1).adapter.params.values())
    grads = torch.autograd.grad(loss, list(single.params.values()))
    assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in grads)


def test_rank_k_merge_under_vmap_equals_the_loop(loras64):
    adapters, _ = loras64
    ws = torch.tensor([[0.7, -0.4], [1.0, 0.5], [0.2, 0.9]], dtype=torch.float64)
    batched = torch.func.vmap(lambda w: lf.merge_adapters(adapters, w, method="svd", rank=3).params)(ws)
    for i in range(3):
        one = lf.merge_adapters(adapters, ws[i], method="svd", rank=3).params
        for key in one:
            torch.testing.assert_close(batched[key][i], one[key], rtol=1e-10, atol=1e-12)


def test_weights_as_a_list_of_tensors_keep_their_gradient(llama, loras64):
    adapters, _ = loras64
    for method in ("linear", "ties"):
        tensor = torch.tensor([0.7, -0.4], dtype=torch.float64, requires_grad=True)
        listed = [torch.tensor(0.7, dtype=torch.float64, requires_grad=True), torch.tensor(-0.4, dtype=torch.float64, requires_grad=True)]
        for weights in (tensor, listed):
            merged = lf.merge_adapters(adapters, weights, method=method, density=0.5 if method == "ties" else None)
            sum(v.sum() for v in merged.params.values()).backward()
        torch.testing.assert_close(torch.stack([w.grad for w in listed]), tensor.grad, rtol=0, atol=0)
        assert tensor.grad.abs().min() > 0
    # combine takes its weights the same way
    listed = [torch.tensor(0.5, requires_grad=True), torch.tensor(0.25, requires_grad=True)]
    floats = [_trained(llama, "lora", seed=s) for s in (1, 2)]
    lf.adapted_call(llama, lf.combine(floats, listed), tokens()).logits.sum().backward()
    assert all(w.grad is not None and w.grad != 0 for w in listed)


@pytest.mark.parametrize("variant", ["pissa", "olora"])
def test_a_residual_adapter_refuses_another_model_s_base(llama, variant):
    adapter = _trained(llama, variant, ("q_proj",))
    other = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="was derived from other base weights"):
        lf.merge_adapters([adapter], [1.0], method="linear", base=lf.base_params(other))
    with pytest.raises(ValueError, match="was derived from other base weights"):
        lf.to_lora(adapter, rank=2, base=lf.base_params(other))
    with pytest.raises(ValueError, match="was derived from other base weights"):
        lf.merged_state_dict(other, adapter)
    # on its own base: merged and exported as before (the delta of the adapter, exactly)
    exact = lf.merge_adapters([adapter], [1.0], method="linear", base=lf.base_params(llama))
    ids = tokens()
    torch.testing.assert_close(lf.adapted_call(llama, exact, ids).logits, lf.adapted_call(llama, adapter, ids).logits, rtol=1e-4, atol=1e-4)
    assert lf.merged_state_dict(llama, adapter).keys() == llama.state_dict().keys()


# --------------------------------------------------------------------------------- privacy


def _nan_at(ids: torch.Tensor, bad_first_token: int) -> torch.Tensor:
    """1 for every example, NaN for the one whose first token is ``bad_first_token`` (a loss
    that breaks on one input: a log of 0, a division by an empty mask)."""
    return torch.where(ids[:, 0] == bad_first_token, torch.tensor(float("nan")), torch.tensor(1.0))


@pytest.mark.parametrize("how", ["per_example", "ghost", "batched"])
def test_one_non_finite_example_is_skipped_and_counted_not_spread_to_every_coordinate(llama, how):
    from lora_func.privacy import batched_loss, clipped_sum

    adapter = _trained(llama, "lora", ("q_proj", "v_proj"))
    ids = tokens(4, 6, seed=3)
    bad = int(ids[2, 0])
    assert (ids[:, 0] == bad).sum() == 1

    def loss_fn(a, x):  # one example, x (1, T)
        return lf.adapted_call(llama, a, x).logits.logsumexp(-1).mean() * _nan_at(x, bad)[0]

    def example_losses(a, x):  # (B, T) -> (B,)
        return lf.adapted_call(llama, a, x).logits.logsumexp(-1).mean(-1) * _nan_at(x, bad)

    fn = batched_loss(example_losses) if how == "batched" else loss_fn
    clipping = "per_example" if how == "per_example" else "auto"
    with pytest.warns(RuntimeWarning, match="1 of 4 per-example gradients had a NaN or inf loss"):
        total = clipped_sum(fn, adapter, ids, max_grad_norm=0.5, clipping=clipping)
    others = clipped_sum(fn, adapter, ids[[0, 1, 3]], max_grad_norm=0.5, clipping=clipping)
    assert (total.count, total.skipped, others.skipped) == (4, 1, 0) and total.clipped == others.clipped
    assert total.loss_sum == pytest.approx(others.loss_sum, rel=1e-6)
    for key, g in total.grads.items():
        assert torch.isfinite(g).all(), key
        torch.testing.assert_close(g, others.grads[key], rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in total.grads.values())
    with pytest.warns(RuntimeWarning):
        noisy = lf.private_grads(fn, adapter, ids, max_grad_norm=0.5, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    assert all(torch.isfinite(g).all() for g in noisy.values())


def test_a_private_step_reports_the_skipped_example_and_the_mean_loss_of_the_others(llama):
    from lora_func.privacy import DPSGD, private_step_

    adapter = _trained(llama, "ia3", ("k_proj", "v_proj")).detach()
    ids = tokens(4, 6, seed=3)
    bad = int(ids[1, 0])

    def loss_fn(a, x):
        return lf.adapted_call(llama, a, x).logits.logsumexp(-1).mean() * _nan_at(x, bad)[0]

    with torch.no_grad():
        losses = [float(loss_fn(adapter, ids[i : i + 1])) for i in (0, 2, 3)]
    optimizer = torch.optim.SGD(adapter.params.values(), lr=0.1)
    before = {k: v.detach().clone() for k, v in adapter.params.items()}
    with pytest.warns(RuntimeWarning, match="1 of 2"):  # per micro-batch
        stats = private_step_(optimizer, adapter, loss_fn, [ids[:2], ids[2:]], DPSGD(max_grad_norm=1.0, noise_multiplier=0.0))
    assert (stats.count, stats.skipped) == (4, 1) and stats.loss == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert all(torch.isfinite(v).all() for v in adapter.params.values())
    assert any(not torch.equal(v.detach(), before[k]) for k, v in adapter.params.items())


def test_noise_for_epsilon_returns_for_rtol_zero_with_the_smallest_float_sigma():
    kwargs = {"epsilon": 1.0, "sample_rate": 0.01, "steps": 100, "delta": 1e-5}
    sigma = lf.noise_for_epsilon(rtol=0, **kwargs)
    spent = {k: v for k, v in kwargs.items() if k != "epsilon"}
    assert lf.epsilon(noise_multiplier=sigma, **spent) <= 1.0
    assert lf.epsilon(noise_multiplier=math.nextafter(sigma, 0), **spent) > 1.0  # one float less is over budget
    assert lf.noise_for_epsilon(**kwargs) == pytest.approx(sigma, rel=1e-9)
    for rtol in (-1e-9, 1.0, float("nan"), "1e-9"):
        with pytest.raises(ValueError, match="rtol"):
            lf.noise_for_epsilon(rtol=rtol, **kwargs)


def test_noise_for_epsilon_refuses_zero_steps_and_epsilon_says_zero():
    with pytest.raises(ValueError, match="steps=0 spends no privacy"):
        lf.noise_for_epsilon(epsilon=1.0, sample_rate=0.01, steps=0, delta=1e-5)
    assert lf.epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=0, delta=1e-5) == 0.0


@pytest.mark.parametrize("orders", [5, "abc", [None], {"a": 2}, [2.0, "3"], [True, 2.0], [], [1.0], [float("inf")]])
def test_bad_orders_are_refused_naming_the_argument(orders):
    with pytest.raises(ValueError, match="orders must be a non-empty sequence of finite RDP orders > 1"):
        lf.epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=10, delta=1e-5, orders=orders)
    with pytest.raises(ValueError, match="orders must be"):
        lf.privacy.Accountant(orders)


def test_orders_of_any_real_sequence_give_the_default_s_epsilon():
    import numpy as np

    from lora_func.privacy import DEFAULT_ORDERS

    kwargs = {"noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 10, "delta": 1e-5}
    want = lf.epsilon(**kwargs)
    assert lf.epsilon(orders=list(DEFAULT_ORDERS), **kwargs) == want
    assert lf.epsilon(orders=np.array(DEFAULT_ORDERS), **kwargs) == want
    assert lf.epsilon(orders=(a for a in DEFAULT_ORDERS), **kwargs) == want
