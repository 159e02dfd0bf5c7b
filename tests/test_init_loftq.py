"""LoftQ against peft 0.21 (init_lora_weights="loftq", LoftQConfig; replace_lora_weights_loftq) on the
fp32 tiny Llama of tests/quantized_models.py (hidden 64: bitsandbytes' CPU kernels want sizes in
multiples of 32). peft 0.21 computes LoftQ on "cuda" or "xpu" only (the device is a literal in
loftq_init) and quantizes with bitsandbytes; here its loftq_init runs unchanged but for that literal,
on the CPU, where bitsandbytes quantizes with its own torch kernels. lora_func's quantized base,
factors and effective model equal peft's (the quantized base and factors bit for bit); checkpoints
load both ways; on a bitsandbytes NF4 base, LoftQ's factors are peft's replace_lora_weights_loftq."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from peft import LoftQConfig, LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import layer as peft_lora_layer
from peft.utils import loftq_utils

import lora_func as lf
from lora_func.variants.loftq import nf4_roundtrip
from tests.quantized_models import _saved_float, float_llama, float_oracle, quantized_llama

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
TARGETS = ["q_proj", "down_proj"]  # 64 -> 64, 128 -> 64
R, ALPHA = 4, 4.0  # s = 1, LoftQ's setting


def _on_cpu(function):
    """peft's function with its compute device "cpu" instead of the "cuda"/"xpu" literal."""
    source = inspect.getsource(function).replace('compute_device = "xpu" if is_xpu_available() else "cuda"', 'compute_device = "cpu"')
    assert 'compute_device = "cpu"' in source
    namespace = dict(vars(loftq_utils))
    exec(compile(source, loftq_utils.__file__, "exec"), namespace)
    return namespace[function.__name__]


@pytest.fixture(scope="module")
def model():
    return float_llama(0)


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _layers(pm) -> dict:
    return {n.removeprefix("base_model.model."): m for n, m in pm.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def _peft(model, monkeypatch, bits, iters):
    monkeypatch.setattr(peft_lora_layer, "loftq_init", _on_cpu(loftq_utils.loftq_init))
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights="loftq", loftq_config=LoftQConfig(loftq_bits=bits, loftq_iter=iters))
    return get_peft_model(copy.deepcopy(model), config).eval()


@pytest.mark.parametrize(("bits", "iters"), [(4, 1), (4, 3), (8, 2)])
def test_adapter_and_effective_model_equal_peft(model, monkeypatch, tmp_path, bits, iters):
    pm = _peft(model, monkeypatch, bits, iters)
    adapter = lf.init_adapter(model, lf.AdapterSpec("loftq", targets=TARGETS, r=R, alpha=ALPHA, loftq_bits=bits, loftq_iter=iters))
    for name, layer in _layers(pm).items():
        assert torch.equal(adapter.buffers[f"{name}.W_res"], layer.base_layer.weight), name  # peft's replaced base
        assert torch.equal(adapter.params[f"{name}.lora_A"], layer.lora_A["default"].weight), name
        assert torch.equal(adapter.params[f"{name}.lora_B"], layer.lora_B["default"].weight), name
        assert not torch.equal(model.get_submodule(name).weight, layer.base_layer.weight)  # lora_func's base untouched
    ids = torch.randint(3, 61, (2, 8), generator=torch.Generator().manual_seed(1))
    want = pm(ids).logits
    assert _rel(lf.adapted_call(model, adapter, ids).logits, want) <= 1e-6
    # merged: W_res + s·B A rounded once more in fp32 (1.7e-6 measured), as for OLoRA.
    assert _rel(lf.adapted_call(model, adapter, ids, merged=True).logits, want) <= 5e-6
    # LoftQ corrects the quantization: closer to the float model than the quantized base alone.
    plain = model(ids).logits
    quantized_only = lf.adapted_call(model, adapter.with_params({k: torch.zeros_like(v) for k, v in adapter.params.items()}), ids).logits
    assert (want - plain).abs().max() < (quantized_only - plain).abs().max()
    # Checkpoints both ways: peft's loads with load_peft (the quantized base recomputed from the
    # untouched base, as peft does on load); save_peft's loads in peft onto the untouched base.
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in _layers(pm).values():
            layer.lora_B["default"].weight.add_(0.05 * torch.randn(layer.lora_B["default"].weight.shape, generator=g))
    pm.save_pretrained(tmp_path / "peft")
    back = lf.load_peft(tmp_path / "peft", model)
    assert back.spec.variant == "loftq" and dict(back.spec.options)["loftq_iter"] == iters
    want = pm(ids).logits
    assert _rel(lf.adapted_call(model, back, ids).logits, want) <= 1e-6
    lf.save_peft(back, tmp_path / "ours")
    again = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "ours").eval()
    assert _rel(again(ids).logits, want) <= 1e-6


def test_on_a_bitsandbytes_nf4_base_the_factors_are_replace_lora_weights_loftq(model, monkeypatch):
    """A model loaded in NF4 holds nf4(W): LoftQ's one-round base bit for bit. peft's
    replace_lora_weights_loftq sets a quantized model's LoRA factors from the float weights on disk;
    lora_func's LoftQ factors (built on the float model) as a plain LoRA on the quantized model are
    the same factors and the same model."""
    from peft.tuners.lora.bnb import Linear4bit

    monkeypatch.setattr(loftq_utils, "_loftq_init_new", _on_cpu(loftq_utils._loftq_init_new))
    qmodel = quantized_llama("bnb-nf4")
    pm = get_peft_model(qmodel, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS)).eval()
    loftq_utils.replace_lora_weights_loftq(pm, model_path=_saved_float(0))
    adapter = lf.init_adapter(model, lf.AdapterSpec("loftq", targets=TARGETS, r=R, alpha=ALPHA))
    layers = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules() if isinstance(m, Linear4bit)}
    assert sorted(layers) == sorted(layer.target.module for layer in adapter.layers)
    qbase = quantized_llama("bnb-nf4")
    on_quantized = lf.init_adapter(qbase, lf.AdapterSpec("lora", targets=TARGETS, r=R, alpha=ALPHA)).with_params(adapter.params)
    import bitsandbytes.functional as bf

    for name, layer in layers.items():
        weight = layer.base_layer.weight
        assert torch.equal(adapter.buffers[f"{name}.W_res"], bf.dequantize_4bit(weight.data, weight.quant_state)), name
        assert _rel(adapter.params[f"{name}.lora_A"], layer.lora_A["default"].weight) <= 1e-6, name
        assert _rel(adapter.params[f"{name}.lora_B"], layer.lora_B["default"].weight) <= 1e-6, name
    # The quantized model with these factors is Q + s·B A: the float model holding the dequantized
    # weights, adapted alike (peft's own forward on bitsandbytes' CPU 4-bit layers is no oracle here:
    # with its adapters disabled it differs from the plain quantized model by 9e-2 in this setup).
    ids = torch.randint(3, 61, (2, 8), generator=torch.Generator().manual_seed(1))
    oracle = float_oracle(qbase)
    want = lf.adapted_call(oracle, lf.init_adapter(oracle, on_quantized.spec).with_params(adapter.params), ids).logits
    assert _rel(lf.adapted_call(qbase, on_quantized, ids).logits, want) <= 1e-5  # bitsandbytes' CPU matmul: 2.6e-6 on the plain model


def test_nf4_is_the_blockwise_definition_on_any_shape():
    """bitsandbytes' reference kernels (quantize, then its torch dequantization) on shapes whose
    blocks straddle rows and end short."""
    import bitsandbytes as bnb
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.functional import get_4bit_type

    for shape in [(32, 48), (33, 7), (64, 64)]:
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        q = bnb.nn.Params4bit(w.clone(), requires_grad=False, compress_statistics=False, quant_type="nf4").to("cpu")
        ref = _dequantize_4bit_compute(q.data.reshape(-1), q.quant_state.absmax, get_4bit_type("nf4", device="cpu"), 64, shape, torch.float32)
        assert torch.equal(nf4_roundtrip(w), ref), shape


def test_init_in_other_dtypes_and_on_zero_blocks():
    """peft's loftq_init computes in fp32 whatever the base dtype and casts the quantized base back
    to it: on a float64 weight the init is the one on its float32 value (the fp32 SVD's factors, Q
    widened exactly); on a bf16 weight ``W_res`` is Q rounded to bf16 (held in the fp32 adapter's
    dtype); a float64 adapter holds the float32 init's numbers. Blocks and a tail of zeros or of
    tiny (subnormal) values quantize as bitsandbytes' kernels do (its absmax floor of 1e-38)."""
    import bitsandbytes as bnb
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.functional import get_4bit_type

    from lora_func.variants import get_variant
    from tests.variant_checks import layer_info

    loftq = get_variant("loftq")
    w32 = torch.randn(12, 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()  # bf16 values
    for bits, iters in ((4, 2), (8, 1)):
        info = layer_info("loftq", 3, 20, 12, alpha=ALPHA, loftq_bits=bits, loftq_iter=iters)

        def init(weight, dtype, info=info):
            return loftq.init(weight, None, info, dtype=dtype, generator=torch.Generator().manual_seed(1))

        (p32, b32), (p64, b64), (pw, bw), (p16, b16) = init(w32, torch.float32), init(w32, torch.float64), init(w32.double(), torch.float64), init(w32.bfloat16(), torch.float32)
        for name in ("lora_A", "lora_B"):
            assert p64[name].dtype == pw[name].dtype == torch.float64 and torch.equal(p64[name], p32[name].double()), (bits, name)
            assert torch.equal(pw[name], p64[name]) and torch.equal(p16[name], p32[name]), (bits, name)
        assert torch.equal(b64["W_res"], b32["W_res"].double()) and torch.equal(bw["W_res"], b64["W_res"]), bits
        assert b16["W_res"].dtype == torch.float32 and torch.equal(b16["W_res"], b32["W_res"].bfloat16().float()), bits
        assert not torch.equal(b16["W_res"], b32["W_res"]), bits  # the rounding is seen
    for scale in (0.0, 1e-40, 5e-39):  # zero, subnormal, and an absmax between the 1e-38 floor and twice it
        w = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
        w.view(-1)[:64] *= scale  # the first block
        w.view(-1)[128:] *= scale  # the short last block
        q = bnb.nn.Params4bit(w.clone(), requires_grad=False, compress_statistics=False, quant_type="nf4").to("cpu")
        ref = _dequantize_4bit_compute(q.data.reshape(-1), q.quant_state.absmax, get_4bit_type("nf4", device="cpu"), 64, w.shape, torch.float32)
        assert torch.equal(nf4_roundtrip(w), ref), scale
