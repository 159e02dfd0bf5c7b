"""One dtype rule for adapter tensors: every trainable tensor is in the adapter dtype
(``spec.dtype``), the one the adapter reports, its file records and both paths compute in.

Before: ``with_params`` took ``.half()`` copies of an fp32 adapter, forward and backward ran
(the merged path promoting, the low-rank path failing deep in a GEMM when A and B differed),
and ``save`` wrote a file that ``load`` refused as "edited or assembled by hand".
"""

from __future__ import annotations

import pytest
import torch

import lora_func as lf
from tests.contract_helpers import calibration_batches, perturbed, spec_for
from tests.models import tiny_model, tokens
from tests.variant_table import ROWS

Q = "model.layers.0.self_attn.q_proj"


def _lora(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, lf.Adapter]:
    model = tiny_model("llama")
    spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2, dtype=dtype)
    return model, perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0)), 0.1)


@pytest.mark.parametrize("cast", ["all-half", "A-half", "B-bf16", "fp64"])
def test_with_params_and_the_constructor_refuse_tensors_of_another_dtype(cast):
    _, adapter = _lora()

    def convert(key: str, value: torch.Tensor) -> torch.Tensor:
        if cast == "all-half" or (cast == "A-half" and key.endswith("lora_A")):
            return value.detach().half()
        if cast == "B-bf16" and key.endswith("lora_B"):
            return value.detach().bfloat16()
        return value.detach().double() if cast == "fp64" else value.detach()

    params = {k: convert(k, v) for k, v in adapter.params.items()}
    with pytest.raises(TypeError, match=r"but the adapter dtype is torch.float32 \(adapter.spec.dtype\)"):
        adapter.with_params(params)
    with pytest.raises(TypeError, match="but the adapter dtype is torch.float32"):
        lf.Adapter(params, adapter.buffers, adapter.spec, adapter.layers)


def test_an_adapter_dict_edited_in_place_is_refused_by_every_path_and_by_save(tmp_path):
    """One rule for both paths (the merged path used to run silently, the lazy one to fail
    deep inside), and save refuses instead of writing a file that does not load."""
    model, adapter = _lora()
    edited = adapter.detach()
    edited.params[f"{Q}.lora_A"] = edited.params[f"{Q}.lora_A"].detach().half()
    for merged in (False, True):
        with pytest.raises(TypeError, match=rf"{Q}.lora_A \(torch.float16, the adapter dtype is torch.float32\)"):
            lf.adapted_call(model, edited, tokens(), merged=merged)
    with pytest.raises(ValueError, match="do not match what it reports"):
        lf.save(edited, tmp_path / "edited.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("variant", sorted(ROWS))
def test_an_adapter_of_any_dtype_saves_to_a_file_that_loads_bit_identically(tmp_path, variant, dtype):
    """A file save wrote always loads: every variant, adapters built in half, bf16 and fp64
    (on an fp32 model), trained values (perturbed), the reported dtype kept."""
    model = tiny_model("llama")
    spec = spec_for(ROWS[variant], "llama", dtype=dtype)
    adapter = lf.init_adapter(
        model, spec, generator=torch.Generator().manual_seed(1), calibration=calibration_batches() if ROWS[variant].calibration else None
    )
    trained = perturbed(adapter, 0.05)
    assert {t.dtype for t in trained.params.values()} == {dtype}
    path = lf.save(trained, tmp_path / "a.safetensors")
    again = lf.load(path, model=model)
    assert again.spec.dtype == dtype
    for key, value in trained.params.items():
        assert again.params[key].dtype == dtype and torch.equal(again.params[key], value.detach()), key
    for key, value in trained.buffers.items():
        assert torch.equal(again.buffers[key], value), key
