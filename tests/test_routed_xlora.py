"""X-LoRA against HF peft's ``XLoraModel`` in float64 (issue 47).

peft's checkpoint (its config, its classifier tensors, the expert LoRAs it names) with perturbed
classifier is read by ``load_xlora``: logits, the loss and the gradient of every classifier tensor
and every expert factor equal peft's (relative 1e-9), on two configurations that between them
use every option (depth 1 and 3, layerwise or broadcast scalings, softmax, top-k with and
without its softmax, a non-zero scaling-pass value, a global weight). ``save_xlora`` loads in
peft; greedy ``generate`` with the KV cache is token-equal to peft's (which runs without one);
``vmap`` over a stack of X-LoRA adapters and one adapter per row equal a loop;
``per_example_grads`` equals a per-example loop; the merged path is refused."""

from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch
from safetensors.torch import save_file

import lora_func as lf
from lora_func import routed
from lora_func.adapter import SHARED
from tests.bank_oracle import model64, peft_model, rel
from tests.models import tokens
from tests.peft_helpers import ce_loss

RTOL = 1e-9
TARGETS = ["q_proj", "v_proj", "down_proj"]
ALPHAS = [4.0, 6.0, 3.0]
CONFIGS = {
    # depth 3 (dropout between layers: peft's Sequential indices 0, 3, 6), per-layer scalings,
    # softmax with a temperature, the top 2 experts kept, a global weight
    "deep": dict(xlora_depth=3, xlora_size=8, xlora_dropout_p=0.2, layerwise_scalings=True, softmax_temperature=0.7, top_k_lora=2,
                 global_scaling_weight=1.3),
    # one linear layer, the same scalings in every layer, no softmax on the classifier but a softmax
    # over the top 2 kept experts, a non-zero scaling-pass value (the first pass applies the experts)
    "flat": dict(xlora_depth=1, enable_softmax=False, enable_softmax_topk=True, top_k_lora=2, scaling_pass_value=0.3),
}


@pytest.fixture(scope="module")
def model():
    return model64()


@pytest.fixture(scope="module")
def experts(model, tmp_path_factory):
    """Paths of three perturbed peft LoRA checkpoints, each with its own alpha."""
    directory = tmp_path_factory.mktemp("xlora_experts")
    paths = []
    for i, alpha in enumerate(ALPHAS):
        pm = peft_model(model, peft.LoraConfig(r=2, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0), seed=10 + i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm.save_pretrained(directory / f"lora{i}")
        paths.append(str(directory / f"lora{i}"))
    return paths


DROPOUTS = [0.1, 0.0, 0.3]  # each expert's own lora_dropout (one without)


@pytest.fixture(scope="module")
def dropout_experts(model, tmp_path_factory):
    """Paths of three peft LoRA checkpoints as ``experts``' but each with its own ``lora_dropout``."""
    directory = tmp_path_factory.mktemp("xlora_dropout_experts")
    paths = []
    for i, (alpha, p) in enumerate(zip(ALPHAS, DROPOUTS, strict=True)):
        pm = peft_model(model, peft.LoraConfig(r=2, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=p), seed=10 + i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm.save_pretrained(directory / f"lora{i}")
        paths.append(str(directory / f"lora{i}"))
    return paths


def _peft_xlora(model, paths, **config):
    base = copy.deepcopy(model)
    base.config.use_cache = False  # XLoraModel refuses a base that caches
    cfg = peft.XLoraConfig(task_type="CAUSAL_LM", hidden_size=model.config.hidden_size, adapters={str(i): p for i, p in enumerate(paths)}, **config)
    return peft_model(base, cfg, seed=5)  # the classifier perturbed (the experts are frozen: peft's default)


def _write_peft_checkpoint(pm, directory) -> None:
    """peft's files, the classifier whole: ``save_pretrained``'s config, and every tensor that
    ``XLoraModel._get_adapter_state_dict`` keeps (peft's own filter then drops ``layers.0.``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(directory)
    classifier = {k: v.detach().contiguous() for k, v in pm.state_dict().items() if "internal_xlora_classifier" in k}
    save_file(classifier, str(directory / "adapter_model.safetensors"))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def loaded(request, model, experts, tmp_path_factory):
    """(peft's X-LoRA model, load_xlora of its checkpoint, the config name)."""
    pm = _peft_xlora(model, experts, **CONFIGS[request.param])
    directory = tmp_path_factory.mktemp("xlora")
    _write_peft_checkpoint(pm, directory)
    return pm, routed.load_xlora(directory, model), request.param


def _peft_grads(pm) -> dict[str, torch.Tensor]:
    """peft's gradients keyed as the xlora adapter keys them (experts stacked)."""
    grads, linears = {}, [m for m in pm.base_model.internal_xlora_classifier.layers if isinstance(m, torch.nn.Linear)]
    for i, layer in enumerate(linears):
        grads[f"{SHARED}.classifier_{i}_weight"], grads[f"{SHARED}.classifier_{i}_bias"] = layer.weight.grad, layer.bias.grad
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, p in pm.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            module, rest = name.removeprefix("base_model.lora_model.model.").split(".lora_")
            which, expert = rest.split(".")[:2]
            experts.setdefault(f"{module}.lora_{which}", {})[int(expert)] = p.grad
    return grads | {k: torch.stack([v[e] for e in sorted(v)]) for k, v in experts.items()}


def test_load_peft_checkpoint_logits_loss_and_every_gradient_equal_peft(model, loaded):
    pm, adapter, name = loaded
    pm.base_model.xlora_config.use_trainable_adapters = True  # peft freezes the experts (at every call): ask for their gradients too
    ids = tokens(3, 9, seed=3)
    pm.zero_grad()
    want = pm(input_ids=ids).logits
    want_loss = ce_loss(want, ids)
    want_loss.backward()
    peft_grads = _peft_grads(pm)
    assert sorted(peft_grads) == sorted(adapter.params)
    assert (want - model(ids).logits).abs().max() > 1e-2, "the experts should change the output"
    params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
    got = routed.xlora_call(model, adapter.with_params(params), ids).logits
    loss = ce_loss(got, ids)
    assert rel(got, want) < RTOL and rel(loss, want_loss) < RTOL, name
    for key, grad in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
        assert peft_grads[key].abs().max() > 0, key
        assert rel(grad, peft_grads[key]) < RTOL, (name, key)
    # the scalings are per token and per layer: a routing that ignored them would pass nothing above
    scalings = routed.xlora_scalings(model, adapter, ids)
    assert scalings.shape == (3, 9, len(adapter.layers), 3)
    assert (scalings[:, 1:] - scalings[:, :1]).abs().max() > 1e-3, "tokens get different scalings"


def test_a_training_step_drops_out_each_expert_s_input_as_peft_with_the_same_seed(model, dropout_experts, tmp_path):
    """In train mode peft applies each expert's own ``lora_dropout`` (one mask per expert, in both
    passes) and the classifier's dropout: with the same seed, logits, loss and every gradient equal
    peft's (relative 1e-9). The same step without the experts' dropout is not peft's, and the
    experts come back with their dropouts (``xlora_experts``, so ``save_xlora`` keeps them)."""
    pm = _peft_xlora(model, dropout_experts, **CONFIGS["deep"])
    pm.base_model.xlora_config.use_trainable_adapters = True
    _write_peft_checkpoint(pm, tmp_path)
    adapter = routed.load_xlora(tmp_path, model)
    assert adapter.spec.option("expert_dropout") == tuple(DROPOUTS)
    assert [e.spec.option("dropout") for e in routed.xlora_experts(adapter)] == DROPOUTS
    undropped = routed.xlora(routed.xlora_experts(adapter), hidden_size=model.config.hidden_size, expert_dropout=(), **CONFIGS["deep"])
    undropped = undropped.with_params(adapter.params)
    ids = tokens(3, 9, seed=3)
    pm.train(), model.train()
    try:
        pm.zero_grad()
        torch.manual_seed(11)
        want = pm(input_ids=ids).logits
        want_loss = ce_loss(want, ids)
        want_loss.backward()
        peft_grads = _peft_grads(pm)
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        torch.manual_seed(11)
        got = routed.xlora_call(model, adapter.with_params(params), ids).logits
        loss = ce_loss(got, ids)
        assert rel(got, want) < RTOL and rel(loss, want_loss) < RTOL
        for key, grad in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
            assert peft_grads[key].abs().max() > 0, key
            assert rel(grad, peft_grads[key]) < RTOL, key
        torch.manual_seed(11)
        assert rel(routed.xlora_call(model, undropped, ids).logits, want) > 1e-3, "the experts' dropout acts"
    finally:
        pm.eval(), model.eval()
    with torch.no_grad():  # in eval mode no dropout: the two agree
        assert rel(routed.xlora_call(model, adapter, ids).logits, routed.xlora_call(model, undropped, ids).logits) < RTOL


def test_the_experts_dropout_under_vmap_follows_randomness(model, dropout_experts, tmp_path):
    """Per-example gradients of a training step: ``randomness="error"`` (the default) refuses the
    experts' dropout, as for LoRA's; ``"different"`` draws a mask per example."""
    pm = _peft_xlora(model, dropout_experts, **CONFIGS["flat"])
    _write_peft_checkpoint(pm, tmp_path)
    adapter = routed.load_xlora(tmp_path, model)
    ids = tokens(2, 7, seed=6)

    def loss_fn(a, x):
        return ce_loss(routed.xlora_call(model, a, x).logits, x)

    model.train()
    try:
        with pytest.raises(RuntimeError, match="randomness"):
            lf.per_example_grads(loss_fn, adapter, ids)
        torch.manual_seed(0)
        dropped = lf.per_example_grads(loss_fn, adapter, ids, randomness="different")
    finally:
        model.eval()
    exact = lf.per_example_grads(loss_fn, adapter, ids)
    key = next(k for k in adapter.params if k.endswith("lora_A"))
    assert rel(dropped[key], exact[key]) > 1e-3


def test_peft_save_pretrained_file_is_refused_naming_what_peft_dropped(model, experts, tmp_path):
    pm = _peft_xlora(model, experts, **CONFIGS["deep"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"layers\.0\.weight") as err:
        routed.load_xlora(tmp_path, model)
    assert "layers.3" not in str(err.value) and "save_xlora" in str(err.value)


def test_save_xlora_loads_in_peft_and_native_save_round_trips(model, loaded, tmp_path):
    _, adapter, name = loaded
    g = torch.Generator().manual_seed(7)
    adapter = adapter.with_params({k: v + 0.2 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    routed.save_xlora(adapter, tmp_path / "x", model=model)
    base = copy.deepcopy(model)
    base.config.use_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(base, tmp_path / "x").eval()
    ids = tokens(3, 9, seed=3)
    with torch.no_grad():
        assert rel(routed.xlora_call(model, adapter, ids).logits, pm(input_ids=ids).logits) < RTOL, name
    again = routed.load_xlora(tmp_path / "x", model)
    assert all(torch.equal(again.params[k], v) for k, v in adapter.params.items())
    lf.save(adapter, tmp_path / "native.safetensors")
    native = lf.load(tmp_path / "native.safetensors", model=model)
    assert all(torch.equal(native.params[k], v) for k, v in adapter.params.items())
    assert all(torch.equal(native.buffers[k], v) for k, v in adapter.buffers.items())


def test_greedy_generate_with_the_kv_cache_token_equal_to_peft(model, loaded):
    pm, adapter, name = loaded
    ids = tokens(2, 6, seed=4)
    with torch.no_grad():
        want = pm.generate(input_ids=ids, max_new_tokens=6, do_sample=False)  # peft: no cache, both passes on all tokens
        with routed.xlora_adapted(model, adapter):
            got = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, use_cache=True)
            uncached = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, use_cache=False)
            beams = model.generate(input_ids=ids, max_new_tokens=4, num_beams=2, do_sample=False, use_cache=True)
        peft_beams = pm.generate(input_ids=ids, max_new_tokens=4, num_beams=2, do_sample=False)
        base = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert "forward" not in model.__dict__
    assert torch.equal(got, want) and torch.equal(uncached, want), name
    assert torch.equal(beams, peft_beams), name
    assert not torch.equal(base, want), "the experts should change the greedy tokens"


def test_a_vmapped_stack_and_one_adapter_per_row_equal_a_loop(model, loaded):
    _, adapter, _ = loaded
    g = torch.Generator().manual_seed(3)
    other = adapter.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in adapter.params.items()})
    ids = tokens(3, 9, seed=3)
    index = torch.tensor([1, 0, 1])
    with torch.no_grad():
        alone = [routed.xlora_call(model, a, ids).logits for a in (adapter, other)]
        vmapped = torch.func.vmap(lambda a: routed.xlora_call(model, a, ids).logits)(lf.stack([adapter, other]))
        mixed = routed.xlora_call(model, lf.stack([adapter, other]), ids, index=index).logits
    assert (alone[0] - alone[1]).abs().max() > 1e-3
    for k in range(2):
        assert rel(vmapped[k], alone[k]) < RTOL
    for b, k in enumerate(index.tolist()):
        assert rel(mixed[b], alone[k][b]) < RTOL, b


def test_per_example_grads_equal_a_loop(model, loaded):
    _, adapter, _ = loaded
    ids = tokens(3, 7, seed=6)

    def loss_fn(a, x):
        return ce_loss(routed.xlora_call(model, a, x).logits, x)

    got = lf.per_example_grads(loss_fn, adapter, ids)
    for b in range(3):
        params = {k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()}
        want = torch.autograd.grad(loss_fn(adapter.with_params(params), ids[b : b + 1]), list(params.values()))
        for key, grad in zip(params, want, strict=True):
            assert rel(got[key][b], grad) < RTOL, (b, key)


def test_merging_is_refused_and_the_stored_scalings_pass_merges(model, loaded):
    _, adapter, _ = loaded
    ids = tokens(2, 9, seed=3)
    with pytest.raises(ValueError, match="no merged weight"):
        routed.xlora_call(model, adapter, ids, merged=True)
    scalings = routed.xlora_scalings(model, adapter, ids)
    with pytest.raises(ValueError, match="per token"):
        lf.merge_overlay(lf.base_params(model), routed._with_scalings(adapter, scalings))
    with torch.no_grad():  # the adapter as stored (constant scalings: peft's scalings pass) has a merged weight
        lazy = lf.adapted_call(model, adapter, ids).logits
        merged = lf.adapted_call(model, adapter, ids, merged=True).logits
    assert rel(merged, lazy) < RTOL


def test_classifier_keys_and_experts_round_trip(model, experts, loaded):
    _, adapter, _ = loaded
    keys = routed.xlora_classifier_keys(adapter)
    assert keys and all(k.startswith(f"{SHARED}.classifier_") for k in keys)
    assert set(adapter.params) - set(keys) == {k for k in adapter.params if ".lora_" in k}
    ids = tokens(2, 9, seed=3)
    with torch.no_grad():
        for expert, path in zip(routed.xlora_experts(adapter), experts, strict=True):
            assert rel(lf.adapted_call(model, expert, ids).logits, lf.adapted_call(model, lf.load_peft(path, model), ids).logits) < RTOL



def test_gpt2_conv1d_equals_a_hand_written_two_pass_oracle():
    """peft's X-LoRA cannot load experts into GPT-2 (its key rewriting expects a ``model.``
    decoder): the oracle is the math written out, each target's forward replaced by ``base(x) +
    g Σ_k s_k scale_k (x A_kᵀ) B_kᵀ`` with the scalings of the first pass (GPT-2's ``Conv1D``
    flattens the tokens before its op: a form that read the scalings in the wrong layout fails)."""
    gpt2 = model64("gpt2")
    spec = lf.AdapterSpec("lora", ["c_attn", "c_fc"], r=2, alpha=4.0, dtype=torch.float64)
    experts = [lf.init_adapter(gpt2, spec, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    g = torch.Generator().manual_seed(9)
    experts = [a.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in a.params.items()}) for a in experts]
    adapter = routed.xlora(experts, hidden_size=gpt2.config.hidden_size, layerwise_scalings=True, top_k_lora=2, global_scaling_weight=1.3,
                           generator=torch.Generator().manual_seed(1))
    ids = tokens(2, 7, seed=1)
    with torch.no_grad():
        got = routed.xlora_call(gpt2, adapter, ids).logits
        scalings = routed.xlora_scalings(gpt2, adapter, ids)  # (2, 7, 4, 3)
        modules = dict(gpt2.named_modules())
        for position, layer in enumerate(adapter.layers):
            module = modules[layer.target.module]
            s = scalings[:, :, position]
            s = s * torch.zeros_like(s).scatter(-1, s.topk(2, dim=-1).indices, 1.0)
            a, b = adapter.params[f"{layer.target.module}.lora_A"], adapter.params[f"{layer.target.module}.lora_B"]

            def forward(x, module=module, s=s, a=a, b=b):
                out = x @ module.weight + module.bias
                return out + 1.3 * sum(s[..., k : k + 1] * 2.0 * (x @ a[k].T) @ b[k].T for k in range(3))

            module.forward = forward
        try:
            want = gpt2(ids).logits
        finally:
            for layer in adapter.layers:
                del modules[layer.target.module].forward
    assert rel(got, want) < RTOL and (want - gpt2(ids).logits).abs().max() > 1e-2


def test_bad_experts_and_depth_are_refused_naming_xlora(model):
    """A bad expert list raises Arrow's catalogued errors (their causes name both) with messages
    that name ``xlora()``; ``xlora_depth`` above the 8 declared classifier slots says so."""
    spec = lf.AdapterSpec("lora", ["q_proj", "v_proj"], r=2, dtype=torch.float64)
    loras = [lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    other = lf.init_adapter(model, lf.AdapterSpec("lora", ["q_proj"], r=2, dtype=torch.float64))
    dora = lf.init_adapter(model, lf.AdapterSpec("dora", ["q_proj", "v_proj"], r=2, dtype=torch.float64))
    for experts, error, words in ((loras[0], TypeError, "must be a non-empty list of LoRA adapters"),
                                  ([loras[0], dora], TypeError, r"experts\[1\] must be a plain LoRA adapter"),
                                  ([loras[0], other], ValueError, "X-LoRA mixes LoRAs of one rank")):
        with pytest.raises(error, match=words) as err:
            routed.xlora(experts, hidden_size=32)
        assert str(err.value).startswith("xlora():")
    with pytest.raises(ValueError, match="at most 8 classifier layers"):
        routed.xlora(loras, hidden_size=32, xlora_depth=9)
    assert len(routed.xlora(loras, hidden_size=32, xlora_depth=8, xlora_size=4).shared.param_shapes) == 2 * 8
