"""What the docs say lora_func does, checked against what it does (issue 48).

Each test names the sentence it guards (the page must still say it: an edit of the sentence
means revisiting the check) and then checks the behaviour, so that neither can change alone:
which calls work on SDPA attention, which raise, which methods export to peft (read from the
registry, never hand-kept), what the API tables list for each function's keywords.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch

import lora_func as lf
from tests.models import tiny_model, tokens

ROOT = Path(__file__).resolve().parents[1]


def _says(page: str, *phrases: str) -> str:
    """The page's text (whitespace collapsed), after checking it still says every phrase."""
    text = " ".join((ROOT / page).read_text().split())
    for phrase in phrases:
        assert " ".join(phrase.split()) in text, f"{page} no longer says {phrase!r}: update the claim and its check"
    return text


@pytest.fixture(scope="module")
def sdpa_llama():
    model = tiny_model("llama")
    model.config._attn_implementation = "sdpa"
    return model


def _lora(model, seed, targets=("q_proj", "v_proj")):
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=list(targets), r=2), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(50 + seed)
    return adapter.with_params({k: torch.randn(v.shape, generator=g) * 0.3 for k, v in adapter.params.items()})


# ------------------------------------------------------------------------ docs/functional.md


def test_ensemble_and_mixed_calls_work_on_sdpa_by_default_and_the_vmap_route_needs_eager(sdpa_llama):
    _says(
        "docs/functional.md",
        "so any attention implementation works, SDPA (the transformers default, below) and flash included",
        "(checked: it raises `ValueError` on SDPA)",
        "Their default batching otherwise (`batching=\"layers\"`, the adapters inside the target layers) runs on any attention implementation, SDPA included.",
    )
    model = sdpa_llama
    members = [_lora(model, s) for s in range(3)]
    stacked = lf.stack(members)
    ids = tokens(2)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        logits = lf.ensemble_call(model, stacked, ids, attention_mask=mask).logits
        mixed = lf.mixed_call(model, stacked, torch.tensor([2, 0]), ids, attention_mask=mask).logits
        for k, member in enumerate(members):
            alone = lf.adapted_call(model, member, ids, attention_mask=mask).logits
            torch.testing.assert_close(logits[k], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed[0], lf.adapted_call(model, members[2], ids[:1], attention_mask=mask[:1]).logits[0], rtol=1e-5, atol=1e-5)
    for call in (lambda: lf.ensemble_call(model, stacked, ids, batching="vmap", use_cache=False),
                 lambda: lf.mixed_call(model, stacked, torch.tensor([2, 0]), ids, batching="vmap", use_cache=False)):
        with pytest.raises(ValueError, match="eager attention"):
            call()


def test_privacy_accounting_is_part_of_lora_func():
    text = _says("docs/functional.md", "the privacy accounting is part of lora_func too: `lf.epsilon` and `lf.noise_for_epsilon`")
    assert "not part of lora_func" not in text
    sigma = lf.noise_for_epsilon(epsilon=8.0, sample_rate=0.01, steps=100, delta=1e-5)
    assert lf.epsilon(noise_multiplier=sigma, sample_rate=0.01, steps=100, delta=1e-5) <= 8.0
    accountant = lf.privacy.Accountant()
    accountant.step(noise_multiplier=sigma, sample_rate=0.01, steps=100)
    assert accountant.epsilon(1e-5) == pytest.approx(lf.epsilon(noise_multiplier=sigma, sample_rate=0.01, steps=100, delta=1e-5))


# ------------------------------------------------------------------------ docs/guide/privacy.md


def test_the_private_training_mode_runs_on_sdpa_with_the_eager_result(sdpa_llama):
    """lora_func.train's private step is one batched call (batched_loss): no vmap of the model."""
    from lora_func.privacy import DPSGD
    from lora_func.train import TrainState, train_step

    _says("docs/guide/privacy.md", "no `vmap` of the model, so the model's own attention implementation, SDPA by default, works; eager is not needed")
    eager = tiny_model("llama")
    ids = tokens(4)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding, no loss there (a padded row's logits differ: SDPA and eager mask it differently)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    after = {}
    for name, model in (("sdpa", sdpa_llama), ("eager", eager)):
        adapter = _lora(model, 0).detach()
        state = TrainState(adapter, torch.optim.SGD(adapter.params.values(), lr=1.0))  # SGD: the update is the gradient
        stats = train_step(model, state, batch, privacy=DPSGD(max_grad_norm=0.5, noise_multiplier=0.0))
        assert torch.isfinite(torch.tensor(stats.loss))
        after[name] = {k: v.detach().clone() for k, v in state.adapter.params.items()}
    for key in after["sdpa"]:
        torch.testing.assert_close(after["sdpa"][key], after["eager"][key], rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(after["sdpa"][k], _lora(sdpa_llama, 0).params[k]) for k in after["sdpa"])


# ------------------------------------------------------------------------ docs/io.md


def _io_table() -> dict[str, str]:
    """The mapping table of docs/io.md: variant name -> its row."""
    text = (ROOT / "docs" / "io.md").read_text()
    table = text.split("| lora_func | peft | notes |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.strip().splitlines()[1:]:
        first = line.split("|")[1]
        for name in re.findall(r"`(\w+)`", first):
            rows[name] = line
    return rows


def test_the_io_table_has_a_row_for_every_variant_generated_from_the_registry():
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    from lora_func.io._peft_keys import formats as _formats

    _says("docs/io.md", "Every registered variant has a row: tests/test_docs_claims.py reads this table")
    rows, formats = _io_table(), _formats()
    assert sorted(rows) == lf.list_variants(), f"rows missing: {sorted(set(lf.list_variants()) - set(rows))}, stale: {sorted(set(rows) - set(lf.list_variants()))}"
    problems = []
    for name, row in rows.items():
        peft_cell = row.split("|")[2]
        fmt = formats.get(name)
        if fmt is None:
            if "—" not in peft_cell:
                problems.append(f"{name}: no peft entry, but the row names {peft_cell.strip()}")
            continue
        config_class = PEFT_TYPE_TO_CONFIG_MAPPING[fmt.method.peft_type].__name__
        if f"`{config_class}" not in peft_cell:
            problems.append(f"{name}: stored as peft's {config_class}, the row says {peft_cell.strip()}")
        if not fmt.conv1d and "Conv1D" not in row:
            problems.append(f"{name}: save_peft refuses GPT-2 Conv1D (peft does), the row does not say so")
    assert not problems, "\n".join(problems)


def test_the_api_page_says_every_variant_with_a_peft_entry_exports_not_a_short_list():
    text = _says("docs/api.md", "every variant whose file declares a peft entry (docs/io.md's table lists them all, one row each")
    save_row = next(line for line in text.split(" | ") if "save_peft(adapter, directory" in line)
    assert "lora/eva, dora, pissa" not in save_row
    from lora_func.io import peft_problems
    from lora_func.io._peft_keys import formats as _formats

    model = tiny_model("llama")
    writable = []
    for name in _formats():
        try:
            adapter = lf.init_adapter(model, lf.AdapterSpec(name, targets=["q_proj"], r=2), generator=torch.Generator().manual_seed(0))
        except (ValueError, TypeError):
            continue  # a variant whose init needs calibration data or other options
        if not peft_problems(adapter, model=model):
            writable.append(name)
    assert len(writable) >= 25, writable  # far beyond the seven the page used to list


def test_load_peft_refuses_a_missing_layer_where_peft_only_warns(tmp_path):
    """docs/io.md: peft loads a checkpoint without a targeted layer's tensors with a warning and
    leaves the layer at its init; load_peft refuses it."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    _says("docs/io.md", "peft warns (\"Found missing adapter keys while loading the checkpoint\") and leaves that layer at its initial values")
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("oft", targets=["q_proj", "v_proj"], r=2), generator=torch.Generator().manual_seed(0))
    adapter = adapter.with_params({k: 0.1 * torch.randn_like(v) for k, v in adapter.params.items()})
    directory = lf.save_peft(adapter, tmp_path / "oft", model=model)
    path = directory / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(str(path)).items() if "layers.0.self_attn.q_proj" not in k}, str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PeftModel.from_pretrained(tiny_model("llama"), directory)
    assert any("Found missing adapter keys" in str(w.message) and "layers.0.self_attn.q_proj" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="holds no tensor for them"):
        lf.load_peft(directory, model)


# ------------------------------------------------------------------------ docs/api.md


def _resolve(name: str):
    if "." in name:
        module, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            return None
    for module in ("lora_func", "lora_func.train", "lora_func.privacy", "lora_func.io", "lora_func.merging", "lora_func.many"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # an old name the page lists as renamed
            found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            return found
    return None


def test_the_api_tables_list_every_keyword_of_the_functions_they_show():
    """A row `name(arg, *, keyword=...)` of docs/api.md names every parameter of the function
    (positional ones by count): a keyword added to the code must reach the page (the page lacked
    clipping=, privacy=, micro_batch_size=). Rows that elide with `...` and the internal
    `where` (the caller's name for messages) are exempt."""
    text = (ROOT / "docs" / "api.md").read_text()
    checked, problems = 0, []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        for match in re.finditer(r"`([\w.]+)\(([^`]*)\)", line.split(" | ")[0]):
            name, args = match.groups()
            obj = _resolve(name)
            if obj is None or not callable(obj) or "..." in args:
                continue
            try:
                parameters = inspect.signature(obj).parameters.values()
            except (TypeError, ValueError):
                continue
            named = [p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ("self", "where")]
            keywords = [p.name for p in named if p.kind == p.KEYWORD_ONLY or p.default is not p.empty]
            positional = [p for p in named if p.kind != p.KEYWORD_ONLY and p.default is p.empty]
            shown = [a.strip() for a in args.split(",") if a.strip() and a.strip() not in ("*", "/") and not a.strip().startswith("*")]
            missing = [k for k in keywords if not re.search(rf"\b{k}\b", args)]
            if missing or len([a for a in shown if "=" not in a]) < len(positional):
                problems.append(f"{name}({args}): missing {missing or [p.name for p in positional]}")
            checked += 1
    assert checked >= 60, checked
    assert not problems, "\n".join(problems)


def test_the_api_page_has_one_row_per_name():
    text = (ROOT / "docs" / "api.md").read_text()
    firsts = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| `")]
    repeated = sorted({f for f in firsts if firsts.count(f) > 1})
    assert not repeated, f"docs/api.md has these rows twice: {repeated}"
