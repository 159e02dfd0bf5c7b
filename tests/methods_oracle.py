"""The float64 peft oracle of BEFT, GLoRA, OSF and PSOFT (issue 43): a peft model with perturbed
trainables is saved, loaded with ``load_peft``, and its logits and every trainable tensor's
gradient compared with peft's, merged and lazy (relative 1e-9). As ``bank_oracle.check_against_peft``,
with peft's parameter names mapped by a pattern: these methods nest their tensors in modules
(``glora_A.default.Xd``, ``osf_svd_params.default.U_low``, ``psoft_R.default.vector_a``)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import lora_func as lf
from tests.bank_oracle import RTOL, rel
from tests.models import tokens
from tests.peft_helpers import ce_loss


def nested_key(pattern: str, to: str | Callable[[re.Match], str]) -> Callable[[str], str]:
    """peft's ``base_model.model.<module>.<nested name>`` -> ``<module>.<name>``, the nested name
    rewritten by ``re.sub(pattern, to)`` (e.g. ``r"glora_([A-E])\\.default\\.(\\w+)$"`` -> ``r"glora_\\1_\\2"``)."""

    def key(name: str) -> str:
        module, nested = re.match(rf"^base_model\.model\.(.+?)\.({pattern})", name).groups()[:2]  # type: ignore[union-attr]
        return f"{module}.{re.sub(pattern, to, nested)}"

    return key


def peft_params(pm, key: Callable[[str], str]) -> dict[str, torch.Tensor]:
    return {key(n): p for n, p in pm.named_parameters() if p.requires_grad}


def check_against_peft(
    model: torch.nn.Module, pm, directory: Path, key: Callable[[str], str], *, merged: tuple[bool, ...] = (False, True), ids: torch.Tensor | None = None
) -> tuple[lf.Adapter, dict[str, float]]:
    """Save ``pm``, load it with ``load_peft`` on ``model``; assert logits and every trainable
    tensor's gradient (on each of the ``merged`` paths) equal peft's to :data:`RTOL`. Returns the
    adapter and the worst relative errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(directory)
        adapter = lf.load_peft(directory, model)
    ids = tokens(2, 9, seed=3) if ids is None else ids
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    peft_grads = {k: p.grad for k, p in peft_params(pm, key).items()}
    assert sorted(peft_grads) == sorted(adapter.params), "peft and lora_func train different tensors"
    assert (want - model(ids).logits).abs().max() > 1e-2, "the perturbed adapter should change the output"
    worst = {"logits": 0.0, "grads": 0.0}
    for path in merged:
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        got = lf.adapted_call(model, adapter.with_params(params), ids, merged=path).logits
        worst["logits"] = max(worst["logits"], rel(got, want))
        grads = torch.autograd.grad(ce_loss(got, ids), list(params.values()))
        for name, grad in zip(params, grads, strict=True):
            assert peft_grads[name].abs().max() > 0, name
            worst["grads"] = max(worst["grads"], rel(grad, peft_grads[name]))
    assert worst["logits"] < RTOL and worst["grads"] < RTOL, worst
    return adapter, worst
