"""lora_func.train's private mode: train_step / fit with privacy=DPSGD(...), micro-batches, and a
checkpoint that resumes the noise where it stopped."""

from __future__ import annotations

import functools

import pytest
import torch

import lora_func as lf
from lora_func.privacy import DPSGD, private_grads
from lora_func.train import TrainState, adapter_loss, fit, load_checkpoint, save_checkpoint, train_step
from tests.models import tiny_model, tokens

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

B, C, SIGMA = 6, 0.05, 0.7


@functools.cache
def _setup():
    model = tiny_model("llama")
    spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(3)
    adapter = adapter.with_params({k: (v + 0.3 * torch.randn(v.shape, generator=g)).detach() for k, v in adapter.params.items()})
    ids = tokens(B, 8, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return model, adapter, {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _state(adapter, lr=0.5):
    live = adapter.detach()
    return TrainState(live, torch.optim.SGD(live.params.values(), lr=lr))


def _dp(seed=4, **kwargs):
    return DPSGD(max_grad_norm=C, noise_multiplier=SIGMA, generator=torch.Generator().manual_seed(seed), **kwargs)


def test_a_private_train_step_over_micro_batches_is_sgd_on_private_grads_of_the_whole_batch():
    model, adapter, batch = _setup()
    want = private_grads(lambda a, b: adapter_loss(model, a, b), adapter, batch, max_grad_norm=C, noise_multiplier=SIGMA,
                         generator=torch.Generator().manual_seed(4))
    for micro_batch_size in (None, 4):  # one forward, or 4 + 2 rows: the same step
        state = _state(adapter)
        stats = train_step(model, state, batch, privacy=_dp(), micro_batch_size=micro_batch_size)
        for k, v in adapter.params.items():
            moved = state.adapter.params[k].detach() - v
            assert float((moved + 0.5 * want[k]).norm() / want[k].norm()) < 1e-5, k
        assert state.step == 1 and stats.step == 0 and not stats.skipped
        norm = float(torch.cat([g.flatten() for g in want.values()]).norm())
        assert abs(stats.grad_norm / norm - 1) < 1e-5  # the noisy gradient's norm (released)
        assert stats.loss == pytest.approx(float(torch.stack([adapter_loss(model, adapter, {k: v[i : i + 1] for k, v in batch.items()})
                                                              for i in range(B)]).mean()), rel=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_bf16_autocast_runs_the_private_step_in_bf16():
    model, adapter, batch = _setup()
    fp32, bf16 = _state(adapter), _state(adapter)
    train_step(model, fp32, batch, privacy=DPSGD(max_grad_norm=C, noise_multiplier=0.0))
    train_step(model, bf16, batch, privacy=DPSGD(max_grad_norm=C, noise_multiplier=0.0), autocast_dtype=torch.bfloat16)
    delta = torch.cat([(bf16.adapter.params[k] - fp32.adapter.params[k]).detach().flatten() for k in adapter.params])
    step = torch.cat([(fp32.adapter.params[k].detach() - v).flatten() for k, v in adapter.params.items()])
    assert 1e-4 < float(delta.norm() / step.norm()) < 5e-2  # bf16 rounding, within bf16 error
    assert all(v.dtype == torch.float32 for v in bf16.adapter.params.values())


def test_a_resumed_private_run_draws_the_noise_an_uninterrupted_one_draws(tmp_path):
    model, adapter, batch = _setup()

    def batch_at(step):
        g = torch.Generator().manual_seed(step)
        rows = torch.randperm(B, generator=g)[:4]
        return {k: v[rows] for k, v in batch.items()}

    def start():
        live = adapter.detach()
        return TrainState(live, lf.train.make_optimizer(live, 1e-2))

    whole = start()
    fit(model, whole, batch_at, 4, privacy=_dp(), micro_batch_size=2, progress=False)

    first, dp = start(), _dp()
    fit(model, first, batch_at, 2, privacy=dp, micro_batch_size=2, progress=False)
    save_checkpoint(tmp_path / "ckpt", first, privacy=dp)
    resumed_dp = _dp(seed=99)  # another seed: the checkpoint's state replaces it
    resumed = load_checkpoint(tmp_path / "ckpt", model, privacy=resumed_dp)
    assert resumed.step == 2
    fit(model, resumed, batch_at, 4, privacy=resumed_dp, micro_batch_size=2, progress=False)
    for k in adapter.params:
        assert torch.equal(resumed.adapter.params[k], whole.adapter.params[k]), k

    # The noise state is what matters: the same resume with a fresh generator ends elsewhere.
    fresh = load_checkpoint(tmp_path / "ckpt", model, privacy=_dp(seed=99))
    fit(model, fresh, batch_at, 4, privacy=_dp(seed=99), micro_batch_size=2, progress=False)
    assert all(not torch.equal(fresh.adapter.params[k], whole.adapter.params[k]) for k in adapter.params)


def test_the_refusals_of_the_private_mode(tmp_path):
    model, adapter, batch = _setup()
    state = _state(adapter)
    with pytest.raises(ValueError, match=r"max_grad_norm=1\.0 cannot go with it"):
        train_step(model, state, batch, privacy=_dp(), max_grad_norm=1.0)
    scaled = TrainState(state.adapter, state.optimizer, torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="a GradScaler"):
        train_step(model, scaled, batch, privacy=_dp())
    with pytest.raises(ValueError, match="pass privacy="):
        train_step(model, state, batch, micro_batch_size=2)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        train_step(model, state, batch, privacy=_dp(), micro_batch_size=0)
    with pytest.raises(TypeError, match="DPSGD"):
        train_step(model, state, batch, privacy={"max_grad_norm": 1.0})
    assert state.step == 0 and all(torch.equal(state.adapter.params[k], v) for k, v in adapter.params.items())

    save_checkpoint(tmp_path / "private", state, privacy=_dp())
    save_checkpoint(tmp_path / "plain", state)
    with pytest.raises(ValueError, match="saved by a private run"):
        load_checkpoint(tmp_path / "private", model)
    with pytest.raises(ValueError, match="saved by a non-private run"):
        load_checkpoint(tmp_path / "plain", model, privacy=_dp())
    untouched = _dp(seed=7)
    with pytest.raises(ValueError, match="resume with the saved mechanism"):
        load_checkpoint(tmp_path / "private", model, privacy=DPSGD(max_grad_norm=2 * C, noise_multiplier=SIGMA, generator=untouched.generator))
    assert torch.equal(untouched.generator.get_state(), torch.Generator().manual_seed(7).get_state())  # refused: not set
    with pytest.raises(ValueError, match="generator"):
        save_checkpoint(tmp_path / "global", state, privacy=DPSGD(max_grad_norm=C, noise_multiplier=SIGMA))


def test_a_damaged_privacy_entry_is_named_on_load(tmp_path):
    import json

    from tests.test_error_catalogue import _reseal_checkpoint

    model, adapter, _ = _setup()
    directory = save_checkpoint(tmp_path / "ckpt", _state(adapter), privacy=_dp())
    meta = json.loads((directory / "trainer_state.json").read_text())
    meta["privacy"]["generator_state"], meta["privacy"]["noise_multiplier"] = "not base64!", -1.0
    _reseal_checkpoint(directory, state_text=json.dumps(meta))  # a hostile edit passes the checksums
    with pytest.raises(ValueError, match=r"privacy.noise_multiplier=-1.0 .*privacy.generator_state is not base64"):
        load_checkpoint(directory, model, privacy=_dp())
