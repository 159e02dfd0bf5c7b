"""The float64 peft oracle of LoRA's own variants (lora_bias, BD-LoRA, QALoRA, VeLoRA, MonteCLoRA,
aLoRA) and trainable tokens: a peft model with every trainable tensor perturbed is saved, read
with ``load_peft`` onto the untouched base, and its logits and every trainable tensor's gradient
compared with peft's (relative 1e-9), on a float64 tiny Llama whose RMSNorm computes in the input
dtype on both sides."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from pathlib import Path

import peft
import torch

import lora_func as lf
from tests.bank_oracle import model64, rel
from tests.models import tokens
from tests.peft_helpers import ce_loss

RTOL = 1e-9
R, ALPHA = 4, 6.0
# q_proj 32 -> 32 and v_proj 32 -> 16 carry a bias on the tiny Llama; down_proj 48 -> 32 has none.
TARGETS = ["q_proj", "v_proj"]
# peft's parameter name suffixes (adapter name "default") -> lora_func's short names.
PEFT_NAMES = {
    "lora_A.default.weight": "lora_A",
    "lora_B.default.weight": "lora_B",
    "lora_B.default.bias": "lora_bias",
    "lora_monteclora_sampler.default.std_prior": "monteclora_std_prior",
    "lora_monteclora_sampler.default.expert_weights_prior": "monteclora_expert_weights_prior",
    "trainable_tokens_delta.default": "trainable_tokens_delta",
}

__all__ = ["ALPHA", "R", "RTOL", "TARGETS", "compare", "lf_name", "model64", "peft_lora", "perturb", "rel", "saved"]


def lf_name(name: str) -> str:
    """peft's ``base_model.model.<module>.<suffix>`` -> ``<module>.<short name>``."""
    module = name.removeprefix("base_model.model.")
    for suffix, short in PEFT_NAMES.items():
        if module.endswith("." + suffix):
            return f"{module[: -len(suffix) - 1]}.{short}"
    raise AssertionError(f"unexpected peft tensor {name}")


def perturb(pm: torch.nn.Module, *, seed: int = 1, scale: float = 0.3) -> torch.nn.Module:
    """Every trainable tensor of ``pm`` plus independent Gaussian noise, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return pm


def peft_lora(model: torch.nn.Module, *, targets: Iterable[str] = TARGETS, perturbed: bool = True, **config) -> torch.nn.Module:
    """``get_peft_model`` with a ``LoraConfig(r=4, lora_alpha=6, **config)`` on a copy of ``model``
    (eval mode), its trainables perturbed."""
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(targets), **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model), cfg).eval()
    return perturb(pm) if perturbed else pm


def saved(pm: torch.nn.Module, directory: Path, model: torch.nn.Module) -> lf.AdapterLike:
    """``pm.save_pretrained(directory)`` read back with ``load_peft`` onto ``model``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(directory)
    return lf.load_peft(directory, model)


def peft_grads(pm: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {lf_name(n): p.grad for n, p in pm.named_parameters() if p.requires_grad}


def compare(
    model: torch.nn.Module, pm: torch.nn.Module, adapter: lf.Adapter, *, ids: torch.Tensor | None = None, merged: tuple[bool, ...] = (False, True), **call
) -> dict[str, float]:
    """peft's logits and per-tensor gradients (a next-token loss) against ``adapter`` on ``model``
    through ``adapted_call`` (each of ``merged``, ``call`` passed on): every trainable tensor of
    both, each with a non-zero peft gradient, to :data:`RTOL`. Returns the worst relative errors."""
    ids = tokens(2, 9, seed=3) if ids is None else ids
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    expected = peft_grads(pm)
    assert sorted(expected) == sorted(adapter.params), "peft and lora_func train different tensors"
    assert (want - model(ids).logits).abs().max() > 1e-2, "the perturbed adapter should change the output"
    worst = {"logits": 0.0, "grads": 0.0}
    for each in merged:
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        got = lf.adapted_call(model, adapter.with_params(params), ids, merged=each, **call).logits
        worst["logits"] = max(worst["logits"], rel(got, want))
        grads = torch.autograd.grad(ce_loss(got, ids), list(params.values()))
        for key, grad in zip(params, grads, strict=True):
            assert expected[key].abs().max() > 0, key
            worst["grads"] = max(worst["grads"], rel(grad, expected[key]))
    assert worst["logits"] < RTOL and worst["grads"] < RTOL, worst
    return worst


def reloaded_in_peft(model: torch.nn.Module, directory: Path) -> torch.nn.Module:
    """peft's model of the checkpoint at ``directory`` on a copy of ``model`` (eval mode)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(copy.deepcopy(model), directory).eval()


__all__ += ["peft_grads", "reloaded_in_peft"]
