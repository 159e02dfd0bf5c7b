"""lf.as_module: an adapted model as an nn.Module for HF Trainer, accelerate and torch DDP.

Every framework run is checked per tensor against lora_func's own loop (lora_func.train:
AdamW, clipping, autocast) on the same batches, from the same randomly perturbed adapter
(lora_B is zero at init: perturbing it makes every tensor's gradient nonzero at step 0 and
the update non-symmetric across layers).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# transformers.trainer decides once, at import, whether it runs in a notebook, and counts any
# process that has imported marimo as one (then it needs IPython). The dashboard tests run
# marimo inside the pytest process: import Trainer at collection, before any test runs.
from transformers import Trainer, TrainingArguments  # noqa: E402

import lora_func as lf
from lora_func import train as lft
from tests.models import VOCAB, tiny_model
from tests.peft_io_helpers import peft_warnings
from tests.spawn import run_ranks
from tests.tolerance import FP32_REL, scale_of

STEPS, BATCH, LENGTH, LR = 3, 4, 8, 5e-2
JOIN_TIMEOUT_S = 120


def _adapter(model: torch.nn.Module, variant: str = "lora", targets=("q_proj", "v_proj")) -> lf.Adapter:
    adapter = lf.init_adapter(model, lf.AdapterSpec(variant, targets=list(targets), r=2), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    return adapter.with_params({k: (v.detach() + 0.3 * torch.randn(v.shape, generator=g)).requires_grad_(True) for k, v in adapter.params.items()})


def _copy(adapter: lf.Adapter) -> lf.Adapter:
    """Fresh leaves with their own storage (the bridge and the optimisers update in place)."""
    return adapter.with_params({k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()})


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids}


def _reference(adapter: lf.Adapter, *, autocast_dtype=None, max_grad_norm=1.0) -> lf.Adapter:
    """lora_func's own loop: lora_func.train.fit with AdamW on _batch(0.._STEPS-1)."""
    model = tiny_model("llama")
    state = lft.TrainState(_copy(adapter), None)  # type: ignore[arg-type]
    state.optimizer = lft.make_optimizer(state.adapter, LR)
    lft.fit(model, state, _batch, STEPS, autocast_dtype=autocast_dtype, max_grad_norm=max_grad_norm, progress=False)
    return state.adapter


def _assert_same(got: lf.Adapter, want: lf.Adapter, start: lf.Adapter, rel: float = FP32_REL) -> None:
    """Per tensor, ``max |got - want| <= rel * max |want|``; every tensor moved by far more."""
    assert set(got.params) == set(want.params)
    for k in want.params:
        scale = scale_of(want.params[k])
        assert (want.params[k] - start.params[k]).abs().max() > 10 * rel * scale, f"{k} did not move: the check would be vacuous"
        diff = (got.params[k].detach() - want.params[k].detach()).abs().max().item()
        assert diff <= rel * scale, f"{k}: max abs diff {diff:.3g} > {rel:g} x max |want| ({scale:.3g})"


# --- the module itself ----------------------------------------------------------------------


def test_bridge_parameters_are_the_adapter_tensors_and_the_base_stays_out():
    model = tiny_model("llama")
    adapter = _adapter(model)
    bridge = lf.as_module(model, adapter)
    names = dict(bridge.named_parameters())
    assert sorted(names) == sorted(f"adapter_params.{k.replace('.', '-')}" for k in adapter.params)
    assert sorted(bridge.names.values()) == sorted(adapter.params)  # the user's names, recoverable
    for name, p in bridge.adapter_params.items():
        assert p.data_ptr() == adapter.params[bridge.names[name]].data_ptr() and p.requires_grad
    assert set(bridge.state_dict()) == {f"adapter_params.{n}" for n in bridge.names}
    assert bridge.adapter.params[next(iter(adapter.params))] is next(iter(bridge.adapter_params.values()))
    ids = _batch(0)["input_ids"]
    out = bridge(ids, labels=ids)
    torch.testing.assert_close(out.logits, lf.adapted_call(model, adapter, ids).logits, rtol=0, atol=0)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in bridge.parameters())
    assert all(p.grad is None for p in model.parameters())
    bridge.train()  # Trainer does this: the user's model keeps its own mode (eval here)
    assert bridge.training and not model.training
    assert model.config._attn_implementation == "eager"  # the base's config is not the bridge's


def test_bridge_over_a_model_configured_for_sdpa_attention():
    """PreTrainedModel.__init__ refuses an attention implementation its class does not declare;
    the bridge computes no attention itself, so it must accept whatever the base uses."""
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    adapter = _adapter(model)
    bridge = lf.as_module(model, adapter)
    ids = _batch(0)["input_ids"]
    torch.testing.assert_close(bridge(ids).logits, lf.adapted_call(model, adapter, ids).logits, rtol=0, atol=0)
    assert model.config._attn_implementation == "sdpa"


def test_bridge_refuses_bad_arguments_with_the_fix():
    model = tiny_model("llama")
    adapter = _adapter(model)
    with pytest.raises(TypeError, match="model must be the nn.Module"):
        lf.as_module(adapter, model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"as_module\(model, adapter\): adapter must be an adapter"):
        lf.as_module(model, adapter.params)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stacked .*lora_func.take"):
        lf.as_module(model, lf.stack([adapter, adapter]))
    with pytest.raises(FileNotFoundError, match="neither adapter_config.json"):
        lf.AdaptedModule.from_pretrained(Path(__file__).parent, model=model)


@pytest.mark.parametrize("variant", ["lora", "antipasto"])
def test_save_pretrained_writes_only_the_adapter_and_from_pretrained_reads_it(tmp_path, variant):
    model = tiny_model("llama")
    adapter = _adapter(model, variant)
    bridge = lf.as_module(model, adapter)
    bridge.save_pretrained(tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    # peft has LoRA; AntiPaSTO only has lora_func's own format. The last two: Trainer's resume.
    adapter_files = ["adapter_config.json", "adapter_model.safetensors"] if variant == "lora" else ["adapter.safetensors"]
    assert files == sorted([*adapter_files, "bridge_parameters.safetensors", "model.safetensors.index.json"])
    again = lf.AdaptedModule.from_pretrained(tmp_path / "out", model=model)
    for k, v in adapter.params.items():
        torch.testing.assert_close(again.adapter.params[k], v.detach(), rtol=0, atol=0)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state (Trainer creates it too): start and leave clean."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


# --- transformers.Trainer ---------------------------------------------------------------------


class _Batches(torch.utils.data.IterableDataset):
    """The examples of _batch(0), _batch(1), ... in order (an iterable dataset: Trainer does
    not shuffle it), so Trainer sees exactly the reference's batches."""

    def __iter__(self):
        for step in range(STEPS):
            batch = _batch(step)
            for i in range(BATCH):
                yield {k: v[i] for k, v in batch.items()}


def test_trainer_trains_the_adapter_like_lora_func_train_and_saves_only_the_adapter(tmp_path, fresh_accelerate_state):
    model = tiny_model("llama")
    start = _adapter(model)
    bridge = lf.as_module(model, _copy(start))
    args = TrainingArguments(
        str(tmp_path / "run"), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR,
        lr_scheduler_type="constant", max_grad_norm=1.0, save_steps=2, report_to=[], use_cpu=True,
        disable_tqdm=True, logging_strategy="no", seed=0,
    )
    logging.getLogger("transformers").setLevel(logging.ERROR)
    Trainer(model=bridge, args=args, train_dataset=_Batches()).train()
    # 1e-4 of scale after 3 steps of size ~LR: Trainer's default fused AdamW and HF's summed-then-divided
    # loss round differently from lora_func's for-each AdamW and mean loss (seen: 2e-6); a wrong
    # batch, a missed clip or a dropped gradient moves tensors by ~1e-2.
    _assert_same(bridge.adapter, _reference(start), start, rel=1e-4)
    assert all(p.grad is None for p in model.parameters())
    # Checkpoints and save_model hold the adapter in peft's format, never the model's weights.
    trainer = Trainer(model=bridge, args=args)
    trainer.save_model(str(tmp_path / "final"))
    for directory in (tmp_path / "run" / "checkpoint-2", tmp_path / "final"):
        names = {p.name for p in directory.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names, names
    assert json.loads((tmp_path / "final" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    reloaded = lf.AdaptedModule.from_pretrained(tmp_path / "final", model=model)
    for k, v in bridge.adapter.params.items():
        torch.testing.assert_close(reloaded.adapter.params[k], v.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_trainer_with_gradient_checkpointing_matches_lora_func_train(tmp_path, fresh_accelerate_state, reentrant, monkeypatch):
    """TrainingArguments(activation_checkpointing=True): Trainer turns HF checkpointing on through
    the bridge; every layer is recomputed in backward with the adapter (a recompute must happen)
    and the adapter trains exactly as lora_func's own loop without checkpointing."""
    import lora_func._application as application

    recomputed = []
    rebound = application._rebound

    def spy(function, reentrant_, args):
        wrapped = rebound(function, reentrant_, args)
        if wrapped is function:
            return function
        return lambda *a, **k: (recomputed.append(torch._C._current_graph_task_id() != -1), wrapped(*a, **k))[1]

    monkeypatch.setattr(application, "_rebound", spy)
    model = tiny_model("llama")
    start = _adapter(model)
    bridge = lf.as_module(model, _copy(start))
    with pytest.raises(ValueError, match=r"is in eval mode.*model.train\(\)"):
        bridge.activation_checkpointing_enable()  # HF would silently checkpoint nothing
    model.train()  # the base's mode is the user's (no dropout in this model)
    args = TrainingArguments(
        str(tmp_path / "run"), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR,
        lr_scheduler_type="constant", max_grad_norm=1.0, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, logging_strategy="no", seed=0, activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": reentrant},
    )
    logging.getLogger("transformers").setLevel(logging.ERROR)
    Trainer(model=bridge, args=args, train_dataset=_Batches()).train()
    assert any(recomputed), "Trainer's checkpointing did not engage"
    _assert_same(bridge.adapter, _reference(start), start, rel=1e-4)
    assert all(p.grad is None for p in model.parameters())


def test_trainer_resumes_from_a_bridge_checkpoint_exactly(tmp_path, fresh_accelerate_state):
    def run(adapter, resume=None):
        model = tiny_model("llama")
        bridge = lf.as_module(model, _copy(adapter))
        args = TrainingArguments(
            str(tmp_path / "run"), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR,
            lr_scheduler_type="linear", save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True,
            logging_strategy="no", seed=0,
        )
        Trainer(model=bridge, args=args, train_dataset=_Batches()).train(resume_from_checkpoint=resume)
        return bridge.adapter

    logging.getLogger("transformers").setLevel(logging.ERROR)
    start = _adapter(tiny_model("llama"))
    straight = run(start)
    # Another init: the resumed run must take the adapter (and optimiser, schedule) from checkpoint-2.
    other = start.with_params({k: v + 1.0 for k, v in start.params.items()})
    resumed = run(other, resume=str(tmp_path / "run" / "checkpoint-2"))
    _assert_same(resumed, straight, start, rel=0.0)


# --- accelerate -------------------------------------------------------------------------------


def test_accelerate_prepare_autocast_and_clipping_match_lora_func_train(fresh_accelerate_state):
    from accelerate import Accelerator

    model = tiny_model("llama")
    start = _adapter(model)
    bridge = lf.as_module(model, _copy(start))
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    optimizer = torch.optim.AdamW(bridge.parameters(), lr=LR, weight_decay=0.0)
    bridge, optimizer = accelerator.prepare(bridge, optimizer)
    for step in range(STEPS):
        batch = _batch(step)
        optimizer.zero_grad()
        with accelerator.autocast():
            logits = bridge(batch["input_ids"]).logits
        loss = lft.causal_lm_loss(logits, batch["labels"])
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(bridge.parameters(), 1.0)
        optimizer.step()
    trained = accelerator.unwrap_model(bridge).adapter
    _assert_same(trained, _reference(start, autocast_dtype=torch.bfloat16), start)


# --- torch DDP over the bridge (2 gloo processes) --------------------------------------------


def _ddp_worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model("llama")
        ddp = torch.nn.parallel.DistributedDataParallel(lf.as_module(model, _adapter(model)))
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.0)
        for step in range(STEPS):
            half = {k: v.chunk(world)[rank] for k, v in _batch(step).items()}  # equal halves, no padding
            optimizer.zero_grad()
            loss = lft.causal_lm_loss(ddp(half["input_ids"]).logits, half["labels"])
            loss.backward()  # DDP averages the adapter gradients over the ranks here
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
        lf.save(ddp.module.adapter, os.path.join(out, f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def test_ddp_over_the_bridge_on_two_processes_matches_lora_func_train_on_the_full_batch(tmp_path):
    run_ranks(_ddp_worker, 2, (2, str(tmp_path / "rendezvous"), str(tmp_path)), JOIN_TIMEOUT_S, "DDP workers")
    model = tiny_model("llama")
    start = _adapter(model)
    ranks = [lf.load(tmp_path / f"rank{r}.safetensors", model=model) for r in range(2)]
    for k in start.params:
        assert torch.equal(ranks[0].params[k], ranks[1].params[k]), k
    _assert_same(ranks[0], _reference(start), start)



class _PaddedBatches(torch.utils.data.IterableDataset):
    """Rows whose labels end in a different number of ignored (-100) positions: Trainer's
    num_items_in_batch then depends on how it counts (a causal LM's loss shifts the labels), so
    a bridge that hides the base's loss type logs a differently scaled loss."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __iter__(self):
        g = torch.Generator().manual_seed(7)
        for i in range(self.rows):
            ids = torch.randint(3, VOCAB, (LENGTH,), generator=g)
            labels = ids.clone()
            labels[LENGTH - i % 4 :] = -100
            yield {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("accumulation", [1, 4])
def test_trainer_logs_the_same_losses_through_the_bridge_as_on_a_peft_model(tmp_path, fresh_accelerate_state, accumulation):
    """Trainer reads the model's loss type, whether forward takes loss kwargs and its label
    arguments: through the bridge it must log, step by step, the losses it logs for the same
    adapter as a peft model (with gradient accumulation too), and train to the same tensors."""
    from peft import PeftModel

    model = tiny_model("llama")
    start = _adapter(model)
    lf.save_peft(start, tmp_path / "start", model=model)
    with peft_warnings():
        peft_model = PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "start"), is_trainable=True)
    steps, batch = 3, 2

    def run(module: torch.nn.Module, name: str) -> list[float]:
        args = TrainingArguments(
            str(tmp_path / name), max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
            learning_rate=LR, lr_scheduler_type="constant", report_to=[], use_cpu=True, disable_tqdm=True,
            logging_steps=1, save_strategy="no", seed=0,
        )
        trainer = Trainer(model=module, args=args, train_dataset=_PaddedBatches(steps * batch * accumulation))
        with peft_warnings():
            trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    logging.getLogger("transformers").setLevel(logging.ERROR)
    bridge = lf.as_module(model, _copy(start))
    assert bridge.loss_type == "ForCausalLM" and "labels" in type(bridge).__name__ + str(inspect.signature(type(bridge).forward))
    ours, theirs = run(bridge, "bridge"), run(peft_model, "peft")
    assert len(ours) == len(theirs) == steps
    # Logged losses are rounded to 4 significant digits by Trainer; the mis-scaled bridge was off by 1/8.
    assert ours == pytest.approx(theirs, rel=1e-3), (ours, theirs)
    peft_state = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    for key, value in bridge.adapter.params.items():
        module, name = key.rsplit(".", 1)
        theirs_t = peft_state[f"base_model.model.{module}.{name}.default.weight"]
        torch.testing.assert_close(value.detach(), theirs_t, rtol=1e-4, atol=1e-5 * float(theirs_t.abs().max()), msg=key)
