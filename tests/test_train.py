"""lora_func.train: the loss, one step (autocast, scaler, unscale-then-clip), NaN errors, the
loop with its progress bar, and a bit-identical resume."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import lora_func as lf
from lora_func._model import weight_fingerprint
from lora_func.train import (
    IGNORE_INDEX,
    TrainState,
    adapter_loss,
    causal_lm_loss,
    fit,
    load_checkpoint,
    make_optimizer,
    save_checkpoint,
    train_step,
)
from tests.crashes import crashed_during
from tests.models import DEFAULT_TARGETS, VOCAB, tiny_model


def _successor_batch(step: int, batch: int = 8, length: int = 10) -> dict[str, torch.Tensor]:
    """A pure function of ``step``: next token = (token + 1) mod VOCAB, which the random base
    cannot do and a LoRA on q/v learns in a few tens of steps."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = (torch.randint(0, VOCAB, (batch, 1), generator=g) + torch.arange(length)) % VOCAB
    return {"input_ids": ids}


def _learnt(history) -> bool:
    """The mean loss of the last 5 steps is 25 % below the first step's (an adapter that does
    not train stays at the first value, about ln(VOCAB) = 4.1 plus the random B's error)."""
    last = [s.loss for s in history[-5:]]
    return sum(last) / len(last) < 0.75 * history[0].loss


def _state(model, *, lr=2e-2, scaler=None, variant="lora", seed=0) -> TrainState:
    spec = lf.AdapterSpec(variant, targets=DEFAULT_TARGETS["llama"], r=4)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed))
    # Non-zero B: every tensor gets gradients from step 0 and a wrong formula shows at once.
    with torch.no_grad():
        for key, p in adapter.params.items():
            if key.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(key) % 1000))
    return TrainState(adapter, make_optimizer(adapter, lr), scaler)


def _fingerprints(model):
    return {name: weight_fingerprint(t) for name, t in model.state_dict().items()}


def test_adapter_loss_equals_the_models_own_loss_with_ignored_positions():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=DEFAULT_TARGETS["llama"], r=4))  # B = 0: a no-op
    batch = _successor_batch(0)
    labels = batch["input_ids"].clone()
    labels[:, :4] = IGNORE_INDEX
    ours = adapter_loss(model, adapter, {**batch, "labels": labels})
    theirs = model(batch["input_ids"], labels=labels).loss  # transformers' shift and ignore_index as the oracle
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert causal_lm_loss(torch.zeros(1, 3, 5, dtype=torch.bfloat16), torch.tensor([[0, 1, 2]])).dtype == torch.float32


def test_fit_learns_with_a_progress_bar_and_never_touches_the_model(capsys):
    model = tiny_model("llama")
    before = _fingerprints(model)
    state = _state(model)
    seen = []
    history = fit(model, state, _successor_batch, 40, on_step=seen.append, desc="unit-fit")
    assert [s.step for s in history] == list(range(40)) == [s.step for s in seen] and state.step == 40
    assert _learnt(history), [s.loss for s in history]
    assert "unit-fit" in capsys.readouterr().err  # tqdm writes to stderr
    assert _fingerprints(model) == before and all(p.grad is None for p in model.parameters())


def test_one_step_unscales_before_clipping_then_steps():
    """Oracle: torch.func.grad of the fp32 loss, clipped by hand, a plain SGD step (Adam's first
    step would hide the gradient's scale). A scaler whose scale is a power of two unscales
    exactly, so the params must match; clipping the *scaled* gradients (unscale after clip)
    would clip 1024x harder and differ."""
    model = tiny_model("llama")
    state = _state(model, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    state.optimizer = torch.optim.SGD(list(state.adapter.params.values()), lr=1.0)
    oracle_params = {k: v.detach().clone().requires_grad_(True) for k, v in state.adapter.params.items()}
    batch = _successor_batch(0)
    max_norm = 0.05

    grads = torch.func.grad(lambda p: adapter_loss(model, state.adapter.with_params(p), batch))(
        {k: v.detach() for k, v in oracle_params.items()}
    )
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert norm > 4 * max_norm  # clipping is active in this test
    with torch.no_grad():
        for key, p in oracle_params.items():
            p -= grads[key] * (max_norm / (norm + 1e-6))

    stats = train_step(model, state, batch, max_grad_norm=max_norm)
    assert not stats.skipped and math.isclose(stats.grad_norm, norm.item(), rel_tol=1e-5)
    for key, expected in oracle_params.items():
        torch.testing.assert_close(state.adapter.params[key], expected, rtol=1e-5, atol=1e-7, msg=key)


def test_fp16_base_with_grad_scaler_skips_overflows_then_trains_without_nan():
    model = tiny_model("llama", dtype=torch.float16)
    # 2**24 overflows fp16 activation gradients: the first steps must be skipped, not raise.
    state = _state(model, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**24))
    history = fit(model, state, _successor_batch, 40, progress=False)
    skipped = [s.step for s in history if s.skipped]
    # The scale halves per skipped step from 2**24 until gradients fit: the first steps are
    # skipped, then (an occasional overflow aside) the steps train.
    assert skipped[:3] == [0, 1, 2] and len(skipped) <= 12, skipped
    trained = [s for s in history if not s.skipped]
    assert all(math.isfinite(s.loss) for s in history)
    assert _learnt(trained), [s.loss for s in trained]
    for key, p in state.adapter.params.items():
        assert p.dtype == torch.float32 and torch.isfinite(p).all(), key  # fp32 adapter on the fp16 base
    assert state.scaler.get_scale() < 2.0**24


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16], ids=["fp32-base", "bf16-base"])
def test_bf16_autocast_trains_without_nan(base_dtype):
    model = tiny_model("llama", dtype=base_dtype)
    state = _state(model)
    dtypes = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    try:
        history = fit(model, state, _successor_batch, 40, autocast_dtype=torch.bfloat16, progress=False)
    finally:
        hook.remove()
    assert set(dtypes) == {torch.bfloat16}  # on the fp32 base too: autocast ran the matmuls in bf16
    assert all(math.isfinite(s.loss) and not s.skipped for s in history)
    assert _learnt(history), [s.loss for s in history]
    assert all(p.dtype == torch.float32 for p in state.adapter.params.values())


def test_fp16_autocast_on_an_fp32_base_with_a_grad_scaler_trains_without_nan():
    model = tiny_model("llama")
    dtypes = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    try:
        state = _state(model, scaler=torch.amp.GradScaler("cpu"))
        history = fit(model, state, _successor_batch, 40, autocast_dtype=torch.float16, progress=False)
    finally:
        hook.remove()
    assert set(dtypes) == {torch.float16}  # the matmuls really ran in fp16
    assert all(math.isfinite(s.loss) for s in history) and sum(s.skipped for s in history) <= 5
    assert _learnt([s for s in history if not s.skipped]), [s.loss for s in history]
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in state.adapter.params.values())


def test_nan_in_an_adapter_tensor_names_the_step_and_the_tensor_and_changes_nothing():
    model = tiny_model("llama")
    state = _state(model)
    fit(model, state, _successor_batch, 2, progress=False)
    bad = "model.layers.1.self_attn.v_proj.lora_A"
    with torch.no_grad():
        state.adapter.params[bad][0, 1] = float("nan")
    snapshot = {k: v.detach().clone() for k, v in state.adapter.params.items()}
    moments = copy.deepcopy(state.optimizer.state_dict())
    with pytest.raises(FloatingPointError, match=r"before step 2.*" + bad.replace(".", r"\.")):
        train_step(model, state, _successor_batch(2))
    assert state.step == 2
    for key, value in snapshot.items():  # nothing moved (the NaN one included)
        torch.testing.assert_close(state.adapter.params[key].detach(), value, rtol=0, atol=0, equal_nan=True, msg=key)
    assert all(torch.equal(a, b) for a, b in zip(
        [t for s in state.optimizer.state_dict()["state"].values() for t in s.values()],
        [t for s in moments["state"].values() for t in s.values()], strict=True))


def test_non_finite_gradient_without_a_scaler_names_the_step_and_the_tensor():
    model = tiny_model("llama")
    state = _state(model)
    bad = "model.layers.0.self_attn.q_proj.lora_B"
    before = state.adapter.params[bad].detach().clone()
    state.adapter.params[bad].register_hook(lambda g: g * float("inf"))  # finite loss, inf gradient
    with pytest.raises(FloatingPointError, match=r"gradients at step 0.*" + bad.replace(".", r"\.")):
        train_step(model, state, _successor_batch(0))
    assert torch.equal(state.adapter.params[bad], before)


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16-base+scaler"])
def test_resume_from_a_checkpoint_continues_bit_identically(tmp_path, half):
    dtype = torch.float16 if half else torch.float32

    def fresh():
        model = tiny_model("llama", dtype=dtype)
        return model, _state(model, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**14) if half else None)

    model, straight = fresh()
    expected = fit(model, straight, _successor_batch, 8, progress=False)

    model, first = fresh()
    fit(model, first, _successor_batch, 4, progress=False)
    save_checkpoint(tmp_path / "ckpt", first)
    del first
    model = tiny_model("llama", dtype=dtype)  # a new process would start here
    resumed = load_checkpoint(tmp_path / "ckpt", model)
    assert resumed.step == 4 and (resumed.scaler is not None) == half
    tail = fit(model, resumed, _successor_batch, 8, progress=False)

    assert [(s.loss, s.grad_norm) for s in tail] == [(s.loss, s.grad_norm) for s in expected[4:]]
    for key, value in straight.adapter.params.items():
        assert torch.equal(resumed.adapter.params[key], value), key
    if half:
        assert resumed.scaler.get_scale() == straight.scaler.get_scale()


# (module, attribute, which call): the steps of save_checkpoint; the crash comes just before or
# just after that call. The fsync calls: the adapter's temporary file and its directory
# (lora_func.save), each of the three files, the new directory, then its parent.
CHECKPOINT_STEPS = {
    "adapter": ("lora_func.io.native", "save_file", 1),
    "optimizer": ("lora_func.train.checkpoint", "save_file", 1),
    "first-flush": ("lora_func.io._files", "fsync", 1),
    "files-flushed": ("lora_func.io._files", "fsync", 6),
    "exchange": ("lora_func.io._files", "_exchange", 1),
    "rename": ("os", "rename", 1),
    "last-flush": ("lora_func.io._files", "fsync", 7),
    "cleanup": ("shutil", "rmtree", 1),
}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", sorted(CHECKPOINT_STEPS))
@pytest.mark.parametrize("exists", [True, False], ids=["over-a-checkpoint", "new-directory"])
def test_a_crash_while_saving_a_checkpoint_leaves_the_old_or_the_new_one(tmp_path, monkeypatch, exists, step, when):
    """save_checkpoint of step 3 over the checkpoint of step 2 (with a file that is not ours),
    or into a new directory, crashing just before or after each step of the save: the
    directory then holds exactly the old checkpoint or exactly the new one, never step 3's
    adapter with step 2's optimiser; no temporary entry is left next to it."""
    import importlib

    model = tiny_model("llama")
    state = _state(model)
    fit(model, state, _successor_batch, 2, progress=False)
    directory = tmp_path / "ckpt"
    if exists:
        save_checkpoint(directory, state)
        (directory / "notes.txt").write_text("kept\n")
    old = _dir_bytes(directory)
    fit(model, state, _successor_batch, 3, progress=False)
    new = _dir_bytes(save_checkpoint(tmp_path / "reference", state)) | ({"notes.txt": b"kept\n"} if exists else {})
    assert new != old

    module, name, nth = CHECKPOINT_STEPS[step]
    crashed = crashed_during(monkeypatch, importlib.import_module(module), name, nth, when, lambda: save_checkpoint(directory, state))
    now = _dir_bytes(directory)
    assert now in (old, new), f"{'crashed' if crashed else 'finished'}: {sorted(now)} is a mix of two checkpoints"
    assert crashed or now == new
    if not (crashed and step == "cleanup" and when == "before"):
        litter = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("ckpt", "reference"))
        assert litter == [], f"temporary entries left behind: {litter}"
        assert (directory.exists()) == bool(now)
    if now:
        resumed = load_checkpoint(directory, tiny_model("llama"))
        assert resumed.step == (3 if now == new else 2)


def test_save_checkpoint_refuses_a_file_and_names_it(tmp_path):
    model = tiny_model("llama")
    (tmp_path / "ckpt").write_text("not a checkpoint")
    with pytest.raises(NotADirectoryError, match=r"save_checkpoint: .*ckpt exists and is not a directory"):
        save_checkpoint(tmp_path / "ckpt", _state(model))
    assert (tmp_path / "ckpt").read_text() == "not a checkpoint"


def _dir_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()} if directory.exists() else {}


def test_load_checkpoint_names_the_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not a lora_func training checkpoint.*optimizer\.safetensors"):
        load_checkpoint(tmp_path, tiny_model("llama"))


def test_adapter_loss_is_a_pure_function_for_torch_func_grad():
    model = tiny_model("llama")
    state = _state(model)
    batch = _successor_batch(3)
    grads = torch.func.grad(lambda p: adapter_loss(model, state.adapter.with_params(p), batch))(state.adapter.params)
    adapter_loss(model, state.adapter, batch).backward()
    for key, p in state.adapter.params.items():
        torch.testing.assert_close(grads[key], p.grad, msg=key)
