"""SHiRA, FourierFT and C3A against HF peft 0.21 in float64 (issue 30), beyond the contract suite.

Per method: a peft adapter with perturbed trainables, saved by peft, loads with ``load_peft`` and
gives peft's logits and per-tensor gradients (lazy and merged); ``save_peft`` output loads in
peft with the same logits; positions peft derives from a seed are peft's exactly; the default
init trains. The tiny Llama is float64 with RMSNorm computing in the input dtype on both sides.
"""

from __future__ import annotations

import copy
import types

import peft
import pytest
import torch
from torch.func import grad

import lora_func as lf
from tests.contract_helpers import loss_fn
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

# transformers deprecations reached through peft
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),  # peft SHiRA's sparse delta
]

# v_proj 32 -> 16 and down_proj 48 -> 32: d_in != d_out, so a transposed delta shows; q_proj biased.
TARGETS = ["q_proj", "v_proj", "down_proj"]
REL = 1e-9


def _rmsnorm_in_input_dtype(model: torch.nn.Module) -> torch.nn.Module:
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.forward = types.MethodType(forward, m)
    return model


@pytest.fixture(scope="module")
def llama64():
    return _rmsnorm_in_input_dtype(tiny_model("llama", seed=1, dtype=torch.float64))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach() - want.detach()).abs().max() / want.detach().abs().max())


def peft_model_of(model, config):
    return peft.get_peft_model(copy.deepcopy(model), config).eval()


def perturb(pm, prefix: str, scale: float = 0.3, fp32_exact: bool = False) -> None:
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in sorted(pm.named_parameters()):
            if prefix in name:
                noise = scale * torch.randn(p.shape, generator=g, dtype=torch.float64)
                p.copy_(noise.float() if fp32_exact else noise)


def peft_logits_and_grads(pm, ids, prefix):
    pm.zero_grad()
    out = pm(input_ids=ids).logits
    ce_loss(out, ids).backward()
    grads = {}
    for name, p in pm.named_parameters():
        if prefix in name:
            module = name.removeprefix("base_model.model.").split(f".{prefix}")[0]
            grads[module] = p.grad.detach().clone()
    return out.detach(), grads


def check_against_peft(model, pm, directory, prefix, key, *, grad_rel=REL, logit_rel=REL):
    """load_peft(directory) gives pm's logits and per-tensor gradients (lazy and merged)."""
    ids = tokens(batch=2, length=9, seed=4)
    want, want_grads = peft_logits_and_grads(pm, ids, prefix)
    assert (want - model(ids).logits).abs().max() > 1e-3, "the perturbed adapter should change the output"
    adapter = lf.load_peft(directory, model)
    base = lf.base_params(model)
    for merged in (False, True):
        with torch.no_grad():
            got = lf.adapted_call(model, adapter, ids, merged=merged).logits
        assert rel(got, want) < logit_rel, (merged, rel(got, want))
        grads = grad(loss_fn(model, base, adapter, ids, merged=merged))(adapter.params)
        assert {k.removesuffix(f".{key}") for k in grads} == set(want_grads)
        for module, g in want_grads.items():
            assert g.abs().max() > 0
            assert rel(grads[f"{module}.{key}"], g.to(grads[f"{module}.{key}"].dtype)) < grad_rel, (module, merged)
    return adapter, ids, want


def check_reloads_in_peft(model, adapter, ids, want, tmp_path, *, logit_rel=REL):
    """save_peft output loads in peft (PeftModel.from_pretrained) with the same logits."""
    lf.save_peft(adapter, tmp_path / "ours", model=model)
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "ours").eval()
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    assert rel(got, want) < logit_rel, rel(got, want)
    return reloaded


def check_trains(spec, kind="llama", steps=8, lr=0.02):
    model = tiny_model(kind, seed=3)
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    ids = tokens(batch=4, length=12, seed=6)
    with torch.no_grad():
        torch.testing.assert_close(lf.adapted_call(model, adapter, ids).logits, model(ids).logits, rtol=0, atol=0)
    params = adapter.detach().params
    opt = torch.optim.Adam(params.values(), lr=lr)
    base = lf.base_params(model)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, base, adapter, ids)(params)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


# ============================================================================================ SHiRA


@pytest.mark.parametrize("seed", [None, 3])
def test_shira_peft_checkpoint_loads_with_peft_logits_gradients_and_reloads(llama64, tmp_path, seed):
    pm = peft_model_of(llama64, peft.ShiraConfig(r=2, target_modules=TARGETS, random_seed=seed))
    perturb(pm, "shira_weight")
    pm.save_pretrained(tmp_path / "peft")
    adapter, ids, want = check_against_peft(llama64, pm, tmp_path / "peft", "shira_weight", "shira_weight")
    # the positions: peft's own (read from its checkpoint), and the ones our init draws from the seed
    ours = lf.init_adapter(llama64, lf.AdapterSpec("shira", TARGETS, r=2, random_seed=seed, dtype=torch.float64))
    for name, module in pm.named_modules():
        if hasattr(module, "shira_indices") and "default" in module.shira_indices:
            key = f"{name.removeprefix('base_model.model.')}.shira_indices"
            assert torch.equal(adapter.buffers[key], module.shira_indices["default"].long()), key
            assert torch.equal(ours.buffers[key], module.shira_indices["default"].long()), key
            assert ours.buffers[key].dtype == torch.int64
    reloaded = check_reloads_in_peft(llama64, adapter, ids, want, tmp_path)
    assert reloaded.peft_config["default"].r == 2


def test_shira_custom_mask_loads_and_stays_in_peft(llama64, tmp_path):
    """A checkpoint made with a user mask (peft stores the positions) loads as mask_type='custom'."""

    def first_rows(base_layer, r, **kwargs):
        d_out, d_in = base_layer.weight.shape
        mask = torch.zeros(d_out, d_in, dtype=base_layer.weight.dtype)
        mask.view(-1)[: r * (d_in + d_out)] = 1
        return mask

    with pytest.warns(UserWarning, match="mask_type='first_rows' is not recognized"):
        config = peft.ShiraConfig(r=1, target_modules=["v_proj"], mask_type="first_rows")
    config.mask_fn = first_rows
    pm = peft_model_of(llama64, config)
    perturb(pm, "shira_weight")
    pm.save_pretrained(tmp_path / "peft")
    adapter, ids, want = check_against_peft(llama64, pm, tmp_path / "peft", "shira_weight", "shira_weight")
    assert adapter.spec.option("mask_type") == "custom"
    assert adapter.buffers["model.layers.0.self_attn.v_proj.shira_indices"][0].max() == 1  # the first 48 = 32 + 16 weights
    check_reloads_in_peft(llama64, adapter, ids, want, tmp_path)
    with pytest.raises(ValueError, match=r"mask_type='custom'.*with_buffers"):
        lf.init_adapter(llama64, lf.AdapterSpec("shira", ["v_proj"], r=1, mask_type="custom"))


def test_shira_refusals():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"r=12 asks for r·\(d_in \+ d_out\) = 576 values.*at most 10"):
        lf.init_adapter(model, lf.AdapterSpec("shira", ["v_proj"], r=12))
    with pytest.raises(ValueError, match="mask_type='grid' is not one of"):
        lf.AdapterSpec("shira", ["v_proj"], mask_type="grid")
    with pytest.raises(ValueError, match="random_seed=-1"):
        lf.AdapterSpec("shira", ["v_proj"], random_seed=-1)
    with pytest.raises(TypeError, match="is not supported"):
        peft.get_peft_model(tiny_model("gpt2"), peft.ShiraConfig(r=1, target_modules=["c_attn"]))


def test_shira_trains_and_init_weights_false_is_random():
    check_trains(lf.AdapterSpec("shira", TARGETS, r=2))
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("shira", ["v_proj"], r=2, init_weights=False), generator=torch.Generator().manual_seed(0))
    values = adapter.params["model.layers.0.self_attn.v_proj.shira_weight"]
    assert values.shape == (96,) and 0.7 < values.std() < 1.3


# ======================================================================================== FourierFT


@pytest.fixture(scope="module")
def gpt2_64():
    return tiny_model("gpt2", seed=1, dtype=torch.float64)


def _fourierft_delta_in_float64(self, adapter):
    """peft's ``FourierFTLayer.get_delta_weight`` with its fp32 (``torch.zeros`` in the default
    dtype, ``spectrum.float()``) made float64: every other line is peft's."""
    spectrum = self.fourierft_spectrum[adapter]
    indices = self.indices[adapter].to(spectrum.device)
    dense_spectrum = torch.zeros(self.out_features, self.in_features, device=spectrum.device, dtype=torch.float64)
    dense_spectrum[indices[0, :], indices[1, :]] = spectrum.double()
    delta_weight = torch.fft.ifft2(dense_spectrum).real * self.fourierft_scaling[adapter]
    return delta_weight.to(spectrum.dtype)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_fourierft_peft_checkpoint_loads_with_peft_logits_gradients_and_reloads(llama64, gpt2_64, tmp_path, kind, monkeypatch):
    """peft re-derives the positions from random_loc_seed; so do load_peft and init_adapter.
    A per-layer n_frequency_pattern is lora_func's rank pattern, both ways. peft computes its
    delta in fp32 whatever the model's dtype (``torch.zeros`` in the default dtype,
    ``spectrum.float()``): against peft as it is the bound is fp32's; against peft with those two
    made float64 it is 1e-9."""
    model = llama64 if kind == "llama" else gpt2_64
    targets = TARGETS if kind == "llama" else ["c_attn", "c_fc"]
    pattern = {"model.layers.1.self_attn.v_proj": 40} if kind == "llama" else {"transformer.h.0.attn.c_attn": 40}
    config = peft.FourierFTConfig(
        n_frequency=24, scaling=75.0, random_loc_seed=5, target_modules=targets, n_frequency_pattern=pattern,
        init_weights=True, fan_in_fan_out=kind == "gpt2",
    )
    pm = peft_model_of(model, config)
    perturb(pm, "fourierft_spectrum")
    pm.save_pretrained(tmp_path / "peft")
    check_against_peft(model, pm, tmp_path / "peft", "fourierft_spectrum", "fourierft_spectrum", grad_rel=1e-5, logit_rel=1e-6)
    monkeypatch.setattr(peft.tuners.fourierft.layer.FourierFTLayer, "get_delta_weight", _fourierft_delta_in_float64)
    adapter, ids, want = check_against_peft(model, pm, tmp_path / "peft", "fourierft_spectrum", "fourierft_spectrum")
    sizes = {layer.target.module: layer.info.r for layer in adapter.layers}
    assert sizes == {m: pattern.get(m, 24) for m in sizes} and len(set(sizes.values())) == 2
    ours = lf.init_adapter(model, lf.AdapterSpec("fourierft", targets, r=24, random_loc_seed=5, dtype=torch.float64))
    for name, module in pm.named_modules():
        if hasattr(module, "indices") and "default" in module.indices:
            key = f"{name.removeprefix('base_model.model.')}.fourierft_indices"
            assert torch.equal(adapter.buffers[key], module.indices["default"]), key
            if name.removeprefix("base_model.model.") not in pattern:
                assert torch.equal(ours.buffers[key], module.indices["default"]), key
    reloaded = check_reloads_in_peft(model, adapter, ids, want, tmp_path)
    assert reloaded.peft_config["default"].n_frequency_pattern == pattern


def test_fourierft_default_init_is_peft_random_spectrum_and_trains():
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("fourierft", ["v_proj"], r=64), generator=torch.Generator().manual_seed(0))
    spectrum = adapter.params["model.layers.0.self_attn.v_proj.fourierft_spectrum"]
    assert spectrum.shape == (64,) and 0.7 < spectrum.std() < 1.3  # peft's default init_weights=False: randn
    assert adapter.spec.option("scaling") == 150.0 and adapter.spec.option("random_loc_seed") == 777
    check_trains(lf.AdapterSpec("fourierft", TARGETS, r=32, init_weights=True), lr=0.1)


def test_fourierft_refusals():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"r=513 frequencies.*16×32 = 512.*at most 512"):
        lf.init_adapter(model, lf.AdapterSpec("fourierft", ["v_proj"], r=513))
    with pytest.raises(ValueError, match="random_loc_seed=-3"):
        lf.AdapterSpec("fourierft", ["v_proj"], random_loc_seed=-3)


def test_fourierft_and_shira_stacks_of_different_sizes_equal_each_alone():
    """Stacks of different r (numbers of frequencies / values): padded, each member masked."""
    model = tiny_model("gpt2")
    ids = tokens()
    for variant, kwargs, ranks in (("fourierft", {"init_weights": True}, (8, 20)), ("shira", {}, (1, 3))):
        adapters = []
        for i, r in enumerate(ranks):
            a = lf.init_adapter(model, lf.AdapterSpec(variant, ["c_attn"], r=r, **kwargs), generator=torch.Generator().manual_seed(i))
            g = torch.Generator().manual_seed(7 + i)
            adapters.append(a.with_params({k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in a.params.items()}))
        stacked = lf.stack(adapters)
        base = lf.base_params(model)
        for merged in (False, True):
            batched = torch.func.vmap(lambda a, merged=merged: lf.adapted_call(model, a, ids, merged=merged).logits)(stacked)
            for i, a in enumerate(adapters):
                alone = lf.adapted_call(model, a, ids, merged=merged).logits
                torch.testing.assert_close(batched[i], alone, atol=1e-5, rtol=1e-5)
                assert (alone - model(ids).logits).abs().max() > 1e-2
        grads = torch.func.vmap(lambda a, base=base: grad(loss_fn(model, base, a, ids))(a.params))(stacked)
        for key, g in grads.items():
            assert g.shape[-1] == max(r * (1 if variant == "fourierft" else 128) for r in ranks)
            small = ranks[0] * (1 if variant == "fourierft" else 128)
            assert torch.count_nonzero(g[0, ..., small:]) == 0 and g[0, ..., :small].abs().max() > 0, key


# ============================================================================================== C3A


def _c3a_forward(conv):
    """peft's ``C3ALinear.forward`` with its fp32 casts made float64 and its circular convolution
    ``conv``: every other line is peft's."""

    def forward(self, x, *args, **kwargs):
        previous_dtype = x.dtype
        result = self.base_layer(x, *args, **kwargs)
        x = x.to(torch.float64)
        for active_adapter in self.active_adapters:
            if active_adapter not in self.c3a_kernel:
                continue
            c3a_kernel = self.c3a_kernel[active_adapter].to(torch.float64)
            x = conv(x, c3a_kernel) / x.size(-1)
            result += x.to(result.dtype)
        return result.to(previous_dtype)

    return forward


def _peft_conv_autograd(x, w):
    """peft's ``BlockCircularConvolution.forward``, differentiated by autograd instead of its
    hand-written backward (whose input gradient is wrong in peft 0.21: see the test)."""
    _, n, b = w.shape
    x = x.reshape(*x.shape[:-1], n, b)
    x = torch.einsum("...nb,mnb->...mb", torch.fft.ifft(x), torch.fft.fft(w))
    return torch.fft.fft(x).real.reshape(*x.shape[:-2], -1)


def test_c3a_peft_checkpoint_loads_with_peft_logits_gradients_and_reloads(llama64, tmp_path, monkeypatch):
    """block_size / block_size_pattern are lora_func's r / rank pattern, both ways. peft runs its
    circular convolution in fp32 whatever the model's dtype: against peft as it is, the logits
    agree to fp32's bound; with those casts made float64, to 1e-9.

    peft 0.21's hand-written backward (``BlockCircularConvolution``) gives the right kernel
    gradient but a wrong INPUT gradient, so every kernel whose gradient flows back through
    another C3A layer is wrong in peft. Ours is checked against a central finite difference,
    against peft's forward differentiated by autograd (1e-9), and against peft's own backward
    where it is right: the last adapted layer."""
    from peft.tuners.c3a.utils import BlockCircularConvolution

    pattern = {"model.layers.0.mlp.down_proj": 16}
    config = peft.C3AConfig(block_size=8, target_modules=TARGETS, block_size_pattern=pattern, init_weights="kaiming_uniform")
    pm = peft_model_of(llama64, config)
    perturb(pm, "c3a_kernel", scale=3.0)
    pm.save_pretrained(tmp_path / "peft")
    ids = tokens(batch=2, length=9, seed=4)
    adapter = lf.load_peft(tmp_path / "peft", llama64)
    sizes = {layer.target.module: layer.info.r for layer in adapter.layers}
    assert sizes == {m: pattern.get(m, 8) for m in sizes} and adapter.spec.option("init") == "kaiming_uniform"
    with torch.no_grad():
        assert rel(lf.adapted_call(llama64, adapter, ids).logits, pm(input_ids=ids).logits) < 1e-6  # peft's fp32
    base = lf.base_params(llama64)
    ours = grad(loss_fn(llama64, base, adapter, ids))(adapter.params)

    monkeypatch.setattr(peft.tuners.c3a.layer.C3ALinear, "forward", _c3a_forward(BlockCircularConvolution.apply))
    want, peft_own = peft_logits_and_grads(pm, ids, "c3a_kernel")
    last = "model.layers.1.mlp.down_proj"
    assert rel(ours[f"{last}.c3a_kernel"], peft_own[last]) < REL
    first = "model.layers.0.self_attn.q_proj"
    assert rel(ours[f"{first}.c3a_kernel"], peft_own[first]) > 0.1  # peft's wrong input gradient
    # ours is the derivative: a central difference on one kernel entry of the first layer (h =
    # 1e-2: the "float64" Llama runs its attention softmax in fp32, so the loss has fp32 noise)
    loss = loss_fn(llama64, base, adapter, ids)
    kernel = adapter.params[f"{first}.c3a_kernel"].detach()
    step = torch.zeros_like(kernel)
    step[1, 2, 3] = 1e-2
    with torch.no_grad():
        central = float((loss({**adapter.params, f"{first}.c3a_kernel": kernel + step}) - loss({**adapter.params, f"{first}.c3a_kernel": kernel - step})).detach()) / 2e-2
    mine, theirs = float(ours[f"{first}.c3a_kernel"][1, 2, 3].detach()), float(peft_own[first][1, 2, 3])
    assert abs(mine - central) < 0.02 * abs(central) and abs(theirs - central) > 0.2 * abs(central), (mine, theirs, central)

    monkeypatch.setattr(peft.tuners.c3a.layer.C3ALinear, "forward", _c3a_forward(_peft_conv_autograd))
    adapter, ids, want = check_against_peft(llama64, pm, tmp_path / "peft", "c3a_kernel", "c3a_kernel")
    reloaded = check_reloads_in_peft(llama64, adapter, ids, want, tmp_path)
    assert reloaded.peft_config["default"].block_size_pattern == pattern
    # peft's merged delta (its get_circulant_fast, fp32) equals our weight form's
    merged = lf.merge_overlay(base, adapter)
    for name, module in reloaded.named_modules():
        if hasattr(module, "c3a_kernel") and "default" in module.c3a_kernel:
            key = name.removeprefix("base_model.model.")
            got = merged[f"{key}.weight"] - base[f"{key}.weight"]
            assert rel(got, module.get_delta_weight("default").double()) < 1e-6, key


@pytest.mark.parametrize("init", ["xavier_uniform", "kaiming_uniform", "gaussian"])
def test_c3a_random_inits_follow_peft(init):
    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec("c3a", ["v_proj"], r=8, init=init), generator=torch.Generator().manual_seed(0))
    k = adapter.params["model.layers.0.self_attn.v_proj.c3a_kernel"]
    assert k.shape == (2, 4, 8)
    bound = {"xavier_uniform": (3 * 2 / 48) ** 0.5, "kaiming_uniform": (1 / 32) ** 0.5}.get(init)
    if bound is None:
        assert 0.6 < k.std() < 1.4
    else:
        assert k.abs().max() <= bound and k.abs().max() > 0.8 * bound


def test_c3a_trains_and_refusals():
    check_trains(lf.AdapterSpec("c3a", TARGETS, r=8), lr=0.5)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"r=12 \(peft's block_size\) must divide d_in=32 and d_out=16.*r=16"):
        lf.init_adapter(model, lf.AdapterSpec("c3a", ["v_proj"], r=12))
    with pytest.raises(ValueError, match="init='ones' is not one of"):
        lf.AdapterSpec("c3a", ["v_proj"], init="ones")
    with pytest.raises(TypeError, match="is not supported"):
        peft.get_peft_model(tiny_model("gpt2"), peft.C3AConfig(block_size=8, target_modules=["c_attn"]))
    a, b = (lf.init_adapter(model, lf.AdapterSpec("c3a", ["v_proj"], r=r)) for r in (4, 8))
    with pytest.raises(ValueError, match=r"c3a tensor 'c3a_kernel'.*not a rank axis"):
        lf.stack([a, b])


@pytest.mark.parametrize(
    ("variant", "kwargs", "field", "bad"),
    [
        ("shira", {"r": 1, "random_seed": 0}, "random_seed", [-1, 1.5, "3"]),
        ("fourierft", {"r": 8, "random_loc_seed": 0}, "random_loc_seed", [-1, None, True]),
        ("c3a", {"r": 8, "init": "gaussian"}, "init_weights", ["ones", 1]),
    ],
)
def test_peft_configs_with_invalid_fields_are_refused(tmp_path, variant, kwargs, field, bad):
    """save_peft -> load_peft round trip (seed 0 is a valid seed), then the same checkpoint with
    each invalid value of the field: refused naming it, before anything is built."""
    import json

    model = tiny_model("llama")
    adapter = lf.init_adapter(model, lf.AdapterSpec(variant, ["v_proj"], **kwargs), generator=torch.Generator().manual_seed(0))
    lf.save_peft(adapter, tmp_path, model=model)
    again = lf.load_peft(tmp_path, model)
    assert again.spec.options == adapter.spec.options and all(torch.equal(again.buffers[k], v) for k, v in adapter.buffers.items())
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    for value in bad:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=f"{field}="):
            lf.load_peft(tmp_path, model)
