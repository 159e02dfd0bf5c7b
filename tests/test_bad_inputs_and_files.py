"""Bad inputs and files outside the call path (issue 22, reliability round two): wrong models on load,
non-finite hyperparameters, training checkpoints, integer bases, hostile files, catalogue
promises, raw errors at the boundary, file-system details; and issue 21 item 3 (leaf params
from ``stack``, ``detach`` into new storage). Every test here failed before its fix.

Small hand-built models wherever the point is an argument or a file, so the file runs in a
few seconds; the numerical oracle is always an independent computation (a per-member loop,
the explicit ``W + s·B·A``, peft's own scale formula), never the code under test.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import lora_func as lf
from lora_func.io import _files, load_peft, native, save_peft
from lora_func.train import TrainState, load_checkpoint, make_optimizer, save_checkpoint, train_step
from tests.contract_helpers import assert_unchanged, snapshot
from tests.models import Net, tiny_model, tokens


def lora(model: nn.Module, seed: int = 0, **kwargs) -> lf.Adapter:
    kwargs.setdefault("r", 2)
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["proj"], **kwargs), generator=torch.Generator().manual_seed(seed))
    # LoRA starts with B = 0; a non-zero B makes every adapter visible in the outputs.
    return adapter.with_params({k: (v + 0.3 if k.endswith("lora_B") else v).detach().requires_grad_(True) for k, v in adapter.params.items()})


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ------------------------------------------------------------------ 1. wrong results, no warning


def test_load_refuses_a_linear_adapter_on_a_same_named_same_shaped_conv1d(tmp_path):
    path = lf.save(lora(Net()), tmp_path / "a.safetensors")
    conv = Net(proj=Conv1D(8, 8))
    snap = snapshot(conv)
    with pytest.raises(ValueError, match="adapter built for a linear layer, the model's is conv1d") as err:
        lf.load(path, model=conv)
    assert "proj.weight" in str(err.value)
    assert_unchanged(conv, snap)


def test_load_onto_a_meta_model_is_refused_instead_of_losing_the_values(tmp_path):
    path = lf.save(lora(Net()), tmp_path / "a.safetensors")
    with torch.device("meta"):
        meta = Net()
    with pytest.raises(ValueError, match="meta") as err:
        lf.load(path, model=meta)
    assert "proj.weight" in str(err.value) and "to_empty" in str(err.value)
    # Without model= the values come back (the documented way round).
    assert torch.equal(lf.load(path).params["proj.lora_B"], torch.full((8, 2), 0.3))


# ------------------------------------------------------------ 2. non-finite hyperparameters


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -math.inf])
def test_spec_refuses_a_non_finite_alpha(alpha):
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        lf.AdapterSpec("lora", targets=["proj"], alpha=alpha)


@pytest.mark.parametrize(
    ("variant", "option"),
    [("eva", {"rho": math.nan}), ("eva", {"rho": math.inf})],
)
def test_spec_refuses_every_non_finite_float_option(variant, option):
    # Beyond the example (eva rho=nan): every float option the variant's own check lets
    # through, NaN and inf alike (eva's rho=inf passes `rho < 1` and overflows round(r*rho)).
    with pytest.raises(ValueError, match="must be a finite number") as err:
        lf.AdapterSpec(variant, targets=["proj"], **option)
    assert next(iter(option)) in str(err.value)
    # The one documented infinite value stays valid: antipasto's max_rotation_angle=inf (no clamp).
    assert lf.AdapterSpec("antipasto", targets=["proj"], max_rotation_angle=math.inf).option("max_rotation_angle") == math.inf


def test_combine_refuses_non_finite_weights():
    model = Net()
    a, b = lora(model), lora(model, seed=1)
    for bad in ([math.nan, 0.5], [0.5, math.inf]):
        with pytest.raises(ValueError, match="hold a NaN or inf"):
            lf.combine([a, b], bad)


def _peft_dir(tmp_path: Path, model: nn.Module) -> Path:
    return save_peft(lora(model), tmp_path / "ckpt", model=model)


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(config))  # json writes NaN / Infinity, as a hostile file would


@pytest.mark.parametrize(
    "changes",
    [
        {"lora_alpha": math.nan},
        {"lora_alpha": math.inf},
        {"alpha_pattern": {"proj": math.nan}},
        {"r": "2"},
        {"r": 2.0},
        {"use_rslora": "yes"},
        {"rank_pattern": {"(": 2}},
        {"rank_pattern": ["proj"]},
        {"target_modules": 5},
        {"eva_config": {"rho": math.nan}},
    ],
    ids=lambda c: json.dumps(c),
)
def test_load_peft_refuses_invalid_config_values(tmp_path, changes):
    model = Net()
    directory = _peft_dir(tmp_path, model)
    _edit_config(directory, **changes)
    snap = snapshot(model)
    with pytest.raises(ValueError, match="has invalid values") as err:
        load_peft(directory, model)
    assert next(iter(changes)) in str(err.value)
    assert_unchanged(model, snap)


def test_load_peft_with_1e999_in_the_text_is_refused(tmp_path):
    model = Net()
    directory = _peft_dir(tmp_path, model)
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config["lora_alpha"] = 12345
    path.write_text(json.dumps(config).replace("12345", "1e999"))
    with pytest.raises(ValueError, match=r"lora_alpha=inf"):
        load_peft(directory, model)


# ------------------------------------------------------------------------- 3. checkpoints


def _trained_checkpoint(tmp_path: Path):
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2), generator=torch.Generator().manual_seed(0))
    state = TrainState(adapter, make_optimizer(adapter, lr=1e-2))
    train_step(model, state, {"input_ids": tokens()})
    return model, save_checkpoint(tmp_path / "ckpt", state)


def _reseal(directory: Path, tensors: dict[str, torch.Tensor] | None = None, state_text: str | None = None) -> None:
    """Rewrite the checkpoint's files with checksums recomputed, as a hostile edit would."""
    from safetensors.torch import load_file, save_file

    from lora_func.train import checkpoint as train

    opt = directory / "optimizer.safetensors"
    tensors = load_file(str(opt)) if tensors is None else tensors
    text = (directory / "trainer_state.json").read_text() if state_text is None else state_text
    (directory / "trainer_state.json").write_text(text)
    if not hasattr(train, "tensors_digest"):  # checkpoints without checksums (before issue 22)
        save_file(tensors, str(opt))
        return
    digests = {"tensors_sha256": train.tensors_digest(tensors), "trainer_state_sha256": hashlib.sha256(text.encode()).hexdigest()}
    save_file(tensors, str(opt), metadata={train._DIGESTS: json.dumps(digests, sort_keys=True)})


def test_a_flipped_bit_in_the_moments_is_refused(tmp_path):
    model, directory = _trained_checkpoint(tmp_path)
    intact = load_checkpoint(directory, model)  # the checks pass on an intact checkpoint
    assert intact.step == 1 and len(intact.optimizer.state) == len(intact.adapter.params) == 4
    path = directory / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is corrupted") as err:
        load_checkpoint(directory, model)
    assert "optimizer.safetensors" in str(err.value)


def test_an_adapter_file_from_another_step_is_refused(tmp_path):
    # Beyond the examples: save_checkpoint never mixes steps, but a hand-copied file can.
    import shutil

    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2), generator=torch.Generator().manual_seed(0))
    state = TrainState(adapter, make_optimizer(adapter, lr=1e-2))
    train_step(model, state, {"input_ids": tokens()})
    first = save_checkpoint(tmp_path / "step1", state)
    train_step(model, state, {"input_ids": tokens()})
    second = save_checkpoint(tmp_path / "step2", state)
    shutil.copy(first / "adapter.safetensors", second / "adapter.safetensors")
    with pytest.raises(ValueError, match=r"is corrupted: \['adapter.safetensors'\]"):
        load_checkpoint(second, model)


def test_an_edited_learning_rate_is_refused(tmp_path):
    model, directory = _trained_checkpoint(tmp_path)
    path = directory / "trainer_state.json"
    path.write_text(path.read_text().replace('"lr": 0.01', '"lr": 10.0'))
    with pytest.raises(ValueError, match=r"is corrupted: \['trainer_state.json'\]"):
        load_checkpoint(directory, model)


@pytest.mark.parametrize(
    "damage",
    ["shape", "dtype", "nan", "unknown-name", "missing-field"],
)
def test_damaged_moments_are_refused_at_load_not_in_a_half_applied_step(tmp_path, damage):
    from safetensors.torch import load_file

    model, directory = _trained_checkpoint(tmp_path)
    tensors = load_file(str(directory / "optimizer.safetensors"))
    key = sorted(k for k in tensors if k.endswith("/exp_avg"))[-1]
    if damage == "shape":
        tensors[key] = tensors[key][:1]
    elif damage == "dtype":
        tensors[key] = tensors[key].to(torch.int32)
    elif damage == "nan":
        tensors[key] = tensors[key].clone().fill_(math.nan)
    elif damage == "unknown-name":
        tensors["model.layers.7.nope.lora_A/exp_avg"] = tensors.pop(key)
    else:
        del tensors[key]
    _reseal(directory, tensors)
    with pytest.raises(ValueError, match="holds optimizer moments that do not fit the adapter"):
        load_checkpoint(directory, model)


@pytest.mark.parametrize(
    "text",
    ['{"step": 1, "optimi', "[]", '{"step": "3"}', "deep"],
    ids=["truncated", "not-an-object", "wrong-types", "deeply-nested"],
)
def test_a_damaged_trainer_state_names_its_path(tmp_path, text):
    model, directory = _trained_checkpoint(tmp_path)
    if text == "deep":
        text = "[" * 100_000 + "]" * 100_000
    elif text == '{"step": "3"}':
        meta = json.loads((directory / "trainer_state.json").read_text())
        text = json.dumps(meta | {"step": "3", "param_groups": "all"})
    _reseal(directory, state_text=text)
    with pytest.raises(ValueError, match="is not a valid lora_func trainer state") as err:
        load_checkpoint(directory, model)
    assert type(err.value) is ValueError and "trainer_state.json" in str(err.value)


@pytest.mark.parametrize(
    "group",
    [{"betas": [2.0, 0.5]}, {"eps": 0.0}, {"weight_decay": -1.0}, {"lr": "0.1"}],
    ids=lambda g: json.dumps(g),
)
def test_out_of_range_optimiser_hyperparameters_are_refused(tmp_path, group):
    # Beyond the examples: torch.optim validates these in its constructor only, and
    # load_state_dict puts the saved groups back unchecked.
    model, directory = _trained_checkpoint(tmp_path)
    meta = json.loads((directory / "trainer_state.json").read_text())
    meta["param_groups"][0] |= group
    _reseal(directory, state_text=json.dumps(meta))
    with pytest.raises(ValueError, match="is not a valid lora_func trainer state") as err:
        load_checkpoint(directory, model)
    assert next(iter(group)) in str(err.value)


def test_a_truncated_optimizer_file_names_its_path(tmp_path):
    model, directory = _trained_checkpoint(tmp_path)
    path = directory / "optimizer.safetensors"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match="is not a readable safetensors file") as err:
        load_checkpoint(directory, model)
    assert "optimizer.safetensors" in str(err.value)


def test_train_step_refuses_a_misfit_moment_before_updating_any_tensor():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2), generator=torch.Generator().manual_seed(0))
    state = TrainState(adapter, make_optimizer(adapter, lr=1e-2))
    train_step(model, state, {"input_ids": tokens()})
    last = list(adapter.params.values())[-1]
    state.optimizer.state[last]["exp_avg"] = torch.zeros(3)  # only the last tensor's moment is bad
    before = {k: v.detach().clone() for k, v in adapter.params.items()}
    with pytest.raises(ValueError, match="nothing was updated"):
        train_step(model, state, {"input_ids": tokens()})
    for key, value in adapter.params.items():
        assert torch.equal(value, before[key]), f"{key} was updated by a step that then failed"


# ------------------------------------------------------------------ 4. integer / quantized bases


def _int8_net() -> Net:
    net = Net()
    net.proj.weight = nn.Parameter(torch.randint(-5, 5, (8, 8), dtype=torch.int8), requires_grad=False)
    return net


def test_merge_refuses_an_int8_base():
    adapter = lora(Net())
    int_net = _int8_net()
    snap = snapshot(int_net)
    with pytest.raises(TypeError, match="not floating-point") as err:
        lf.merged_state_dict(int_net, adapter)
    assert "proj.weight (torch.int8)" in str(err.value)
    with pytest.raises(TypeError, match="not floating-point"):
        lf.merged_state_dict(lf.base_params(int_net), adapter)
    assert_unchanged(int_net, snap)


def test_load_and_load_peft_refuse_an_int8_base(tmp_path):
    model = Net()
    path = lf.save(lora(model), tmp_path / "a.safetensors")
    directory = _peft_dir(tmp_path, model)
    with pytest.raises(TypeError, match="not floating-point"):
        lf.load(path, model=_int8_net())
    with pytest.raises(TypeError, match="not floating-point"):
        load_peft(directory, _int8_net())


# --------------------------------------------------------------------------- 5. hostile files


def _resealed_native(path: Path, edit_tensors=None, edit_metadata=None) -> Path:
    """``path`` with its tensors / metadata edited and the checksum recomputed."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    tensors = edit_tensors(tensors) if edit_tensors else tensors
    meta = edit_metadata(meta) if edit_metadata else meta
    meta["digest"] = native._file_digest(meta, tensors)
    out = path.with_name("hostile.safetensors")
    save_file(tensors, str(out), metadata=meta)
    return out


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t | {"params/proj.lora_A": t["params/proj.lora_A"][:1]},
        lambda t: t | {"params/proj.lora_A": t["params/proj.lora_A"].double()},
        lambda t: t | {"params/proj.lora_A": torch.zeros(2, 2, 8)},
        lambda t: t | {"params/proj.lora_B": t["params/proj.lora_B"].to(torch.int64)},
    ],
    ids=["shape", "dtype", "stacked-one-tensor", "integer"],
)
def test_a_resealed_file_whose_tensors_contradict_the_metadata_is_refused(tmp_path, edit):
    model = Net()
    path = _resealed_native(lf.save(lora(model), tmp_path / "a.safetensors"), edit_tensors=edit)
    for kwargs in ({}, {"model": model}):
        with pytest.raises(ValueError, match="its tensors do not match its metadata") as err:
            lf.load(path, **kwargs)
        assert "params/proj.lora_" in str(err.value) or "different stack shapes [(), (2,)]" in str(err.value)


def test_a_deeply_nested_metadata_tree_is_refused(tmp_path):
    model = Net()
    deep = "[" * 100_000 + "]" * 100_000
    path = _resealed_native(lf.save(lora(model), tmp_path / "a.safetensors"), edit_metadata=lambda m: m | {"tree": deep})
    with pytest.raises(ValueError, match="has damaged lora_func metadata"):
        lf.load(path)
    # A composition tree nested deeper than the recursion limit (well-formed JSON).
    nested = '{"kind": "composed", "parts": [' * 5000 + '{"kind": "adapter"}' + "]}" * 5000
    path = _resealed_native(path, edit_metadata=lambda m: m | {"tree": nested})
    with pytest.raises(ValueError, match="has damaged lora_func metadata"):
        lf.load(path)


def test_a_deeply_nested_peft_config_is_refused(tmp_path):
    model = Net()
    directory = _peft_dir(tmp_path, model)
    (directory / "adapter_config.json").write_text('{"peft_type": "LORA", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match="is not a peft config"):
        load_peft(directory, model)


def test_target_modules_that_match_nothing_are_refused(tmp_path):
    model = Net()
    directory = _peft_dir(tmp_path, model)
    _edit_config(directory, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="matches no module of Net"):
        load_peft(directory, model)


def _as_legacy_bin(directory: Path, payload: bytes) -> None:
    (directory / "adapter_model.safetensors").unlink()
    (directory / "adapter_model.bin").write_bytes(payload)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("payload", ["list", "malicious", "non-tensor-values"])
def test_a_hostile_legacy_bin_is_refused_without_running_code(tmp_path, payload):
    import io

    model = Net()
    directory = _peft_dir(tmp_path, model)
    buffer = io.BytesIO()
    if payload == "list":
        torch.save([torch.zeros(2)], buffer)
    elif payload == "non-tensor-values":
        torch.save({"base_model.model.proj.lora_A.weight": 3}, buffer)
    else:
        buffer.write(pickle.dumps(_Boom(), protocol=2))
    _as_legacy_bin(directory, buffer.getvalue())
    with pytest.raises(ValueError, match="are not readable") as err:
        load_peft(directory, model)
    assert type(err.value) is ValueError


def test_an_unhashable_peft_type_is_refused(tmp_path):
    model = Net()
    directory = _peft_dir(tmp_path, model)
    _edit_config(directory, peft_type=["LORA"])
    with pytest.raises(ValueError, match="lora_func reads peft_type"):
        load_peft(directory, model)


# --------------------------------------------------------------- 6. catalogue promises kept


def _stack_of_two():
    model = Net()
    return model, lf.stack([lora(model), lora(model, seed=1)])


def test_mixed_call_refuses_a_negative_index():
    model, stacked = _stack_of_two()
    x = torch.randn(2, 8)
    with pytest.raises(IndexError, match=r"outside \[0, 2\)") as err:
        lf.mixed_call(model, stacked, torch.tensor([0, -1]), x)
    assert "index -1" in str(err.value)


@pytest.mark.parametrize("index", [True, False, -1, 2, torch.tensor([True, False]), torch.tensor([0.0, 1.0]), torch.tensor([-1]), torch.tensor([[0]])])
def test_take_refuses_what_is_not_a_stack_position(index):
    _, stacked = _stack_of_two()
    with pytest.raises((TypeError, IndexError), match="take\\(\\): index"):
        lf.take(stacked, index)
    # Valid positions still pick members.
    b = lf.unstack(stacked)[1]
    assert torch.equal(lf.take(stacked, 1).params["proj.lora_A"], b.params["proj.lora_A"])
    picked = lf.take(stacked, torch.tensor([1, 0, 1]))
    assert picked.stack_shape == (3,) and torch.equal(picked.params["proj.lora_A"][2], b.params["proj.lora_A"])


def test_combine_of_stacked_parts_with_unstacked_weights_is_refused():
    model, stacked = _stack_of_two()
    with pytest.raises(ValueError, match="the parts are stacked"):
        lf.combine([stacked, stacked], [0.5, 0.5])
    # The supported route: combine members, then stack the combinations.
    a, b = lf.unstack(stacked)
    both = lf.stack([lf.combine([a, b], [0.5, 0.5]), lf.combine([b, a], [0.5, 0.5])])
    assert both.stack_shape == (2,) and both.weights.shape == (2, 2)


# ------------------------------------------------------------- 7. raw errors at the boundary


def test_spec_layer_types_of_the_wrong_type_is_refused():
    for bad in (5, "linear", (5, "x")):
        with pytest.raises((TypeError, ValueError), match="layer_types") as err:
            lf.AdapterSpec("lora", targets=["proj"], layer_types=bad)
        assert "linear" in str(err.value)


@pytest.mark.parametrize("call", ["mixed_call", "ensemble_call", "load", "load_peft", "load_checkpoint", "train_step"])
def test_a_non_module_model_is_named(tmp_path, call):
    model, stacked = _stack_of_two()
    state_dict = model.state_dict()
    calls = {
        "mixed_call": lambda: lf.mixed_call(state_dict, stacked, torch.tensor([0]), torch.randn(1, 8)),
        "ensemble_call": lambda: lf.ensemble_call(state_dict, stacked, torch.randn(1, 8)),
        "load": lambda: lf.load(lf.save(lora(model), tmp_path / "a.safetensors"), model=state_dict),
        "load_peft": lambda: load_peft(tmp_path, state_dict),
        "load_checkpoint": lambda: load_checkpoint(tmp_path, state_dict),
        "train_step": lambda: train_step(state_dict, None, {}),  # type: ignore[arg-type]
    }
    with pytest.raises(TypeError, match="must be a torch.nn.Module") as err:
        calls[call]()
    assert call in str(err.value) and "OrderedDict" in str(err.value)


def test_a_base_that_is_not_a_dict_of_tensors_is_named():
    model, stacked = _stack_of_two()
    adapter = lora(model)
    with pytest.raises(TypeError, match="base must map names"):
        lf.merged_state_dict({**lf.base_params(model), "proj.weight": [[0.0]]}, adapter)
    with pytest.raises(TypeError, match="base must be a dict"):
        lf.ensemble_call(model, stacked, torch.randn(1, 8), base=list(lf.base_params(model).items()))


def test_per_example_grads_with_a_non_callable_is_named():
    model = Net()
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        lf.per_example_grads(lora(model), lora(model), torch.randn(2, 8))


def test_with_params_refuses_integer_tensors():
    adapter = lora(Net())
    with pytest.raises(TypeError, match="must be floating-point tensors") as err:
        adapter.with_params({k: v.detach().to(torch.int64) for k, v in adapter.params.items()})
    assert "proj.lora_A" in str(err.value)


# ---------------------------------------------------------------------- 8. files, last details


def test_disk_full_in_safetensors_surfaces_as_oserror(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    adapter = lora(Net())

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })")

    monkeypatch.setattr(native, "save_file", full)
    with pytest.raises(OSError, match="No space left") as err:
        lf.save(adapter, tmp_path / "a.safetensors")
    assert "a.safetensors" in str(err.value)
    assert files_under(tmp_path) == []


def test_a_failed_save_into_new_sub_directories_leaves_none(tmp_path, monkeypatch):
    model = Net()
    adapter = lora(model)
    (tmp_path / "keep").mkdir()

    def crash(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(native, "save_file", crash)
    with pytest.raises(OSError):
        lf.save(adapter, tmp_path / "keep" / "new" / "deeper" / "a.safetensors")
    from lora_func.io import peft

    monkeypatch.setattr(peft, "save_file", crash)
    with pytest.raises(OSError):
        save_peft(adapter, tmp_path / "keep" / "fresh" / "ckpt", model=model)
    assert files_under(tmp_path) == ["keep"]


def test_two_first_saves_into_one_new_directory_both_succeed(tmp_path, monkeypatch):
    """The race of two processes, made deterministic: the other writer's first save lands
    between this one's existence check and its rename."""
    model = Net()
    mine, theirs = lora(model), lora(model, seed=1)
    directory = tmp_path / "new" / "ckpt"
    real_rename = os.rename
    raced = []

    def rename_after_the_other(src, dst):
        if Path(dst) == directory and not raced:
            raced.append(True)
            save_peft(theirs, directory, model=model)  # the other process wins the race
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_after_the_other)
    save_peft(mine, directory, model=model)
    monkeypatch.undo()
    assert raced
    loaded = load_peft(directory, model)
    assert torch.equal(loaded.params["proj.lora_B"], mine.params["proj.lora_B"].detach())
    assert [p.name for p in directory.parent.iterdir()] == ["ckpt"], "a temporary directory was left"


# ------------------------------------------------------ 10c. equal rank, different alpha


def test_a_stack_of_equal_rank_and_different_alpha_keeps_each_members_scale():
    model = Net()
    members = [lora(model, r=2, alpha=1.0), lora(model, seed=1, r=2, alpha=16.0)]
    stacked = lf.stack(members)
    x = torch.randn(3, 8)
    together = lf.ensemble_call(model, stacked, x)
    base = lf.base_params(model)
    for k, member in enumerate(members):
        # Oracle: the explicit merged weight W + (alpha / r) B A, through the plain model.
        a, b = member.params["proj.lora_A"].detach(), member.params["proj.lora_B"].detach()
        w = base["proj.weight"] + member.spec.alpha / 2 * b @ a
        expected = torch.func.functional_call(model, base | {"proj.weight": w}, (x,))
        torch.testing.assert_close(together[k], expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(together[0], together[1])


# -------------------------------------------------- issue 21 item 3: leaves, fresh storage


def test_stack_gives_leaf_params_an_optimiser_accepts_and_steps():
    model = Net()
    members = [lora(model), lora(model, seed=1)]
    stacked = lf.stack(members)
    assert all(p.is_leaf and p.requires_grad for p in stacked.params.values())
    optimizer = torch.optim.SGD(stacked.params.values(), lr=0.1)
    lf.ensemble_call(model, stacked, torch.randn(2, 8)).sum().backward()
    before = {k: v.detach().clone() for k, v in stacked.params.items()}
    optimizer.step()
    assert not torch.equal(stacked.params["proj.lora_A"], before["proj.lora_A"])
    # The members are not touched by training the stack.
    assert torch.equal(members[0].params["proj.lora_B"], lora(model).params["proj.lora_B"])
    combined = lf.stack([lf.combine(members, [0.5, 0.5]), lf.combine(members, [0.2, 0.8])])
    assert all(p.is_leaf for p in combined.params.values())
    # Stacking inside torch.func.grad, or through an autograd graph, keeps the history: the
    # gradients still reach the members.
    a, b = members
    x = torch.randn(2, 8)

    def loss(params):
        return lf.ensemble_call(model, lf.stack([a.with_params(params), b]), x)[0].square().sum()

    grads = torch.func.grad(loss)(a.params)
    assert all(g.abs().sum() > 0 for g in grads.values())
    scaled = a.with_params({k: v * 2 for k, v in a.params.items()})
    lf.ensemble_call(model, lf.stack([scaled, b]), x)[0].sum().backward()
    assert all(p.grad is not None for p in a.params.values())




def test_detach_gives_fresh_leaves_that_do_not_share_storage():
    model = Net()
    original = lora(model)
    kept = {k: v.detach().clone() for k, v in {**original.params, **original.buffers}.items()}
    copy = original.detach()
    assert all(p.is_leaf and p.requires_grad for p in copy.params.values())
    optimizer = torch.optim.SGD(copy.params.values(), lr=0.5)
    lf.adapted_call(model, copy, torch.randn(2, 8)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        for t in copy.buffers.values():
            t.add_(1.0)
    for key, value in {**original.params, **original.buffers}.items():
        assert torch.equal(value, kept[key]), f"{key} of the original changed with its detached copy"
    for part in (lf.compose(original).detach(), lf.combine([original], [1.0]).detach()):
        for key, value in part.params.items():
            if key != "weights":
                assert value.untyped_storage().data_ptr() != original.params[key.split("/", 1)[1]].untyped_storage().data_ptr()


# ------------------------------------------------- beyond the examples: more of each class


@pytest.mark.parametrize(
    "edit",
    [
        lambda layer: layer["info"] | {"alpha": math.nan},
        lambda layer: layer["info"] | {"alpha": math.inf},
        lambda layer: layer["info"] | {"r": 2.5},
        lambda layer: layer["info"] | {"d_in": -8},
        "layout",
        "trainable_only",
    ],
    ids=["layer-alpha-nan", "layer-alpha-inf", "float-rank", "negative-size", "unknown-layout", "trainable-only-not-bool"],
)
def test_a_resealed_file_with_non_finite_or_nonsense_layer_info_is_refused(tmp_path, edit):
    # Classes 2 and 5 together: per-layer alpha lives in the metadata, and a hostile file can
    # recompute the checksum; AdapterSpec's own check does not see per-layer info.
    def metadata(meta):
        tree = json.loads(meta["tree"])
        if edit == "layout":
            tree["layers"][0]["target"]["layout"] = "transposed"
        elif edit == "trainable_only":
            return meta | {"trainable_only": '"no"', "buffer_digests": '"x"'}
        else:
            tree["layers"][0]["info"] = edit(tree["layers"][0])
        return meta | {"tree": json.dumps(tree)}

    path = _resealed_native(lf.save(lora(Net()), tmp_path / "a.safetensors"), edit_metadata=metadata)
    with pytest.raises(ValueError, match="has damaged lora_func metadata"):
        lf.load(path)


def test_a_resealed_file_with_a_nan_spec_alpha_is_refused(tmp_path):
    def metadata(meta):
        tree = json.loads(meta["tree"])
        tree["spec"]["alpha"] = math.nan
        return meta | {"tree": json.dumps(tree)}

    path = _resealed_native(lf.save(lora(Net()), tmp_path / "a.safetensors"), edit_metadata=metadata)
    with pytest.raises(ValueError, match="has damaged lora_func metadata") as err:
        lf.load(path)
    assert "finite" in str(err.value)


def test_a_peft_checkpoint_with_integer_tensors_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = Net()
    directory = _peft_dir(tmp_path, model)
    path = directory / "adapter_model.safetensors"
    save_file({k: v.round().to(torch.int32) for k, v in load_file(str(path)).items()}, str(path))
    with pytest.raises(ValueError, match="are not floating-point") as err:
        load_peft(directory, model)
    assert "base_model.model.proj.lora_A.weight" in str(err.value)


@pytest.mark.parametrize("call", ["save", "load", "save_peft", "load_peft", "save_checkpoint", "load_checkpoint"])
def test_a_path_of_the_wrong_type_is_named(call):
    model = Net()
    adapter = lora(model)
    state = TrainState(adapter, make_optimizer(adapter, lr=0.1))
    calls = {
        "save": lambda: lf.save(adapter, 7),
        "load": lambda: lf.load(None),
        "save_peft": lambda: save_peft(adapter, 7),
        "load_peft": lambda: load_peft(None, model),
        "save_checkpoint": lambda: save_checkpoint(7, state),
        "load_checkpoint": lambda: load_checkpoint(None, model),
    }
    with pytest.raises(TypeError, match="must be a str or os.PathLike") as err:
        calls[call]()
    assert str(err.value).startswith(call)


def test_adapter_functions_name_what_is_not_an_adapter():
    model = Net()
    adapter = lora(model)
    with pytest.raises(TypeError, match=r"stack\(\) expects a list of adapters, got Adapter"):
        lf.stack(adapter)
    with pytest.raises(TypeError, match=r"stack\(\) expects a list of adapters, got int"):
        lf.stack(5)
    for call in (lambda: lf.take({}, 0), lambda: lf.unstack([adapter]), lambda: lf.stack([{}, {}]), lambda: make_optimizer({}, lr=0.1)):
        with pytest.raises(TypeError, match="expected an Adapter, Composed or Combined"):
            call()
    with pytest.raises(ValueError, match="got 'ab'"):
        lf.combine([adapter, adapter], "ab")


def test_training_arguments_are_checked_before_any_work():
    from lora_func.train import fit

    model = Net()
    adapter = lora(model)
    state = TrainState(adapter, make_optimizer(adapter, lr=0.1))
    batch = {"input_ids": torch.zeros(1, 2, dtype=torch.long)}  # never reaches the model
    with pytest.raises(TypeError, match="state must be a lora_func.train.TrainState, got AdamW"):
        train_step(model, state.optimizer, batch)  # type: ignore[arg-type]
    for bad in (math.nan, 0.0, -1.0, "1"):
        with pytest.raises(ValueError, match="max_grad_norm="):
            train_step(model, state, batch, max_grad_norm=bad)
    with pytest.raises(TypeError, match="batch_at must be a function"):
        fit(model, state, [batch], 1, progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps=-1"):
        fit(model, state, lambda step: batch, -1, progress=False)
    assert state.step == 0 and all(p.grad is None for p in adapter.params.values())


def test_a_checkpoint_save_on_a_full_disk_raises_oserror_and_leaves_nothing(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from lora_func.train import checkpoint as train

    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2), generator=torch.Generator().manual_seed(0))
    state = TrainState(adapter, make_optimizer(adapter, lr=1e-2))
    train_step(model, state, {"input_ids": tokens()})

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(train, "save_file", full)
    with pytest.raises(OSError, match="optimizer.safetensors"):
        save_checkpoint(tmp_path / "runs" / "a" / "ckpt", state)
    assert files_under(tmp_path) == []


# ------------------------------------------- 9. a user base= dict, in the files of this branch


def test_train_step_with_a_base_from_named_parameters_leaves_the_model_without_grad():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj"], r=2), generator=torch.Generator().manual_seed(0))
    reference = adapter.detach()
    batch = {"input_ids": tokens()}
    state = TrainState(adapter, make_optimizer(adapter, lr=1e-2))
    stats = train_step(model, state, batch, base=dict(model.named_parameters()) | dict(model.named_buffers()))
    assert all(p.grad is None for p in model.parameters()), "the model received gradients"
    # Oracle: the same step with the library's own base dict.
    ref_state = TrainState(reference, make_optimizer(reference, lr=1e-2))
    ref_stats = train_step(model, ref_state, batch)
    assert stats.grad_norm == pytest.approx(ref_stats.grad_norm, rel=1e-6)
    for key, value in adapter.params.items():
        torch.testing.assert_close(value, reference.params[key])


@pytest.mark.parametrize("call", ["mixed_call", "ensemble_call"])
def test_batched_calls_with_a_base_from_named_parameters_leave_the_model_without_grad(call):
    model, stacked = _stack_of_two()
    x = torch.randn(2, 8)
    base = dict(model.named_parameters())
    out = lf.mixed_call(model, stacked, torch.tensor([0, 1]), x, base=base) if call == "mixed_call" else lf.ensemble_call(model, stacked, x, base=base)
    out.square().sum().backward()
    assert all(p.grad is None for p in model.parameters()), "the model received gradients"
    assert all(p.grad is not None for p in stacked.params.values())
