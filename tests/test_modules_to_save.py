"""peft's ``modules_to_save`` (a trained full copy of a module beside the adapter: the ``score``
head of every ``SEQ_CLS`` fine-tune) against HF peft 0.21.

In lora_func a trained copy of a layer is an ``ln_tuning`` adapter on it (``W_eff`` = the copy's
weight, ``b_eff`` = its bias), composed with the method's adapter: pure (the copy is overlaid for
the call, never assigned), stackable, and saved by ``save_peft`` under peft's keys
(``base_model.model.<module>.weight``, the config's ``modules_to_save``). Each case in float64,
relative 1e-9: ``load_peft`` of peft's perturbed SEQ_CLS checkpoint gives peft's logits and every
tensor's gradient; ``save_peft`` of lora_func's adapter loads in peft with lora_func's logits; K
copies of the head stacked under ``vmap`` equal a loop; per-example gradients equal a loop.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import nn
from torch.func import grad, vmap
from transformers import LlamaConfig, LlamaForSequenceClassification

import lora_func as lf
from tests.models import tokens

LABELS = torch.tensor([2, 0])


def _rmsnorm_in_input_dtype(model: nn.Module) -> None:
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(forward, m)


def _classifier(seed: int = 0) -> nn.Module:
    """A 2-layer Llama with a 3-label ``score`` head (no bias), float64."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_labels=3, pad_token_id=0, initializer_range=0.2,
    )
    model = LlamaForSequenceClassification(config).to(torch.float64).eval()
    model.config._attn_implementation = "eager"
    _rmsnorm_in_input_dtype(model)
    return model


def _loss(out, labels=LABELS):
    return F.cross_entropy(out.logits, labels)


def _perturb(model: nn.Module, seed: int = 5) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # peft's SEQ_CLS default: modules_to_save = ["classifier", "score"]; the final norm too
        config = LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"], modules_to_save=["norm"])
        peft_model = get_peft_model(_classifier(), config).eval()
    _perturb(peft_model)
    path = tmp_path_factory.mktemp("seq_cls")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(path)
    model = _classifier()
    adapter = lf.load_peft(path, model)
    return types.SimpleNamespace(peft=peft_model, model=model, adapter=adapter, path=path, x=tokens(2, 8))


def _close(got, want, what, rtol=1e-9):
    got, want = got.detach(), want.detach()
    scale = want.abs().max().clamp_min(1e-30)
    assert (got - want).abs().max() <= rtol * scale, f"{what}: off by {float((got - want).abs().max() / scale):.2e} relative"


def test_a_seq_cls_checkpoint_loads_with_its_head_and_norm_as_trained_copies(case):
    copies = [leaf for leaf in lf.adapter.leaf_adapters(case.adapter) if leaf.spec.variant == "ln_tuning"]
    # peft's matching (a plain endswith: "norm" copies every norm) is the oracle
    wrapped = sorted(n.removeprefix("base_model.model.") for n, m in case.peft.named_modules() if type(m).__name__ == "ModulesToSaveWrapper")
    assert "score" in wrapped and "model.norm" in wrapped and len(wrapped) == 6
    assert sorted(layer.target.module for leaf in copies for layer in leaf.layers) == wrapped
    want = case.peft(case.x).logits
    base = case.model(case.x).logits
    assert (want - base).abs().max() > 1e-2 * base.abs().max()
    for route in ("overlay", "module"):
        for merged in (False, True):
            _close(lf.adapted_call(case.model, case.adapter, case.x, route=route, merged=merged).logits, want, f"{route} merged={merged}")
    # the head's copy matters on its own: without it the logits are another
    lora_only = next(leaf for leaf in lf.adapter.leaf_adapters(case.adapter) if leaf.spec.variant == "lora")
    assert (lf.adapted_call(case.model, lora_only, case.x).logits - want).abs().max() > 1e-2 * want.abs().max()
    assert torch.equal(case.model.score.weight, _classifier().score.weight)


def test_gradients_per_tensor_are_peft_s(case, tmp_path):
    case.peft.zero_grad()
    _loss(case.peft(case.x)).backward()
    want = {
        n.replace(".modules_to_save.default", "").replace(".default", ""): p.grad.detach().clone()
        for n, p in case.peft.named_parameters() if p.requires_grad
    }

    def loss(params):
        return _loss(lf.adapted_call(case.model, case.adapter.with_params(params), case.x))

    got = grad(loss)(dict(case.adapter.params))
    lf.save_peft(case.adapter.with_params({k: v.detach() for k, v in got.items()}), tmp_path)
    as_peft = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(as_peft) == sorted(want)
    assert "base_model.model.score.weight" in want and "base_model.model.model.norm.weight" in want
    for key, g in want.items():
        assert g.abs().max() > 0, key
        _close(as_peft[key], g, key)


def test_save_peft_writes_modules_to_save_that_peft_loads(case, tmp_path):
    g = torch.Generator().manual_seed(9)
    adapter = case.adapter.with_params(
        {k: v.detach() + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in case.adapter.params.items()}
    )
    lf.save_peft(adapter, tmp_path, model=case.model, task_type="SEQ_CLS")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(_classifier(), tmp_path).eval()
    _close(loaded(case.x).logits, lf.adapted_call(case.model, adapter, case.x).logits, "peft on save_peft")
    again = lf.load_peft(tmp_path, _classifier())
    assert sorted(again.params) == sorted(adapter.params)
    for key, tensor in adapter.params.items():
        assert torch.equal(again.params[key], tensor), key


def test_a_head_copy_from_init_adapter_composes_stacks_and_gives_per_example_gradients(case):
    """``modules_to_save`` built in lora_func: LoRA composed with an ``ln_tuning`` copy of the head
    (it starts as the base's head); K adapters with K different heads stacked under vmap equal a
    loop, and per-example gradients (vmap of grad) equal one grad per example."""
    model = case.model
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2), generator=torch.Generator().manual_seed(0))
    head = lf.init_adapter(model, lf.AdapterSpec("ln_tuning", targets=["score"]))
    assert torch.equal(head.params["score.ln_weight"], model.score.weight) and head.params["score.ln_weight"].data_ptr() != model.score.weight.data_ptr()
    adapter = lf.compose(lora, head)
    g = torch.Generator().manual_seed(3)
    members = [adapter.with_params({k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()}) for _ in range(3)]
    stacked = lf.stack(members)
    got = vmap(lambda a: lf.adapted_call(model, a, case.x).logits)(stacked)
    for k, member in enumerate(members):
        _close(got[k], lf.adapted_call(model, member, case.x).logits, f"member {k}")
    assert (got[0] - got[1]).abs().max() > 1e-3

    one = members[0]

    def example_loss(params, x, label):
        return _loss(lf.adapted_call(model, one.with_params(params), x[None]), label[None])

    per_example = vmap(grad(example_loss), in_dims=(None, 0, 0))(dict(one.params), case.x, LABELS)
    for i in range(2):
        single = grad(example_loss)(dict(one.params), case.x[i], LABELS[i])
        for key, tensor in single.items():
            _close(per_example[key][i], tensor, f"example {i} {key}")
    head_key = next(k for k in per_example if k.endswith("score.ln_weight"))
    assert per_example[head_key][0].abs().max() > 0 and (per_example[head_key][0] - per_example[head_key][1]).abs().max() > 0


def test_a_copy_lora_func_cannot_hold_is_refused_naming_it(case, tmp_path):
    """A copy of a module that is no single layer (a whole MLP block): refused naming the module
    and the option, before anything is built."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["q_proj"], modules_to_save=["layers.1.mlp"])
        peft_model = get_peft_model(_classifier(), config)
        peft_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"modules_to_save holds a trained copy of model\.layers\.1\.mlp \(LlamaMLP, tensors \['down_proj\.weight'"):
        lf.load_peft(tmp_path, _classifier())


def _llama64():
    from tests.models import tiny_model

    model = tiny_model("llama", dtype=torch.float64)
    _rmsnorm_in_input_dtype(model)
    return model


def _convlm64():
    from tests.models import tiny_model

    return tiny_model("convlm", dtype=torch.float64)


# model, LoRA targets, modules_to_save, the copies peft makes
COPIES = {
    # peft's advice when tokens are added: the embedding's (V, d) table and the head
    "embedding-and-lm-head": (_llama64, ["q_proj"], ["embed_tokens", "lm_head"], ["lm_head", "model.embed_tokens"]),
    # a Conv1d with a bias and a Conv2d without, their kernels
    "convs": (_convlm64, ["head"], ["seq", "grid"], ["grid", "seq"]),
}


@pytest.mark.parametrize("case_name", sorted(COPIES))
def test_copies_of_other_kinds_load_as_peft_s(case_name, tmp_path):
    """Copies of an embedding, a head, convs beside LoRA: logits and per-tensor gradients equal
    peft's in float64, and save_peft loads back in peft with the same logits."""
    from tests.peft_helpers import ce_loss

    build, targets, saved, copied = COPIES[case_name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(build(), LoraConfig(r=2, lora_alpha=6, target_modules=targets, modules_to_save=saved)).eval()
        _perturb(peft_model)
        peft_model.save_pretrained(tmp_path / "peft")
    model, ids = build(), tokens(2, 8)
    adapter = lf.load_peft(tmp_path / "peft", model)
    copies = [leaf for leaf in lf.adapter.leaf_adapters(adapter) if leaf.spec.variant == "ln_tuning"]
    assert sorted(layer.target.module for leaf in copies for layer in leaf.layers) == copied
    _close(lf.adapted_call(model, adapter, ids).logits, peft_model(ids).logits, "logits")
    peft_model.zero_grad()
    ce_loss(peft_model(ids).logits, ids).backward()
    want = {n.replace(".modules_to_save.default", "").replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    got = grad(lambda params: ce_loss(lf.adapted_call(model, adapter.with_params(params), ids).logits, ids))(dict(adapter.params))
    lf.save_peft(adapter.with_params(got), tmp_path / "grads")
    as_peft = load_file(str(tmp_path / "grads" / "adapter_model.safetensors"))
    assert sorted(as_peft) == sorted(want) and all(f"base_model.model.{m}.weight" in want for m in copied)
    for key, g in want.items():
        assert g.abs().max() > 0, key
        _close(as_peft[key], g, key)
    lf.save_peft(adapter, tmp_path / "ours", model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = PeftModel.from_pretrained(build(), tmp_path / "ours").eval()
    _close(again(ids).logits, peft_model(ids).logits, "peft on save_peft")


@pytest.mark.parametrize(("kind", "targets"), [("convlm", ["seq", "grid", "embed"]), ("gconvlm", ["seq"]), ("llama", ["embed_tokens"])])
def test_ln_tuning_on_the_copy_kinds_saves_as_peft_s_ln_tuning(kind, targets, tmp_path):
    """Alone, the trained copies of embeddings and convs (grouped too) are peft's LN tuning
    (which copies any layer): save_peft loads in peft with lora_func's logits, and back exactly."""
    from tests.models import tiny_model

    model, ids = tiny_model(kind, dtype=torch.float64), tokens()
    adapter = lf.init_adapter(model, lf.AdapterSpec("ln_tuning", targets=targets))
    g = torch.Generator().manual_seed(0)
    adapter = adapter.with_params({k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    want = lf.adapted_call(model, adapter, ids).logits
    assert (want - model(ids).logits).abs().max() > 1e-2
    lf.save_peft(adapter, tmp_path, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(tiny_model(kind, dtype=torch.float64), tmp_path).eval()
    _close(loaded(ids).logits, want, "peft on save_peft")
    again = lf.load_peft(tmp_path, model)
    assert all(torch.equal(again.params[k], t) for k, t in adapter.params.items())


class _TwoHeads(nn.Module):
    """``head(proj(emb(ids))) + aux_head(...)``: peft's ``modules_to_save=["head"]`` (a plain
    ``endswith``) also copies ``aux_head``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(61, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 61)
        self.aux_head = nn.Linear(8, 61)

    def forward(self, ids):
        h = self.proj(self.emb(ids))
        return self.head(h) + self.aux_head(h)


def test_a_copy_whose_name_peft_would_match_twice_is_refused_naming_both(tmp_path):
    """save_peft writes a copy's full name; when that name ends another module's name, peft
    would copy that module too (the oracle below): refused, naming both, nothing written. With
    both copied the checkpoint is peft's and loads back."""
    model = _TwoHeads().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(_TwoHeads().double(), LoraConfig(r=2, target_modules=["proj"], modules_to_save=["head"]))
    assert sorted(n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if type(m).__name__ == "ModulesToSaveWrapper") == ["aux_head", "head"]
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["proj"], r=2, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    head = lf.init_adapter(model, lf.AdapterSpec("ln_tuning", targets=["head"], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"copy of 'head' is written as modules_to_save='head'.*also selects 'aux_head'"):
        lf.save_peft(lf.compose(lora, head), tmp_path / "one", model=model)
    assert not (tmp_path / "one").exists()
    both = lf.init_adapter(model, lf.AdapterSpec("ln_tuning", targets=["head", "aux_head"], dtype=torch.float64))
    g = torch.Generator().manual_seed(1)
    adapter = lf.compose(lora, both)
    adapter = adapter.with_params({k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    lf.save_peft(adapter, tmp_path / "both", model=model)
    ids = tokens(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(_TwoHeads().double(), tmp_path / "both").eval()
    _close(loaded(ids), lf.adapted_call(model, adapter, ids), "peft on save_peft")
