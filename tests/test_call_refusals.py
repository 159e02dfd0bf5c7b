"""What an adapted call and calibration refuse at the public boundary, through the public API:
adapter tensors on another device or of an integer dtype, an adapter built for another layer
layout, an integer base, arguments of the wrong type, bad calibration data; and that a base from
``named_parameters()`` leaves the model without ``.grad``, a bf16 merge keeps an fp32 base exact,
and the lazy fallback of IA3 scales the bias. (Issue 22's reliability items; each test failed
before its fix.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import lora_func as lf
from tests.contract_helpers import assert_unchanged, snapshot
from tests.models import Net, tiny_model


def visible(adapter: lf.Adapter, shift: float = 0.5) -> lf.Adapter:
    """Every param moved off its init (LoRA's B = 0 would hide the adapter)."""
    return adapter.with_params({k: (v + shift).detach().requires_grad_(True) for k, v in adapter.params.items()})


def lora(model: nn.Module, **kwargs) -> lf.Adapter:
    kwargs.setdefault("r", 2)
    spec = lf.AdapterSpec(kwargs.pop("variant", "lora"), targets=["proj"], **kwargs)
    return visible(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0)))


# ------------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("merged", [False, True])
def test_adapter_tensors_on_another_device_are_refused(merged):
    model = Net()
    adapter = lora(model)
    on_meta = adapter.with_params({k: v.detach().to("meta") for k, v in adapter.params.items()})
    with pytest.raises(ValueError, match="not on their target weight's device") as err:
        lf.adapted_call(model, on_meta, torch.randn(2, 8), merged=merged)
    assert "proj.lora_A on meta" in str(err.value)
    with pytest.raises(ValueError, match="not on their target weight's device"):
        lf.overlay(lf.base_params(model), on_meta)


def test_a_linear_adapter_on_a_same_shaped_conv1d_is_refused():
    adapter = lora(Net())
    conv = Net(proj=Conv1D(8, 8))
    snap = snapshot(conv)
    for call in (lambda: lf.adapted_call(conv, adapter, torch.randn(2, 8)), lambda: lf.adapted(conv, adapter).__enter__()):
        with pytest.raises(ValueError, match="the stored weight layouts differ"):
            call()
    assert_unchanged(conv, snap)


def test_integer_adapter_params_are_refused_on_the_lazy_path():
    model = Net()
    adapter = lora(model)
    with pytest.raises(TypeError, match="must be floating-point tensors"):
        lf.Adapter({k: v.detach().long() for k, v in adapter.params.items()}, adapter.buffers, adapter.spec, adapter.layers)
    ints = adapter.detach()
    ints.params.update({k: v.detach().long() for k, v in adapter.params.items()})  # edited in place
    with pytest.raises(TypeError, match="are not in the adapter dtype"):
        lf.adapted_call(model, ints, torch.randn(2, 8))


# ------------------------------------------------------------------------------- item 4


def test_merge_overlay_and_overlay_refuse_an_int8_base():
    adapter = lora(Net())
    int_net = Net()
    int_net.proj.weight = nn.Parameter(torch.randint(-5, 5, (8, 8), dtype=torch.int8), requires_grad=False)
    base = lf.base_params(int_net)
    for make in (lf.merge_overlay, lf.overlay, lf.overlay_mode):
        with pytest.raises(TypeError, match=r"proj.weight \(torch.int8\)"):
            make(base, adapter)


# ------------------------------------------------------------------------------- item 7


def test_core_boundaries_name_the_argument():
    model = Net()
    adapter = lora(model)
    spec = lf.AdapterSpec("lora", targets=["proj"], r=2)
    with pytest.raises(TypeError, match="init_adapter: model must be a torch.nn.Module"):
        lf.init_adapter(model.state_dict(), spec)
    with pytest.raises(TypeError, match="base_params: model must be a torch.nn.Module"):
        lf.base_params(model.state_dict())
    with pytest.raises(TypeError, match="adapted_call: model must be a torch.nn.Module"):
        lf.adapted_call(model.state_dict(), adapter, torch.randn(2, 8))
    with pytest.raises(TypeError, match="merge_overlay: base must be a dict"):
        lf.merge_overlay(list(lf.base_params(model).items()), adapter)
    with pytest.raises(TypeError, match="overlay: base must map names"):
        lf.overlay({**lf.base_params(model), "x": 1.0}, adapter)
    with pytest.raises(TypeError, match="adapted_call: base must be a dict"):
        lf.adapted_call(model, adapter, torch.randn(2, 8), base=model)


def test_calibration_that_is_not_an_iterable_of_batches_is_refused():
    model = tiny_model("llama")
    spec = lf.AdapterSpec("eva", targets=["q_proj"], r=2)
    rng = torch.random.get_rng_state()
    for bad in (5, {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, torch.zeros(2, 4, dtype=torch.long)):
        with pytest.raises(TypeError, match="calibration must be an iterable of batches"):
            lf.init_adapter(model, spec, calibration=bad)
    assert torch.equal(rng, torch.random.get_rng_state()), "a refused call drew from the global RNG"


def test_out_of_vocabulary_calibration_ids_are_named():
    model = tiny_model("llama")
    spec = lf.AdapterSpec("eva", targets=["q_proj"], r=2)
    ids = torch.full((2, 8), model.config.vocab_size + 3)
    with pytest.raises(ValueError, match=r"outside \[0, 61\)"):
        lf.init_adapter(model, spec, calibration=[{"input_ids": ids}], generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------- item 9


def test_a_base_from_named_parameters_gives_the_model_no_grad():
    model = Net()
    adapter = lora(model)
    x = torch.randn(2, 8)
    own = dict(model.named_parameters())
    lf.adapted_call(model, adapter, x, base=own).sum().backward()
    assert all(p.grad is None for p in model.parameters()), "the model received gradients"
    expected = torch.autograd.grad(lf.adapted_call(model, adapter, x).sum(), list(adapter.params.values()))
    for (key, p), g in zip(adapter.params.items(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, msg=key)


# ------------------------------------------------------------------------------ item 10a


def test_a_bf16_adapter_merged_on_an_fp32_base_keeps_the_base_exact():
    model = Net()
    adapter = lora(model, dtype=torch.bfloat16, alpha=4.0)
    w = model.proj.weight.detach()
    a, b = adapter.params["proj.lora_A"].detach().float(), adapter.params["proj.lora_B"].detach().float()
    delta = 2.0 * b @ a  # alpha / r = 2, from the bf16 tensors, in fp32
    merged = lf.merged_state_dict(model, adapter)["proj.weight"]
    assert merged.dtype == torch.float32
    # Oracle: the fp32 base plus the delta; peft's merge rounds only the delta to bf16.
    torch.testing.assert_close(merged, w + delta, rtol=0, atol=2**-8 * delta.abs().max().item())
    with torch.no_grad(), lf.adapted(model, adapter):
        assert torch.equal(model.proj.weight, merged)


# ------------------------------------------------------------------------------ item 10b


class MatmulLinear(nn.Linear):
    """A Linear whose forward does not call F.linear: the lazy stand-in falls back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


def test_ia3_lazy_fallback_scales_the_bias():
    model = Net(proj=MatmulLinear(8, 8)).eval()
    adapter = lora(model, variant="ia3")
    x = torch.randn(3, 8)
    # Oracle: IA3 scales the whole output, bias included: l * (W x + b).
    l = adapter.params["proj.ia3_l"].detach()
    w, bias = model.proj.weight.detach(), model.proj.bias.detach()
    expected = model.head(torch.relu(l * (x @ w.T + bias)))
    torch.testing.assert_close(lf.adapted_call(model, adapter, x, merged=True), expected)
    torch.testing.assert_close(lf.adapted_call(model, adapter, x), expected)
