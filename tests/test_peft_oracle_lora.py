"""HF peft as the oracle for lora and rslora: same base weights, peft's tensors perturbed at
random (so identity at init cannot hide anything) and copied into a lora_func adapter; the
logits (lazy and merged overlays) and every adapter tensor's gradient must equal peft's.

The helpers here are shared with the pissa and dora peft tests. The peft key mapping lives
in this file on purpose (lora_func.io's peft module is separate work).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.func import grad

import lora_func as lf
from tests.contract_helpers import loss_fn
from tests.models import tiny_model, tokens
from tests import peft_helpers
from tests.peft_helpers import ce_loss

KINDS = ("llama", "qwen2", "gpt2")
# Layers with d_in != d_out on every model (v_proj 32->16, down_proj 48->32, c_attn 32->96,
# c_fc 32->128), so a transposed factor cannot go unnoticed. GPT-2's are Conv1D (fan_in_fan_out).
PEFT_TARGETS = {
    "llama": ["q_proj", "v_proj", "down_proj"],
    "qwen2": ["q_proj", "v_proj", "down_proj"],
    "gpt2": ["c_attn", "c_fc"],
}
R, ALPHA = 4, 6.0  # s = 1.5 (alpha/r) or 3.0 (alpha/sqrt(r)): a wrong scale is visible
ATOL = 1e-5



def peft_key_to_lf(name: str) -> str:
    return peft_helpers.peft_key_to_lf(name, ('lora_A', 'lora_B', 'lora_magnitude_vector'))


def make_peft(kind: str, seed: int = 0, **config):
    """A peft model on ``tiny_model(kind, seed)`` and an untouched twin for lora_func.

    GPT-2 targets are Conv1D: ``fan_in_fan_out=True`` is set explicitly (peft otherwise
    sets it itself with a UserWarning, which this suite would turn into an error).
    """
    lf_model = tiny_model(kind, seed=seed)
    peft_base = tiny_model(kind, seed=seed)
    cfg = LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=PEFT_TARGETS[kind], lora_dropout=0.0, fan_in_fan_out=kind == "gpt2", **config
    )
    # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing`: that exact
    # FutureWarning is expected; pytest.warns re-raises any other warning.
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        peft_model = get_peft_model(peft_base, cfg)
    peft_model.eval()
    return peft_model, lf_model


def perturb_peft(peft_model, scale: float = 0.1, seed: int = 5) -> None:
    """Add independent Gaussian noise to every trainable peft tensor, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(peft_model.named_parameters()):
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def peft_params_as_lf(peft_model) -> dict[str, torch.Tensor]:
    return {
        peft_key_to_lf(name): p.detach().clone().requires_grad_(True)
        for name, p in peft_model.named_parameters()
        if p.requires_grad
    }



def assert_matches_peft(peft_model, lf_model, adapter: lf.Adapter, *, atol: float = ATOL) -> None:
    """Copy peft's (perturbed) trainable tensors into ``adapter`` and compare logits (lazy and
    merged) and the gradient of every trainable tensor, per tensor."""
    params = peft_params_as_lf(peft_model)
    assert sorted(params) == sorted(adapter.params), "peft and lora_func adapt different tensors"
    for key, value in params.items():
        assert value.shape == adapter.params[key].shape, key
    adapter = adapter.with_params(params)
    ids = tokens(batch=2, length=10, seed=4)

    peft_model.zero_grad()
    peft_out = peft_model(input_ids=ids).logits
    ce_loss(peft_out, ids).backward()
    peft_grads = {peft_key_to_lf(n): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}

    base = lf.base_params(lf_model)
    assert (peft_out - lf_model(ids).logits).abs().max() > 1e-3, "the perturbed adapter should change the output"
    for merged in (False, True):
        out = lf.adapted_call(lf_model, adapter, ids, merged=merged).logits
        torch.testing.assert_close(out, peft_out.detach(), atol=atol, rtol=0, msg=f"logits merged={merged}")
        grads = grad(loss_fn(lf_model, base, adapter, ids, merged=merged))(adapter.params)
        for key, g in grads.items():
            assert peft_grads[key].abs().max() > 0, f"peft gives {key} no gradient: the comparison would be vacuous"
            torch.testing.assert_close(g, peft_grads[key], atol=atol, rtol=0, msg=f"grad {key} merged={merged}")


@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
@pytest.mark.parametrize("kind", KINDS)
def test_lora_matches_peft_after_perturbation(kind, use_rslora):
    peft_model, lf_model = make_peft(kind, use_rslora=use_rslora)
    perturb_peft(peft_model)
    spec = lf.AdapterSpec("lora", targets=PEFT_TARGETS[kind], r=R, alpha=ALPHA, use_rslora=use_rslora)
    adapter = lf.init_adapter(lf_model, spec, generator=torch.Generator().manual_seed(0))
    assert_matches_peft(peft_model, lf_model, adapter)
