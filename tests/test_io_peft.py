"""HF peft checkpoints, both directions, against real peft 0.21 on tiny Llama, Qwen2 and GPT-2.

peft -> lora_func: a peft model, perturbed at random (so no identity at init can hide a bug),
saved with ``save_pretrained`` and read with ``load_peft`` onto the untouched base, gives
peft's logits (lazy and merged), and every tensor in the file is in the adapter unchanged.
lora_func -> peft: ``save_peft`` output loads with ``PeftModel.from_pretrained`` and gives
lora_func's logits. Plus ``merge`` against peft's ``merge_and_unload``, and the errors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import lora_func as lf
from lora_func.variants._kernels import lora_scale
from lora_func.export import merged_state_dict
from lora_func.io import load_peft, save_peft
from lora_func.variants import get_variant, list_variants
from tests.contract_helpers import assert_unchanged, calibration_batches, perturbed, snapshot
from tests.models import tiny_model, tokens
from tests.peft_io_helpers import (
    ALPHA,
    IA3_TARGETS,
    R,
    TARGETS,
    load_in_peft,
    peft_warnings,
    saved_peft_model,
)
from tests.tolerance import assert_close_to_scale

KINDS = ("llama", "qwen2", "gpt2")
ATOL = 1e-5
# peft refuses HRA and DeLoRA on GPT-2 Conv1D: those cases exist only for Llama and Qwen2.
PEFT_CASES = [
    pytest.param(case, kind, id=f"{case}-{kind}")
    for case in ("lora", "rslora", "dora", "eva", "pissa", "pissa-converted", "ia3", "hra", "delora")
    for kind in KINDS
    if not (kind == "gpt2" and case in ("hra", "delora"))
]
# What each peft case must load as.
LOADS_AS = {
    "lora": "lora", "rslora": "lora", "dora": "dora", "eva": "eva", "pissa": "pissa", "pissa-converted": "lora",
    "hra": "hra", "delora": "delora",
}
PEFT_NAME = re.compile(r"^base_model\.model\.(.+)\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector|ia3_l|hra_u|delora_A|delora_B|delora_lambda|delora_w_norm)$")


def leaves(adapter) -> list[lf.Adapter]:
    return list(adapter.parts) if isinstance(adapter, lf.Composed) else [adapter]


def adapter_tensors(adapter) -> dict[str, torch.Tensor]:
    """Every tensor of every leaf, keyed ``<module>.<short name>`` (leaves adapt different layers)."""
    out: dict[str, torch.Tensor] = {}
    for leaf in leaves(adapter):
        for key, value in {**leaf.params, **leaf.buffers}.items():
            assert key not in out
            out[key] = value.detach()
    return out


def file_tensors(directory) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors keyed like :func:`adapter_tensors`, in lora_func's shapes."""
    out = {}
    for key, value in load_file(str(directory / "adapter_model.safetensors")).items():
        match = PEFT_NAME.match(key)
        assert match, key
        short = match[2].removesuffix(".weight")
        out[f"{match[1]}.{short}"] = value.reshape(-1) if short == "ia3_l" else value
    return out


def logits(model, adapter, ids, merged):
    return lf.adapted_call(model, adapter, ids, merged=merged).logits


# ------------------------------------------------------------------------------ peft -> lora_func


@pytest.mark.parametrize(("case", "kind"), PEFT_CASES)
def test_peft_checkpoint_loads_with_peft_logits(case, kind, tmp_path):
    peft_model = saved_peft_model(case, kind, tmp_path)
    ids = tokens(batch=2, length=10, seed=4)
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    model = tiny_model(kind)
    snap = snapshot(model)
    adapter = load_peft(tmp_path / "adapter", model)

    if case == "ia3":  # a mixed IA3 checkpoint is two lora_func variants
        out, ff = IA3_TARGETS[kind]
        assert isinstance(adapter, lf.Composed) and [p.spec.variant for p in adapter.parts] == ["ia3", "ia3_ff"]
        for part, names in zip(adapter.parts, (out, ff), strict=True):
            assert all(any(layer.target.module.endswith(n) for n in names) for layer in part.layers)
    else:
        assert isinstance(adapter, lf.Adapter) and adapter.spec.variant == LOADS_AS[case]
    # Every tensor in the file is in the adapter, unchanged (and nothing else but PiSSA's residual).
    stored, ours = file_tensors(tmp_path / "adapter"), adapter_tensors(adapter)
    assert sorted(set(ours) - set(stored)) == sorted(k for k in ours if k.endswith(".W_res"))
    for key, value in stored.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    # Per-layer ranks and scales from rank_pattern / alpha_pattern / use_rslora: peft's own layers
    # are the oracle (the PiSSA conversion doubles the rank and keeps the scale).
    peft_modules = dict(peft_model.base_model.model.named_modules())
    for leaf in leaves(adapter):
        for layer in leaf.layers:
            peft_layer = peft_modules[layer.target.module]
            if hasattr(peft_layer, "scaling"):
                factor = 2 if case == "pissa-converted" else 1
                assert layer.info.r == factor * peft_layer.r["default"], layer.target.module
                assert lora_scale(layer.info) == peft_layer.scaling["default"], layer.target.module
    if case in ("lora", "rslora", "eva"):
        assert len({layer.info.r for layer in adapter.layers}) == 2, "the rank pattern should give two ranks"

    assert (expected - model(ids).logits).abs().max() > 1e-3, "the perturbed adapter should change the output"
    for merged in (False, True):
        torch.testing.assert_close(logits(model, adapter, ids, merged), expected, atol=ATOL, rtol=0, msg=f"merged={merged}")
    assert_unchanged(model, snap)


def test_unconverted_pissa_niter_checkpoint_is_refused(tmp_path):
    """peft's randomized-SVD PiSSA residual cannot be recomputed exactly: ask for the conversion."""
    with peft_warnings():
        from peft import LoraConfig, get_peft_model

        peft_model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights="pissa_niter_2"))
        peft_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa_niter_2'.*path_initial_model_for_weight_conversion"):
        load_peft(tmp_path, tiny_model("llama"))


# ------------------------------------------------------------------------------ lora_func -> peft


def _our_adapter(case: str, kind: str, model):
    g = torch.Generator().manual_seed(0)
    targets = TARGETS[kind]
    if case == "ia3":
        out, ff = IA3_TARGETS[kind]
        a = lf.init_adapter(model, lf.AdapterSpec("ia3", targets=out), generator=g)
        b = lf.init_adapter(model, lf.AdapterSpec("ia3_ff", targets=ff), generator=g)
        return lf.compose(perturbed(a, 0.3, seed=1), perturbed(b, 0.3, seed=2))
    if case == "eva":
        spec = lf.AdapterSpec("eva", targets=targets, r=R, alpha=ALPHA, svd="full")
        adapter = lf.init_adapter(model, spec, generator=g, calibration=calibration_batches())
        assert len({layer.info.r for layer in adapter.layers}) > 1, "EVA should redistribute the ranks here"
        return perturbed(adapter, 0.1)
    variant, options = {"rslora": ("lora", {"use_rslora": True})}.get(case, (case, {}))
    if case not in ("hra", "delora"):  # they have no alpha (peft has no such field either)
        options["alpha"] = ALPHA
    spec = lf.AdapterSpec(variant, targets=targets, r=R, **options)
    return perturbed(lf.init_adapter(model, spec, generator=g), 0.1)


def _static(adapter: lf.Adapter) -> list[tuple]:
    """Each layer's static info, without EVA's calibration-only options (peft has no field for them)."""
    return [
        (layer.target, layer.info.r, layer.info.alpha, layer.param_shapes, layer.buffer_shapes,
         tuple((k, v) for k, v in layer.info.options if k not in ("svd", "max_batches")))
        for layer in adapter.layers
    ]


OUR_CASES = [
    pytest.param(case, kind, id=f"{case}-{kind}")
    for case in ("lora", "rslora", "dora", "pissa", "ia3", "hra", "delora")
    for kind in KINDS
    if not (kind == "gpt2" and case in ("hra", "delora"))
] + [pytest.param("eva", "llama", id="eva-llama")]


@pytest.mark.parametrize(("case", "kind"), OUR_CASES)
def test_save_peft_loads_in_peft_with_our_logits(case, kind, tmp_path):
    model = tiny_model(kind)
    snap = snapshot(model)
    adapter = _our_adapter(case, kind, model)
    ids = tokens(batch=2, length=10, seed=4)
    ours = logits(model, adapter, ids, merged=False)
    assert (ours - model(ids).logits).abs().max() > 1e-3, "the perturbed adapter should change the output"

    save_peft(adapter, tmp_path, model=model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    if case == "eva":
        assert config["init_lora_weights"] == "eva" and config["rank_pattern"] and config["alpha_pattern"]
    with torch.no_grad():
        theirs = load_in_peft(kind, tmp_path)(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours.detach(), atol=ATOL, rtol=0)

    # ... and back: our own loader gives the same adapter (PiSSA comes back as its LoRA conversion).
    again = load_peft(tmp_path, model)
    if case == "pissa":
        assert again.spec.variant == "lora" and {layer.info.r for layer in again.layers} == {2 * R}
        torch.testing.assert_close(logits(model, again, ids, False), ours, atol=ATOL, rtol=0)
    else:
        assert [leaf.spec.variant for leaf in leaves(again)] == [leaf.spec.variant for leaf in leaves(adapter)]
        assert [_static(leaf) for leaf in leaves(again)] == [_static(leaf) for leaf in leaves(adapter)]
        before, after = adapter_tensors(adapter), adapter_tensors(again)
        assert sorted(before) == sorted(after)
        for key in before:
            assert torch.equal(before[key], after[key]), key
        assert torch.equal(logits(model, again, ids, False), ours)
    assert_unchanged(model, snap)


def test_config_uses_short_names_only_when_they_select_exactly_the_adapted_layers(tmp_path):
    model = tiny_model("llama")
    every_q = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2))
    one_q = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["layers.0.self_attn.q_proj"], r=2))
    save_peft(every_q, tmp_path / "every", model=model)
    save_peft(one_q, tmp_path / "one", model=model)
    save_peft(every_q, tmp_path / "no_model")
    read = lambda d: json.loads((tmp_path / d / "adapter_config.json").read_text())["target_modules"]  # noqa: E731
    assert read("every") == ["q_proj"]
    assert read("one") == ["model.layers.0.self_attn.q_proj"]
    assert read("no_model") == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda m: lf.init_adapter(m, lf.AdapterSpec("antipasto", targets=["c_attn"], r=2)), ValueError, "antipasto has no peft equivalent"),
        (lambda m: lf.init_adapter(m, lf.AdapterSpec("hra", targets=["c_attn"], r=2)), ValueError, r"peft refuses hra on GPT-2 Conv1D layers \(transformer.h.0.attn.c_attn\)"),
        (lambda m: lf.init_adapter(m, lf.AdapterSpec("delora", targets=["c_attn"], r=2)), ValueError, "peft refuses delora on GPT-2 Conv1D"),
        (lambda m: lf.stack([lf.init_adapter(m, lf.AdapterSpec("lora", targets=["c_attn"], r=2))] * 2), ValueError, r"stacked \(stack_shape \(2,\)\).*lora_func.unstack"),
        (lambda m: lf.combine([lf.init_adapter(m, lf.AdapterSpec("lora", targets=["c_attn"], r=2))] * 2, [0.5, 0.5]), TypeError, "Combined"),
        (lambda m: lf.compose(*[lf.init_adapter(m, lf.AdapterSpec("lora", targets=["c_attn"], r=2))] * 2), ValueError, r"same layers \['transformer.h.0.attn.c_attn'"),
        (
            lambda m: lf.compose(lf.init_adapter(m, lf.AdapterSpec("lora", targets=["c_attn"], r=2)), lf.init_adapter(m, lf.AdapterSpec("ia3", targets=["c_fc"]))),
            ValueError,
            r"different peft configs \(\['IA3', 'LORA'\]",
        ),
        (
            lambda m: lf.init_adapter(m, lf.AdapterSpec("lora", targets=["lm_head"], r=2, tied="both")),
            ValueError,
            r"lm_head is adapted under its tied names \['transformer.wte.weight'\]",
        ),
    ],
    ids=["antipasto", "hra-conv1d", "delora-conv1d", "stacked", "combined", "same-layers", "mixed-methods", "tied"],
)
def test_save_peft_refuses_what_peft_cannot_express_and_writes_nothing(make, error, message, tmp_path):
    model = tiny_model("gpt2")
    with pytest.raises(error, match=message):
        save_peft(make(model), tmp_path / "out", model=model)
    assert not (tmp_path / "out").exists()


def test_peft_adapter_on_a_tied_weight_is_refused(tmp_path):
    """peft adapts only lm_head's output; lora_func's only way to adapt a tied weight changes the embedding too."""
    import warnings

    from peft import LoraConfig, get_peft_model

    with peft_warnings(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True`", category=UserWarning)
        peft_model = get_peft_model(tiny_model("gpt2"), LoraConfig(r=2, target_modules=["lm_head"]))
        peft_model.save_pretrained(tmp_path, save_embedding_layers=False)
    with pytest.raises(ValueError, match=r"adapts \['lm_head'\], whose weight is tied.*merge_and_unload"):
        load_peft(tmp_path, tiny_model("gpt2"))


def test_save_peft_of_pissa_needs_the_base_it_was_built_on(tmp_path):
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("pissa", targets=["q_proj"], r=2))
    with pytest.raises(ValueError, match=r"needs model=<the base model>.*model.layers.0.self_attn.q_proj"):
        save_peft(adapter, tmp_path / "out")
    with pytest.raises(ValueError, match=r"derived from other base weights"):
        save_peft(adapter, tmp_path / "out", model=tiny_model("llama", seed=1))
    assert not (tmp_path / "out").exists()


def test_older_bin_checkpoints_load_too(tmp_path):
    """peft's pre-safetensors adapter_model.bin (read with weights_only=True: no code runs)."""
    model = tiny_model("llama")
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2)), 0.1)
    save_peft(adapter, tmp_path, model=model)
    weights = tmp_path / "adapter_model.safetensors"
    torch.save(load_file(str(weights)), tmp_path / "adapter_model.bin")
    weights.unlink()
    again = load_peft(tmp_path, model)
    assert all(torch.equal(again.params[k], adapter.params[k]) for k in adapter.params)


# ------------------------------------------------------------------------------- load_peft errors


@pytest.fixture
def lora_dir(tmp_path):
    model = tiny_model("llama")
    save_peft(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "down_proj"], r=2)), tmp_path / "ckpt", model=model)
    return tmp_path / "ckpt"


def _edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_load_peft_errors_name_the_problem(lora_dir, tmp_path):
    llama = tiny_model("llama")
    snap = snapshot(llama)
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        load_peft(tmp_path / "nowhere", llama)
    with pytest.raises(ValueError, match=r"adapts modules that GPT2LMHeadModel does not have: \['model.layers.0.mlp.down_proj'"):
        load_peft(lora_dir, tiny_model("gpt2"))
    with peft_warnings():
        from peft import PeftModel

        wrapped = PeftModel.from_pretrained(tiny_model("llama"), str(lora_dir))
    with pytest.raises(TypeError, match="untouched base model, got a peft-wrapped PeftModel"):
        load_peft(lora_dir, wrapped)

    wider = tiny_model("llama")
    wider.config.intermediate_size = 64
    from transformers import LlamaForCausalLM

    with pytest.raises(ValueError, match=r"does not fit LlamaForCausalLM \(tensor shapes\).*down_proj"):
        load_peft(lora_dir, LlamaForCausalLM(wider.config))

    _edit_config(lora_dir, r=3)
    with pytest.raises(ValueError, match=r"inconsistent at model.layers.0.mlp.down_proj: its tensors have rank 2, but the config"):
        load_peft(lora_dir, llama)
    _edit_config(lora_dir, r=2, init_lora_weights="lora_ga")  # olora, pissa, corda: their own variants read them
    with pytest.raises(ValueError, match=r"init_lora_weights='lora_ga'.*path_initial_model_for_weight_conversion"):
        load_peft(lora_dir, llama)
    _edit_config(lora_dir, init_lora_weights=True, layer_replication=[[0, 2]])
    with pytest.raises(ValueError, match=r"uses layer_replication=\[\[0, 2\]\]: peft runs it on the model made deeper"):
        load_peft(lora_dir, llama)
    # a peft method no variant stores (the list read from the registry: new variants extend it)
    _edit_config(lora_dir, layer_replication=None, peft_type="XLORA")
    known = sorted({fmt.method.peft_type for v in lf.list_variants() if (fmt := lf.variants.peft_format(v)) is not None})
    assert {"DELORA", "HRA", "IA3", "LORA"} <= set(known)
    with pytest.raises(ValueError, match=re.escape(f"peft 'XLORA' checkpoint; lora_func reads peft_type {known}")):
        load_peft(lora_dir, llama)
    _edit_config(lora_dir, peft_type="LORA")
    weights = lora_dir / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file(tensors | {"base_model.model.lm_head.modules_to_save.weight": torch.zeros(2)}, str(weights))
    with pytest.raises(ValueError, match=r"tensors lora_func cannot map for peft_type LORA: \['base_model.model.lm_head.modules_to_save.weight'\]"):
        load_peft(lora_dir, llama)
    save_file({k: v for k, v in tensors.items() if "layers.1.self_attn.q_proj.lora_B" not in k}, str(weights))
    with pytest.raises(ValueError, match=r"incomplete at model.layers.1.self_attn.q_proj: it has \['lora_A'\]"):
        load_peft(lora_dir, llama)
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="not readable"):
        load_peft(lora_dir, llama)
    assert_unchanged(llama, snap)


# ------------------------------------------------------------------------------------------ merge


def test_merge_equals_peft_merge_and_unload_and_exports(tmp_path):
    """peft's merge_and_unload is the oracle (GPT-2: Conv1D layout, tied lm_head)."""
    peft_model = saved_peft_model("dora", "gpt2", tmp_path)
    model = tiny_model("gpt2")
    snap = snapshot(model)
    merged = merged_state_dict(model, load_peft(tmp_path / "adapter", model))
    with peft_warnings():
        reference = peft_model.merge_and_unload().state_dict()
    assert list(merged) == list(model.state_dict()) == list(reference)
    changed = 0
    for key, value in merged.items():
        assert type(value) is torch.Tensor and value.is_contiguous() and not value.requires_grad and value.grad_fn is None, key
        assert_close_to_scale(value, reference[key], msg=key)
        changed += not torch.equal(value, model.state_dict()[key])
    assert changed == 2 * 2, "c_attn and c_fc weights of both blocks"
    assert merged["lm_head.weight"] is merged["transformer.wte.weight"]
    assert_unchanged(model, snap)


def test_merged_state_dict_round_trips_through_save_pretrained(tmp_path):
    """Tied lm_head adapted under both names, and IA3's changed bias, reach the exported model."""
    model = tiny_model("gpt2")
    g = torch.Generator().manual_seed(0)
    head = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["lm_head"], tied="both", r=2), generator=g), 0.5)
    ia3 = perturbed(lf.init_adapter(model, lf.AdapterSpec("ia3", targets=["c_attn"]), generator=g), 0.3)
    adapter = lf.compose(head, ia3)
    ids = tokens()
    expected = logits(model, adapter, ids, merged=True)
    merged = merged_state_dict(model, adapter)
    assert merged["lm_head.weight"] is merged["transformer.wte.weight"]
    assert not torch.equal(merged["transformer.h.0.attn.c_attn.bias"], model.transformer.h[0].attn.c_attn.bias)
    copy = tiny_model("gpt2", seed=3)
    copy.load_state_dict(merged)
    copy.save_pretrained(tmp_path / "merged")
    from transformers import GPT2LMHeadModel

    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, expected, atol=1e-5, rtol=0)
    assert merged_state_dict(lf.base_params(model), adapter).keys() >= merged.keys()
    with pytest.raises(TypeError, match=r"merged_state_dict\(\) expects a model"):
        merged_state_dict([1], adapter)


def test_lora_dropout_is_read_and_written_and_delora_module_dropout_warns(tmp_path):
    """peft's lora_dropout becomes the adapter's dropout option and is written back; DeLoRA's
    module_dropout (which lora_func does not have) warns instead of vanishing."""
    model = tiny_model("llama")
    for variant in ("lora", "dora"):
        adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=["q_proj", "v_proj"], r=2, dropout=0.1))
        directory = lf.save_peft(adapter, tmp_path / variant)
        assert json.loads((directory / "adapter_config.json").read_text())["lora_dropout"] == 0.1
        loaded = lf.load_peft(directory, model)
        assert loaded.spec.option("dropout") == 0.1
        typed = lf.save_peft(loaded, tmp_path / f"{variant}-typed", task_type="CAUSAL_LM")
        assert json.loads((typed / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
        for key in adapter.params:
            assert torch.equal(loaded.params[key], adapter.params[key])
    delora = lf.init_adapter(model, lf.AdapterSpec("delora", targets=["q_proj", "v_proj"], r=2))
    directory = lf.save_peft(delora, tmp_path / "delora")
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps(config | {"module_dropout": 0.1}))
    with pytest.warns(UserWarning, match=r"'module_dropout': 0.1.*not applied"):
        lf.load_peft(directory, model)
