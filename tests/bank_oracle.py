"""The float64 peft oracle of the shared-basis variants (VeRA, VB-LoRA, RandLoRA, ...): a peft
model with perturbed trainables is saved, loaded with ``load_peft``, and its logits and every
trainable tensor's gradient compared with peft's, merged and lazy (relative 1e-9)."""

from __future__ import annotations

import copy
import types
import warnings
from pathlib import Path

import peft
import torch

import lora_func as lf
from lora_func.adapter import SHARED
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

RTOL = 1e-9


def rmsnorm_in_input_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' Llama RMSNorm computes in fp32; in float64 oracle tests it must compute in
    the input dtype on both sides."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.forward = types.MethodType(forward, m)
    return model


def model64(kind: str = "llama") -> torch.nn.Module:
    return rmsnorm_in_input_dtype(tiny_model(kind, dtype=torch.float64))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs().max() / want.abs().max()).detach())


def lf_key(peft_name: str, shared: tuple[str, ...] = ()) -> str:
    """peft's parameter name -> the adapter's key: ``base_model.model.<module>.<t>.default`` ->
    ``<module>.<t>``, ``base_model.<t>.default`` or a ``shared`` tensor (which peft's
    ``named_parameters`` lists under the first layer that holds it) -> ``<shared>.<t>``."""
    name = peft_name.removesuffix(".default").removesuffix(".weight").removesuffix(".default")
    if name.rsplit(".", 1)[-1] in shared:
        return f"{SHARED}.{name.rsplit('.', 1)[-1]}"
    if name.startswith("base_model.model."):
        return name.removeprefix("base_model.model.")
    return f"{SHARED}.{name.removeprefix('base_model.')}"


def peft_model(model: torch.nn.Module, config, *, seed: int = 1, scale: float = 0.5):
    """``get_peft_model`` on a copy of ``model``, every trainable tensor perturbed (random, non-symmetric)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model), config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return pm


def check_against_peft(model: torch.nn.Module, pm, directory: Path, *, ids: torch.Tensor | None = None) -> tuple[lf.Adapter, dict[str, float]]:
    """Save ``pm``, load it with ``load_peft`` on ``model``; assert logits and every trainable
    tensor's gradient (merged and lazy) equal peft's to :data:`RTOL`. Returns the adapter and the
    worst relative errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(directory)
        adapter = lf.load_peft(directory, model)
    ids = tokens(2, 9, seed=3) if ids is None else ids
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    shared = tuple(n for n, _ in adapter.shared.param_shapes) if adapter.shared is not None else ()
    peft_grads = {lf_key(n, shared): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    assert sorted(peft_grads) == sorted(adapter.params), "peft and lora_func train different tensors"
    assert (want - model(ids).logits).abs().max() > 1e-2, "the perturbed adapter should change the output"
    worst = {"logits": 0.0, "grads": 0.0}
    for merged in (False, True):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        got = lf.adapted_call(model, adapter.with_params(params), ids, merged=merged).logits
        worst["logits"] = max(worst["logits"], rel(got, want))
        grads = torch.autograd.grad(ce_loss(got, ids), list(params.values()))
        for key, grad in zip(params, grads, strict=True):
            assert peft_grads[key].abs().max() > 0, key
            worst["grads"] = max(worst["grads"], rel(grad, peft_grads[key]))
    assert worst["logits"] < RTOL and worst["grads"] < RTOL, worst
    return adapter, worst


def peft_reload_logits(model: torch.nn.Module, directory: Path, ids: torch.Tensor) -> torch.Tensor:
    """peft's logits of the checkpoint at ``directory`` on a copy of ``model``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(model), directory).eval()
    with torch.no_grad():
        return loaded(input_ids=ids).logits


def storage_bytes(adapter: lf.Adapter) -> int:
    """Bytes of the distinct storages the adapter's tensors live in (a stack's shared tensors,
    held once by ``expand``, count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*adapter.params.values(), *adapter.buffers.values()]}
    return sum(storages.values())


def adam_losses(model: torch.nn.Module, adapter, lr: float, steps: int = 15) -> list[float]:
    """The next-token loss of ``adapter`` on ``model`` over ``steps`` Adam steps on one batch
    (``tokens(4, 12, seed=5)``): each variant's "init_adapter trains" check."""
    from tests.models import tokens
    from tests.peft_helpers import ce_loss

    ids = tokens(4, 12, seed=5)
    params = dict(adapter.params)
    opt = torch.optim.Adam(params.values(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = ce_loss(lf.adapted_call(model, adapter.with_params(params), ids).logits, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def dropout_step_against_peft(model: torch.nn.Module, pm, adapter: lf.Adapter, ids: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor]:
    """One training step with the adapter's dropout under one global seed (peft's ``pm`` and the
    adapter loaded from its checkpoint): peft's logits and every trainable tensor's gradient
    (relative ``RTOL``, the same keys both sides). Returns the copy of ``model`` in train mode and
    lora_func's logits, for the caller's checks of the draws."""
    pm.train()
    torch.manual_seed(0)
    want = pm(input_ids=ids).logits
    ce_loss(want, ids).backward()
    train_model = copy.deepcopy(model).train()
    torch.manual_seed(0)
    got = lf.adapted_call(train_model, adapter, ids).logits
    grads = dict(zip(adapter.params, torch.autograd.grad(ce_loss(got, ids), list(adapter.params.values())), strict=True))
    assert rel(got, want) < RTOL
    peft_grads = {lf_key(name): p.grad for name, p in pm.named_parameters() if p.requires_grad}
    assert sorted(peft_grads) == sorted(grads)
    for key, grad in peft_grads.items():
        assert rel(grads[key], grad) < RTOL, key
    return train_model, got.detach()
