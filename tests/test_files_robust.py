"""Files under faults, tested from outside the io code: a crash while saving never leaves a
half-written file, and a truncated, corrupted or foreign file is refused with a clear
``ValueError`` (never another exception, never a silently different adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lora_func as lf
from lora_func.io import load_peft, native, peft, save_peft
from tests.contract_helpers import assert_unchanged, perturbed, snapshot
from tests.models import tiny_model

# What a refused lora_func file may say (docs/errors.md: load-unreadable, load-foreign,
# load-version, load-inconsistent, and the checksum/metadata checks).
REFUSALS = (
    "is not a readable safetensors file",
    "is not a lora_func adapter file",
    "is corrupted",
    "has damaged lora_func metadata",
    "is inconsistent",
    "format_version",
    "does not fit",  # a flipped module name: no such layer in the model
)


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_model("llama")
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("pissa", targets=["q_proj"], r=2), generator=torch.Generator().manual_seed(0)), 0.1)
    path = lf.save(adapter, tmp_path_factory.mktemp("saved") / "a.safetensors")
    return model, adapter, path.read_bytes()


def _same(a: lf.Adapter, b: lf.Adapter) -> bool:
    return (
        a.spec == b.spec
        and a.layers == b.layers
        and all(torch.equal(a.params[k], b.params[k]) for k in a.params)
        and all(torch.equal(a.buffers[k], b.buffers[k]) for k in a.buffers)
    )


def test_a_crash_while_saving_leaves_the_previous_file_and_no_temporary(saved, tmp_path, monkeypatch):
    model, adapter, data = saved
    path = tmp_path / "a.safetensors"
    path.write_bytes(data)

    def crashing(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial" * 100)  # some bytes reach the disk first
        raise Crash("disk full")

    monkeypatch.setattr(native, "save_file", crashing)
    other = adapter.with_params({k: v + 1 for k, v in adapter.params.items()})
    with pytest.raises(Crash):
        lf.save(other, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"], "a temporary file was left behind"
    assert path.read_bytes() == data, "the previous file was changed"
    monkeypatch.undo()
    assert _same(lf.load(path, model=model), adapter)


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.05, 0.2, 0.5, 0.8, 0.95, 0.999])
def test_truncated_files_are_refused(saved, tmp_path, fraction):
    model, _, data = saved
    snap = snapshot(model)
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ValueError) as err:
        lf.load(path, model=model)
    assert any(r in str(err.value) for r in REFUSALS), str(err.value)
    assert str(path) in str(err.value)
    assert_unchanged(model, snap)


def test_every_flipped_byte_is_refused_or_harmless(saved, tmp_path):
    """One flipped bit at 64 positions spread over the file (header, metadata, tensor bytes):
    each load raises a clear ValueError, or returns exactly the saved adapter (a flip in JSON
    whitespace or padding); never a different adapter."""
    model, adapter, data = saved
    positions = sorted({int(i * (len(data) - 1) / 63) for i in range(64)})
    outcomes = {"refused": 0, "identical": 0}
    for i, pos in enumerate(positions):
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        path = tmp_path / f"flip{i}.safetensors"
        path.write_bytes(bytes(damaged))
        try:
            loaded = lf.load(path, model=model)
        except ValueError as err:
            assert any(r in str(err) for r in REFUSALS), (pos, str(err))
            outcomes["refused"] += 1
        else:
            assert _same(loaded, adapter), f"a flip at byte {pos} gave a different adapter"
            outcomes["identical"] += 1
    assert outcomes["refused"] >= len(positions) // 2, outcomes


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda meta: meta | {"tree": "{not json"}, "damaged lora_func metadata"),
        (lambda meta: {k: v for k, v in meta.items() if k != "tree"}, "damaged lora_func metadata"),
        (lambda meta: meta | {"tree": json.dumps({"kind": "nonsense"})}, "damaged lora_func metadata"),
        (lambda meta: meta | {"format": "peft"}, "is not a lora_func adapter file"),
        (lambda meta: meta | {"digest": "0" * 64}, "is corrupted"),
    ],
    ids=["bad-json", "no-tree", "unknown-kind", "foreign-format", "wrong-digest"],
)
def test_damaged_metadata_is_refused(saved, tmp_path, edit, message):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, _, data = saved
    src = tmp_path / "a.safetensors"
    src.write_bytes(data)
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    out = tmp_path / "edited.safetensors"
    save_file(load_file(str(src)), str(out), metadata=edit(meta))
    with pytest.raises(ValueError, match=message):
        lf.load(out, model=model)


@pytest.mark.xfail(strict=True, reason="known gap: the file's digest covers the tensors, not the metadata, so an edited alpha loads silently")
def test_an_edited_hyperparameter_in_the_metadata_is_refused(saved, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, _adapter, data = saved
    src = tmp_path / "a.safetensors"
    src.write_bytes(data)
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    assert '"alpha": 8.0' in meta["tree"]
    out = tmp_path / "edited.safetensors"
    save_file(load_file(str(src)), str(out), metadata=meta | {"tree": meta["tree"].replace('"alpha": 8.0', '"alpha": 9.0')})
    with pytest.raises(ValueError):
        lf.load(out, model=model)


# ------------------------------------------------------------------------------------ peft


@pytest.fixture
def peft_dir(tmp_path):
    model = tiny_model("llama")
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2), generator=torch.Generator().manual_seed(0)), 0.1)
    directory = save_peft(adapter, tmp_path / "ckpt", model=model)
    return model, adapter, directory


def test_peft_truncated_weights_and_bad_config_are_refused(peft_dir):
    model, _, directory = peft_dir
    snap = snapshot(model)
    weights = directory / "adapter_model.safetensors"
    data = weights.read_bytes()
    for fraction in (0.0, 0.01, 0.3, 0.9):
        weights.write_bytes(data[: int(len(data) * fraction)])
        with pytest.raises(ValueError, match="not readable"):
            load_peft(directory, model)
    weights.write_bytes(data)
    config = directory / "adapter_config.json"
    text = config.read_text()
    config.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="not a peft config"):
        load_peft(directory, model)
    config.write_text(json.dumps(json.loads(text) | {"peft_type": "PROMPT_TUNING"}))
    with pytest.raises(ValueError, match="PROMPT_TUNING"):
        load_peft(directory, model)
    assert_unchanged(model, snap)


def test_peft_weights_of_another_model_are_refused(peft_dir):
    _, _, directory = peft_dir
    with pytest.raises(ValueError):
        load_peft(directory, tiny_model("gpt2"))


@pytest.mark.xfail(
    strict=True,
    reason="known gap: save_peft renames the weights and the config one after the other, so a crash in "
    "between leaves the new weights with the old config (a mixed checkpoint)",
)
def test_a_crash_while_saving_a_peft_checkpoint_leaves_the_old_one(peft_dir, monkeypatch):
    model, _adapter, directory = peft_dir
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    real = peft._write_atomically
    calls = []

    def crash_on_second(path, write):
        calls.append(path)
        if len(calls) == 2:
            raise Crash("power cut")
        return real(path, write)

    monkeypatch.setattr(peft, "_write_atomically", crash_on_second)
    bigger = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=3.0))
    with pytest.raises(Crash):
        save_peft(bigger, directory, model=model)
    after = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert after == before, "the directory holds a mix of the new and the old checkpoint"
