"""``lora_func.io.peft_problems``: "can peft hold this?" answered as ``save_peft`` would.

The oracle is ``save_peft`` itself: over every variant on both layer kinds, with and without
the model, and over the compositions, stacks and combinations it refuses, ``peft_problems``
is empty exactly when ``save_peft`` writes a checkpoint, and otherwise its first entry is the
message ``save_peft`` raises. Plus: every refusing part is listed, nothing is computed (no SVD
for PiSSA) or written, and the peft table covers what the format needs per variant."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import lora_func as lf
from lora_func.io import peft, peft_problems, save_peft
from tests.contract_helpers import calibration_batches, perturbed
from tests.models import tiny_model

TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
# Options a variant needs on the tiny models (VB-LoRA: peft's default vector_length 256 divides no layer).
OPTIONS = {"vblora": {"num_vectors": 12, "vector_length": 8}}


# Options a variant needs on the tiny models (peft's RoAd default group_size=64 exceeds their widths).
SMALL_MODEL_OPTIONS = {"road": {"group_size": 2}, "oft": {"oft_block_size": 8}}


def _adapter(model, kind: str, variant: str, **kwargs) -> lf.Adapter:
    # adalora: peft's config stores the rank as init_r, an option that must equal r.
    extra = {"init_r": kwargs.get("r", 2), "total_step": 10} if variant == "adalora" else {}
    spec = lf.AdapterSpec(variant, targets=kwargs.pop("targets", TARGETS[kind]), **({"r": 2} | SMALL_MODEL_OPTIONS.get(variant, {}) | OPTIONS.get(variant, {}) | extra | kwargs))
    calibration = calibration_batches() if lf.get_variant(variant).calibration is not None else None
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1), calibration=calibration)
    return perturbed(adapter, 0.1)


def _refusal(adapter, model, directory) -> str | None:
    """What save_peft says: None when it wrote the checkpoint, else its message."""
    try:
        save_peft(adapter, directory, model=model)
    except (TypeError, ValueError) as err:
        assert not directory.exists(), "a refused save wrote something"
        return str(err)
    assert (directory / "adapter_config.json").is_file()
    return None


def _cases():
    for kind in ("llama", "gpt2"):
        for variant in lf.list_variants():
            yield pytest.param(kind, variant, {}, id=f"{variant}-{kind}")
    yield pytest.param("llama", "hra", {"r": 4, "targets": ["q_proj"]}, id="hra-llama-r4")


@pytest.mark.parametrize(("kind", "variant", "kwargs"), list(_cases()))
@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_problems_are_what_save_peft_raises_for_every_variant(kind, variant, kwargs, with_model, tmp_path):
    model = tiny_model(kind)
    adapter = _adapter(model, kind, variant, **kwargs)
    passed = model if with_model else None
    problems = peft_problems(adapter, model=passed)
    refusal = _refusal(adapter, passed, tmp_path / "out")
    assert problems == ([] if refusal is None else [refusal])


def test_the_answers_differ_where_peft_differs(tmp_path):
    """Not a constant answer: antipasto, hra/delora on Conv1D and pissa without a model are
    refused, the rest of the variants on Linear are not."""
    llama, gpt2 = tiny_model("llama"), tiny_model("gpt2")
    refused = {
        (kind, variant, with_model)
        for kind, model in (("llama", llama), ("gpt2", gpt2))
        for variant in lf.list_variants()
        for with_model in (True, False)
        if peft_problems(_adapter(model, kind, variant), model=model if with_model else None)
    }
    expected = {(k, "antipasto", m) for k in ("llama", "gpt2") for m in (True, False)}
    expected |= {("gpt2", v, m) for v in ("hra", "delora", "oft", "boft", "road") for m in (True, False)}
    expected |= {("gpt2", v, m) for v in ("hra", "delora") for m in (True, False)}
    expected |= {("gpt2", v, m) for v in ("loha", "lokr", "miss") for m in (True, False)}  # peft: nn.Linear only
    expected |= {("gpt2", v, m) for v in ("hra", "delora", "shira", "c3a") for m in (True, False)}
    expected |= {("gpt2", "adamss", m) for m in (True, False)}  # peft: nn.Linear only
    expected |= {(k, v, False) for k in ("llama", "gpt2") for v in ("pissa", "olora", "corda", "lora_ga")}  # converted on the base
    expected |= {("gpt2", v, m) for v in ("kasa", "loftq") for m in (True, False)}  # peft: KaSA on nn.Linear only; LoftQ quantizes Conv1D's stored layout
    expected |= {("gpt2", v, m) for v in ("beft", "glora", "osf", "psoft") for m in (True, False)}  # peft: nn.Linear only
    expected |= {("gpt2", v, m) for v in ("peanut", "supertuning") for m in (True, False)}  # peft: nn.Linear only
    expected |= {(k, "arrow", m) for k in ("llama", "gpt2") for m in (True, False)}  # peft stores no Arrow router: its experts are LoRA files
    expected |= {("gpt2", "poly", m) for m in (True, False)}  # peft: Poly on nn.Linear only
    expected |= {(k, "xlora", m) for k in ("llama", "gpt2") for m in (True, False)}  # peft's X-LoRA is a classifier file and LoRA files: save_xlora
    expected |= {("gpt2", "bdlora", m) for m in (True, False)}  # peft's BD-LoRA reads the base layer's in_features
    expected |= {("gpt2", "trainable_tokens", m) for m in (True, False)}  # peft's TrainableTokens layer reads in_features too
    expected |= {("gpt2", "lily", m) for m in (True, False)}  # peft: Lily on nn.Linear only
    assert refused == expected


def _composites(model):
    lora = _adapter(model, "gpt2", "lora")
    ia3_fc = _adapter(model, "gpt2", "ia3", targets=["c_fc"])
    ia3_ff_proj = _adapter(model, "gpt2", "ia3_ff", targets=["c_proj"])
    antipasto = _adapter(model, "gpt2", "antipasto", targets=["c_fc"])
    hra = _adapter(model, "gpt2", "hra")
    tied = _adapter(model, "gpt2", "lora", targets=["lm_head"], tied="both")
    return {
        "ia3+ia3_ff": (lf.compose(ia3_fc, ia3_ff_proj), 0),
        "stacked": (lf.stack([lora, lora]), 1),
        "combined": (lf.combine([lora, lora], [0.5, 0.5]), 1),
        "same-layers": (lf.compose(lora, lora), 1),
        "mixed-methods": (lf.compose(lora, ia3_fc), 1),
        "tied": (tied, 1),
        # two parts peft cannot hold: both are listed (save_peft raises the first)
        "antipasto+hra": (lf.compose(antipasto, hra), 2),
    }


@pytest.mark.parametrize("name", ["ia3+ia3_ff", "stacked", "combined", "same-layers", "mixed-methods", "tied", "antipasto+hra"])
def test_composites_stacks_and_combinations(name, tmp_path):
    model = tiny_model("gpt2")
    adapter, n_problems = _composites(model)[name]
    problems = peft_problems(adapter, model=model)
    refusal = _refusal(adapter, model, tmp_path / "out")
    assert len(problems) == n_problems
    assert (refusal is None) == (not problems)
    if problems:
        assert problems[0] == refusal


def test_a_model_without_the_targets_is_a_problem(tmp_path):
    adapter = _adapter(tiny_model("llama"), "llama", "lora")
    other = tiny_model("gpt2")
    assert peft_problems(adapter, model=other) == [_refusal(adapter, other, tmp_path / "out")]
    assert "are not in GPT2LMHeadModel" in peft_problems(adapter, model=other)[0]


def test_pissa_from_another_base_is_a_problem(tmp_path):
    adapter = _adapter(tiny_model("llama"), "llama", "pissa")
    other = tiny_model("llama", seed=1)
    problems = peft_problems(adapter, model=other)
    assert problems == [_refusal(adapter, other, tmp_path / "out")]
    assert "other base weights" in problems[0]


def test_nothing_is_computed_or_written(tmp_path, monkeypatch):
    """PiSSA's conversion (an SVD per layer) runs when the checkpoint is written, not when asked."""
    model = tiny_model("llama")
    adapter = _adapter(model, "llama", "pissa")

    def no_svd(*args, **kwargs):
        raise AssertionError("peft_problems ran an SVD")

    monkeypatch.setattr(torch.linalg, "svd", no_svd)
    assert peft_problems(adapter, model=model) == []
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_only_a_non_adapter_raises():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"peft_problems expects an adapter \(Adapter, Composed, Combined, ...\), got dict"):
        peft_problems({}, model=model)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        peft_problems(_adapter(model, "llama", "lora"), model={})


def test_the_table_gives_each_peft_variant_its_keys_and_shapes():
    """Every variant's tensor schema gives the adapter's own tensors, shapes and buffers on each
    layer (the shapes the loader checks a checkpoint against); a variant that peft holds stores
    each of its saved per-layer tensors under its own key (a schema with a wrong key or shape
    would refuse its own checkpoints)."""
    model = tiny_model("llama")
    for variant in lf.list_variants():
        fmt = lf.variants.peft_format(variant)
        if fmt is None:
            assert peft_problems(_adapter(model, "llama", variant), model=model), variant
        declared = lf.get_variant(variant)
        adapter = _adapter(model, "llama", variant)
        for layer in adapter.layers:
            # (a layer's forms see the shared tensors too; the schema holds them apart)
            params, buffers = ({k: v for k, v in t.items() if not declared.tensors[k].shared} for t in adapter.layer_tensors(layer))
            want = declared.shapes(layer.info)
            assert {k: tuple(v.shape) for k, v in (params | buffers).items()} == want, variant
            assert set(buffers) == {k for k in want if declared.tensors[k].buffer}, variant
        if fmt is not None:
            keys = [slot.peft_key("") for slot in declared.layer_slots().values() if slot.peft is not None]
            assert len(keys) == len(set(keys)), variant


def test_io_peft_names_no_variant():
    """The peft reader/writer is generic: each variant's mapping is its own file's entry
    (its file's ``PEFT`` and schemas), so io/peft.py names none of them (code, messages or docs)."""
    for path in Path(peft.__file__).parent.glob("*peft*.py"):  # peft.py and its _peft_* modules
        text = path.read_text()
        named = sorted({v for v in lf.list_variants() if re.search(rf"\b{re.escape(v)}\b", text, re.IGNORECASE)})
        assert named == [], f"lora_func/io/{path.name} names the variants {named}"
    assert len(list(Path(peft.__file__).parent.glob("*peft*.py"))) >= 4


def test_the_variants_of_one_peft_method_share_its_entry():
    """Variants stored as one peft_type share one PeftMethod (one set of config rules)."""
    formats = {v: lf.variants.peft_format(v) for v in lf.list_variants() if lf.variants.peft_format(v) is not None}
    by_type: dict = {}
    for fmt in formats.values():
        by_type.setdefault(fmt.method.peft_type, set()).add(id(fmt.method))
    assert all(len(ids) == 1 for ids in by_type.values()), by_type
