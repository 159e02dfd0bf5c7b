"""Files under faults, tested from outside the io code: a crash while saving never leaves a
half-written file, and a truncated, corrupted or foreign file is refused with a clear
``ValueError`` (never another exception, never a silently different adapter)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import lora_func as lf
from lora_func.io import _files, load_peft, native, peft, save_peft
from tests.contract_helpers import assert_unchanged, perturbed, snapshot
from tests.crashes import Crash, crashed_during
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


def test_the_saved_file_is_the_same_on_every_save(saved, tmp_path):
    """The flip test below is only deterministic if the file is: safetensors writes its
    metadata in a random order, which lora_func.save makes canonical."""
    _model, adapter, data = saved
    assert all(lf.save(adapter, tmp_path / f"again{i}.safetensors").read_bytes() == data for i in range(5))


def test_every_flipped_byte_is_refused_or_harmless(saved, tmp_path):
    """One flipped bit at 64 positions spread over the file (header, metadata, tensor bytes)
    and 64 more spread over the header alone (where most of what defines the adapter is):
    each load raises a clear ValueError, or returns exactly the saved adapter (a flip in JSON
    whitespace or padding); never a different adapter."""
    model, adapter, data = saved
    header_end = 8 + int.from_bytes(data[:8], "little")
    positions = sorted({int(i * (len(data) - 1) / 63) for i in range(64)} | {int(i * (header_end - 1) / 63) for i in range(64)})
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


@pytest.mark.parametrize(
    ("key", "old", "new"),
    [
        ("tree", '"alpha": 8.0', '"alpha": 9.0'),
        ("tree", '"bias_key": "model.layers.0.self_attn.q_proj.bias"', '"bias_key": null'),
        ("buffer_digests", "{}", '{"": {}}'),
        ("format_version", "2", "1"),
    ],
    ids=["alpha", "bias_key", "buffer_digests", "format_version"],
)
def test_an_edited_hyperparameter_in_the_metadata_is_refused(saved, tmp_path, key, old, new):
    """Valid metadata edited by hand (each edit alone would load as a different adapter, or
    is at least not what was saved) is refused by the digest, which covers the metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, _adapter, data = saved
    src = tmp_path / "a.safetensors"
    src.write_bytes(data)
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    assert old in meta[key]
    out = tmp_path / "edited.safetensors"
    save_file(load_file(str(src)), str(out), metadata=meta | {key: meta[key].replace(old, new, 1)})
    snap = snapshot(model)
    with pytest.raises(ValueError, match="edited.safetensors is corrupted: its tensors or metadata do not match"):
        lf.load(out, model=model)
    assert_unchanged(model, snap)


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


def _same_peft(loaded: lf.Adapter, saved: lf.Adapter) -> bool:
    """The same tensors, ranks and alphas (a peft checkpoint does not keep the spec's wording)."""
    return (
        sorted(loaded.params) == sorted(saved.params)
        and all(torch.equal(loaded.params[k], saved.params[k]) for k in saved.params)
        and [(x.info.r, x.info.alpha) for x in loaded.layers] == [(x.info.r, x.info.alpha) for x in saved.layers]
    )


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()} if directory.exists() else {}


def _exchange_works(tmp: Path) -> bool:
    a, b = tmp / "exchange-a", tmp / "exchange-b"
    a.mkdir()
    b.mkdir()
    (a / "x").touch()
    swapped = _files._exchange(a, b) and (b / "x").exists() and not (a / "x").exists()
    shutil.rmtree(a)
    shutil.rmtree(b)
    return swapped


def test_the_directory_exchange_is_atomic_on_linux(tmp_path):
    """On Linux, save_peft's guarantee rests on renameat2(RENAME_EXCHANGE) working."""
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux-only; elsewhere save_peft uses the documented fallback")
    assert _exchange_works(tmp_path)


def _neighbours(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if p.name != directory.name) if directory.parent.exists() else []


# (object, attribute, which call): the steps of a save; the crash comes just before, or just
# after, that call. Steps a design does not take are not reached (the save then completes).
STEPS = {
    "weights": (peft, "save_file", 1),
    "config": (peft, "_write_text", 1),
    "flush": (_files, "fsync", 1),
    "carry-over": (_files, "_carry", 1),
    "exchange": (_files, "_exchange", 1),
    "rename": (os, "rename", 1),
    "first-replace": (os, "replace", 1),
    "second-replace": (os, "replace", 2),
    "cleanup": (shutil, "rmtree", 1),
}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("exists", [True, False], ids=["over-a-checkpoint", "new-directory"])
def test_a_crash_while_saving_a_peft_checkpoint_leaves_the_old_or_the_new_one(peft_dir, tmp_path, monkeypatch, exists, step, when):
    """save_peft over an existing checkpoint (with a README that is not ours), or into a new
    directory, crashing just before or just after each step: the directory is then exactly
    the old checkpoint or exactly the new one (README kept), never a mix, and no temporary
    entry is left next to it (except when the crash stops the cleanup itself)."""
    model, _adapter, directory = peft_dir
    if step == "second-replace" and not _exchange_works(tmp_path):
        pytest.skip("no atomic directory exchange here: save_peft falls back to two renames (documented best effort)")
    (directory / "README.md").write_text("model card\n")
    if not exists:
        directory = tmp_path / "fresh" / "ckpt"
    bigger = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=3.0), generator=torch.Generator().manual_seed(1))
    clean = save_peft(bigger, tmp_path / "reference", model=model)
    new = _contents(clean) | ({"README.md": b"model card\n"} if exists else {})
    old = _contents(directory)
    neighbours = _neighbours(directory)

    crashed = crashed_during(monkeypatch, *STEPS[step], when, lambda: save_peft(bigger, directory, model=model))
    now = _contents(directory)
    assert now in (old, new), f"{'crashed' if crashed else 'finished'}: the directory holds {sorted(now)}, a mix of the old and the new checkpoint"
    if not crashed:
        assert now == new
    litter = sorted(set(_neighbours(directory)) - set(neighbours))
    if not (crashed and step == "cleanup" and when == "before"):
        assert litter == [], f"temporary entries left behind: {litter}"
    if now == new:
        assert _same(load_peft(directory, model), load_peft(clean, model))


def test_save_peft_without_an_atomic_exchange_still_writes_the_whole_checkpoint(peft_dir, monkeypatch):
    """Where renameat2(RENAME_EXCHANGE) is missing or refused, the files are renamed into the
    existing directory one by one: the result is the same checkpoint, other files are kept."""
    model, _adapter, directory = peft_dir
    (directory / "README.md").write_text("model card\n")
    (directory / "tokenizer").mkdir()
    (directory / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    monkeypatch.setattr(_files, "_exchange", lambda a, b: False)
    bigger = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=3.0), generator=torch.Generator().manual_seed(1))
    save_peft(bigger, directory, model=model)
    assert sorted(p.name for p in directory.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer"]
    assert (directory / "tokenizer" / "vocab.txt").read_text() == "a\nb\n"
    assert sorted(p.name for p in directory.parent.iterdir()) == ["ckpt"]
    assert _same_peft(load_peft(directory, model), bigger)


def test_save_peft_into_the_working_directory_keeps_it_usable(peft_dir, monkeypatch):
    """The exchange replaces the directory: a process working inside it (save_peft(a, ".")) is
    moved to the new one, not left in the removed old one."""
    model, _adapter, directory = peft_dir
    (directory / "sub").mkdir()
    monkeypatch.chdir(directory / "sub")
    bigger = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=3.0), generator=torch.Generator().manual_seed(1))
    save_peft(bigger, "..", model=model)
    assert Path(os.getcwd()) == (directory / "sub").resolve() and Path("..", "adapter_config.json").is_file()
    assert _same_peft(load_peft("..", model), bigger)


def test_save_peft_keeps_the_other_entries_the_mode_and_a_symlinked_directory(peft_dir, tmp_path):
    """The exchange replaces the directory: what save_peft does not write (files, folders,
    symlinks) is carried over, the directory keeps its permissions, and a symlink to the
    checkpoint directory stays a symlink (its target is replaced)."""
    model, _adapter, directory = peft_dir
    (directory / "README.md").write_text("model card\n")
    (directory / "tokenizer").mkdir()
    (directory / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    (directory / "latest").symlink_to("tokenizer")
    directory.chmod(0o750)
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "ckpt"
    link.symlink_to(directory)
    bigger = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=4, alpha=3.0), generator=torch.Generator().manual_seed(1))
    assert save_peft(bigger, link, model=model) == link
    assert link.is_symlink() and link.resolve() == directory.resolve()
    assert sorted(p.name for p in directory.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors", "latest", "tokenizer"]
    assert (directory / "latest").is_symlink() and (directory / "latest" / "vocab.txt").read_text() == "a\nb\n"
    assert directory.stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in directory.parent.iterdir()) == ["ckpt", "links"]
    assert _same_peft(load_peft(directory, model), bigger)


@pytest.mark.parametrize("saver", ["save", "save_peft", "save_checkpoint"])
@pytest.mark.parametrize("exists", [True, False], ids=["over-old", "new"])
def test_every_written_file_is_flushed_before_its_rename_and_the_directory_after(tmp_path, monkeypatch, saver, exists):
    """Atomic is not durable: a rename can reach the disk before the data it points to, and
    the rename itself lives in the parent directory. Each saver flushes every file it writes
    before the rename that publishes it, and the directory holding the new entry after."""
    from lora_func.train import TrainState, make_optimizer, save_checkpoint

    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2), generator=torch.Generator().manual_seed(0))
    target = tmp_path / ("a.safetensors" if saver == "save" else "ckpt")
    save = {
        "save": lambda: lf.save(adapter, target),
        "save_peft": lambda: save_peft(adapter, target, model=model),
        "save_checkpoint": lambda: save_checkpoint(target, TrainState(adapter, make_optimizer(adapter, 1e-3))),
    }[saver]
    if exists:
        save()
    events: list[tuple[str, Path]] = []
    real_fsync, real_replace, real_rename, real_exchange = _files.fsync, os.replace, os.rename, _files._exchange
    monkeypatch.setattr(_files, "fsync", lambda p: (events.append(("fsync", Path(p))), real_fsync(p))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("publish", Path(b))), real_replace(a, b))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("publish", Path(b))), real_rename(a, b))[1])
    monkeypatch.setattr(_files, "_exchange", lambda a, b: (events.append(("publish", Path(b))), real_exchange(a, b))[1])
    save()
    monkeypatch.undo()
    publish = max(i for i, (kind, path) in enumerate(events) if kind == "publish" and path == target)
    flushed_before = {path.name for kind, path in events[:publish] if kind == "fsync"}
    written = {target.name} if saver == "save" else {p.name for p in target.iterdir()}
    assert all(any(f.startswith(f".{name}.") or f == name for f in flushed_before) for name in written), (written, events)
    if saver != "save":  # the new directory's own entries (new files, links carried over), after the last of them
        last_entry = max(i for i, (kind, path) in enumerate(events[:publish]) if path.parent.name.startswith(f".{target.name}."))
        assert any(kind == "fsync" and path.name.startswith(f".{target.name}.") for kind, path in events[last_entry:publish]), events
    assert ("fsync", tmp_path) in events[publish + 1 :], events
