"""AdaLoRA checkpoints as peft 0.21 saves them with its defaults: ``r`` (8) differs from ``init_r``
(12), and, once its schedule has masked, a ``rank_pattern`` (booleans per triplet) with each
layer's tensors cut to its kept triplets. load_peft reads both (the cut layers padded back to
init_r with zero triplets) with peft's logits, loss with the orthogonality term and per-tensor
gradients (float64, relative 1e-9); save_peft output loads in peft with the same logits."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import AdaLoraConfig, PeftModel, get_peft_model
from peft.utils.warning import PeftWarning

import lora_func as lf
from lora_func import rank_budget as rb
from tests import peft_helpers
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss
from tests.bank_oracle import rmsnorm_in_input_dtype

F64 = torch.float64
TARGETS = ["q_proj", "v_proj", "down_proj"]
NAMES = ("lora_A", "lora_E", "lora_B")
# peft's defaults r=8, init_r=12; the final mask at step total_step - tfinal = 7.
CONFIG = {"init_r": 12, "target_r": 5, "tinit": 1, "tfinal": 3, "deltaT": 1, "total_step": 10, "lora_alpha": 6.0, "orth_reg_weight": 0.3}




@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", dtype=F64)
    rmsnorm_in_input_dtype(m)
    return m


def _quiet(build):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        # peft checks AdaLoRA's rank_pattern keys (``<module>.lora_E``) as LoRA's module patterns, and warns
        warnings.filterwarnings("ignore", "The following rank_pattern keys did not match", RuntimeWarning)
        return build()


def _peft_loss(pm, ids):
    """peft's AdaLoraModel.forward (the model's loss plus its orthogonality term) over a float64 cross-entropy."""
    inner = pm.base_model.model.forward

    def forward(*args, labels=None, **kwargs):
        out = inner(*args, **kwargs)
        out.loss = ce_loss(out.logits, labels)
        return out

    pm.base_model.model.forward = forward
    try:
        return pm.base_model(input_ids=ids, labels=ids)
    finally:
        del pm.base_model.model.forward


@pytest.fixture(scope="module")
def checkpoints(model, tmp_path_factory):
    """``{"unmasked": dir, "masked": dir}``: peft's defaults before any masking, and after the final mask."""
    pm = _quiet(lambda: get_peft_model(copy.deepcopy(model), AdaLoraConfig(target_modules=TARGETS, **CONFIG)))
    assert pm.peft_config["default"].r == 8
    g = torch.Generator().manual_seed(3)
    params = {n: p for n, p in pm.named_parameters() if any(f".{t}." in n for t in NAMES)}
    with torch.no_grad():
        for n in sorted(params):
            params[n].add_(0.3 * torch.randn(params[n].shape, generator=g, dtype=F64))
    out = {"unmasked": tmp_path_factory.mktemp("unmasked")}
    pm.save_pretrained(out["unmasked"])
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    for step in range(1, 9):
        optimizer.zero_grad()
        _peft_loss(pm, tokens(2, 8, seed=50 + step)).loss.backward()
        optimizer.step()
        pm.base_model.update_and_allocate(step)
    out["masked"] = tmp_path_factory.mktemp("masked")
    with warnings.catch_warnings():  # a layer cut to rank 0: peft takes its (0, d) tensors for unsharded ZeRO-3 ones
        warnings.filterwarnings("ignore", ".*LoRA tensor.s. have invalid shape", PeftWarning)
        pm.save_pretrained(out["masked"])
    return out


@pytest.mark.parametrize("which", ["unmasked", "masked"])
def test_peft_default_checkpoints_load_with_peft_logits_loss_and_gradients(model, checkpoints, which):
    directory = checkpoints[which]
    pm = _quiet(lambda: PeftModel.from_pretrained(copy.deepcopy(model), directory, is_trainable=True))
    config = pm.peft_config["default"]
    kept = {k.removesuffix(".lora_E"): sum(v) for k, v in (config.rank_pattern or {}).items()}
    if which == "masked":  # peft cut the tensors: some layers below init_r, not all alike
        assert len(kept) == 6 and max(kept.values()) < 12 and min(kept.values()) == 0  # a layer cut to nothing too
    adapter = lf.load_peft(directory, model)
    assert adapter.spec.r == 12 and dict(adapter.spec.options)["init_r"] == 12
    peft_params = {peft_helpers.peft_key_to_lf(n, NAMES): p for n, p in pm.named_parameters() if any(f".{t}." in n for t in NAMES)}
    ids = tokens(2, 8, seed=4)
    out = _peft_loss(pm, ids)
    out.loss.backward()
    base = lf.base_params(model)
    for merged in (False, True):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        current = adapter.with_params(params)
        logits = lf.adapted_call(model, current, ids, base=base, merged=merged).logits
        assert (logits - out.logits).abs().max() <= 1e-9 * out.logits.abs().max()
        loss = ce_loss(logits, ids) + rb.orth_penalty(current)
        assert abs(loss.item() - out.loss.item()) <= 1e-12 * out.loss.item()
        loss.backward()
        for key, p in peft_params.items():
            axis = 1 if key.endswith("lora_B") else 0
            k = p.shape[axis]
            assert k == kept.get(key.rsplit(".", 1)[0], 12), key
            mine = params[key].grad.narrow(axis, 0, k)
            assert torch.equal(params[key].detach().narrow(axis, 0, k), p.detach()), key
            if k:
                assert p.grad.abs().max() > 1e-8 and (mine - p.grad).abs().max() <= 1e-9 * p.grad.abs().max(), key
            assert not params[key].grad.narrow(axis, k, 12 - k).any(), key  # the padded triplets: exactly zero


def test_save_peft_of_a_padded_adapter_loads_in_peft(model, checkpoints, tmp_path):
    adapter = lf.load_peft(checkpoints["masked"], model)
    lf.save_peft(adapter, tmp_path, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft warns when r is set for AdaLoRA: it is not written
        again = _quiet(lambda: PeftModel.from_pretrained(copy.deepcopy(model), tmp_path)).eval()
    config = again.peft_config["default"]
    assert (config.init_r, config.r, config.rank_pattern, config.total_step) == (12, 8, None, 10)
    ids = tokens(2, 8, seed=5)
    want = lf.adapted_call(model, adapter, ids).logits
    torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-12 * want.abs().max().item())
