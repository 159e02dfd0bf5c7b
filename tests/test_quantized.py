"""Quantized bases (QLoRA): every scheme x every variant against a float model holding the
dequantized weights (the libraries' own dequantization), on the module-call route that
``adapted_call`` picks for quantized targets; non-target quantized layers included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lora_func as lf
import lora_func.quantized as quantized
from tests.contract_helpers import calibration_batches, perturbed, spec_for
from tests.peft_helpers import ce_loss, copy_into_peft
from tests.quantized_models import SCHEMES, dequantized_weight, float_oracle, quantized_llama, state_bytes
from tests.tolerance import assert_close_to_scale
from tests.variant_table import ROWS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

# The variants that replace the base weight (PiSSA's, OLoRA's and CorDA's residual, LN tuning's trained
# copy) are refused on a quantized base (test below).
VARIANTS = sorted(v for v in ROWS if not lf.get_variant(v).replaces_weight)
ATOL = 1e-5
# torchao's int8 weight-only op scales the int8 product after the matmul, not the weight before:
# ~2e-6 per layer from the dequantized float model, ~7e-6 on the plain model's logits already.
SCHEME_ATOL = {"torchao-int8": 2e-5}


def tokens(batch: int = 2, length: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 61, (batch, length), generator=torch.Generator().manual_seed(seed))


def build(model, variant: str, seed: int = 0) -> lf.Adapter:
    row = ROWS[variant]
    adapter = lf.init_adapter(
        model, spec_for(row, "llama"), generator=torch.Generator().manual_seed(seed + 100),
        calibration=calibration_batches() if row.calibration else None,
    )
    return adapter


def same_values(adapter: lf.Adapter, like: lf.Adapter) -> lf.Adapter:
    return like.with_params({k: v.detach().clone().requires_grad_(True) for k, v in adapter.params.items()})


def loss(model, adapter, ids, merged):
    return ce_loss(lf.adapted_call(model, adapter, ids, merged=merged).logits, ids)


def loss_and_logits(model, adapter, ids, merged):
    logits = lf.adapted_call(model, adapter, ids, merged=merged).logits
    return ce_loss(logits, ids), logits


@pytest.fixture(scope="module", params=sorted(SCHEMES))
def scheme(request):
    model = quantized_llama(request.param)
    return request.param, model, float_oracle(model)


def _scheme_variant_cases():
    """Every variant on one bitsandbytes and one torchao scheme, rotated over the schemes of
    each library; LoRA and DoRA on every scheme. A scheme's own part (its dequantization, the
    quantized op the lazy path calls) is the same code for every variant: the full product (about
    2.5 times as many cases) re-ran each variant's form on three more schemes of the same
    libraries."""
    bnb = sorted(s for s in SCHEMES if s.startswith("bnb"))
    torchao = sorted(s for s in SCHEMES if s.startswith("torchao"))
    assert sorted(bnb + torchao) == sorted(SCHEMES), "a scheme of a third library: give it its own rotation"
    for i, variant in enumerate(VARIANTS):
        schemes = sorted(SCHEMES) if variant in ("lora", "dora") else [bnb[i % len(bnb)], torchao[i % len(torchao)]]
        for scheme in schemes:
            yield pytest.param(scheme, variant, id=f"{scheme}-{variant}")


@pytest.mark.parametrize(("scheme", "variant"), sorted(_scheme_variant_cases(), key=lambda p: p.values[0]), indirect=["scheme"])
def test_logits_and_gradients_equal_the_dequantized_float_model(scheme, variant):
    name, model, oracle = scheme
    before = state_bytes(model)
    adapter = build(model, variant)
    reference = build(oracle, variant)
    # The init reads the (dequantized) weights: both adapters start equal.
    for key in reference.params:
        torch.testing.assert_close(adapter.params[key], reference.params[key], atol=ATOL, rtol=1e-5, msg=key)
    adapter = perturbed(adapter, ROWS[variant].perturb_scale)
    reference = same_values(adapter, reference)
    ids = tokens()
    plain = model(ids).logits
    for merged in (False, True)[: 1 + lf.get_variant(variant).merges]:  # (no merged weight: the lazy path only)
        # The logits come from the forwards the gradients are taken through: the oracle's from
        # the torch.func.grad one (has_aux), the quantized model's from a plain forward and .backward().
        g_want, want = torch.func.grad(lambda p: loss_and_logits(oracle, reference.with_params(p), ids, merged), has_aux=True)(reference.params)
        g_got = torch.func.grad(lambda p: loss(model, adapter.with_params(p), ids, merged))(adapter.params)
        fresh = same_values(adapter, adapter)
        got_loss, got = loss_and_logits(model, fresh, ids, merged)
        got_loss.backward()
        got = got.detach()
        atol = SCHEME_ATOL.get(name, ATOL)
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=f"{name} {variant} merged={merged}")
        assert (got - plain).abs().max() > 1e-2, "the adapter must change the logits"
        for key in g_want:
            if key.rsplit(".", 1)[-1] in ROWS[variant].training_only:
                continue  # acts in training steps only (Row.training_only): no gradient here
            assert g_want[key].abs().max() > 0, key
            torch.testing.assert_close(g_got[key], g_want[key], atol=atol, rtol=1e-4, msg=f"{name} {variant} grad {key}")
            torch.testing.assert_close(fresh.params[key].grad, g_want[key], atol=atol, rtol=1e-4, msg=f"{name} {variant} backward {key}")
    after = state_bytes(model)
    assert sorted(after) == sorted(before)
    for key in before:
        assert torch.equal(after[key], before[key]), f"{name}: {key} changed"


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_three_adamw_steps_train_as_the_float_model(scheme, variant):
    name, model, oracle = scheme
    adapter = perturbed(build(model, variant), ROWS[variant].perturb_scale)
    reference = same_values(adapter, build(oracle, variant))
    adapter = same_values(adapter, adapter)
    # eps well above the gradients' round-off (~1e-6): Adam divides by |g| + eps, so with the
    # default 1e-8 an entry whose gradient is ~0 would move by a sign of round-off.
    opts = [torch.optim.AdamW(a.params.values(), lr=1e-2, eps=1e-3) for a in (adapter, reference)]
    for step in range(3):
        ids = tokens(seed=10 + step)
        for m, a, opt in ((model, adapter, opts[0]), (oracle, reference, opts[1])):
            opt.zero_grad()
            loss(m, a, ids, merged=False).backward()
            opt.step()
    for key in adapter.params:
        torch.testing.assert_close(adapter.params[key], reference.params[key], atol=SCHEME_ATOL.get(name, ATOL), rtol=1e-4, msg=f"{name} {key}")


@pytest.mark.parametrize("scheme_name", ["bnb-nf4", "torchao-nf4"])
def test_checkpointing_on_a_quantized_base_equals_the_run_without(scheme_name):
    model = quantized_llama(scheme_name).train()
    adapter = perturbed(build(model, "dora"), 0.3)
    ids = tokens()
    grads = []
    for on in (False, True):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        a = same_values(adapter, adapter)
        loss(model, a, ids, merged=False).backward()
        grads.append({k: v.grad for k, v in a.params.items()})
    for key in grads[0]:
        assert_close_to_scale(grads[1][key], grads[0][key], msg=key)


@pytest.mark.parametrize("scheme_name", ["bnb-nf4", "torchao-int8"])
def test_bf16_autocast_with_fp32_adapters(scheme_name):
    model = quantized_llama(scheme_name)
    oracle = float_oracle(model)
    adapter = perturbed(build(model, "lora"), 0.3)
    reference = same_values(adapter, build(oracle, "lora"))
    ids = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss(model, adapter, ids, merged=False)
        want = loss(oracle, reference, ids, merged=False)
    got.backward()
    want.backward()
    assert torch.isfinite(got) and abs(got.item() - want.item()) < 2e-2 * abs(want.item())
    for key in adapter.params:
        assert adapter.params[key].dtype == torch.float32 and adapter.params[key].grad.dtype == torch.float32
        g, w = adapter.params[key].grad, reference.params[key].grad
        # bf16 round-off differs between the quantized op and the float one: compare directions.
        assert torch.isfinite(g).all() and F.cosine_similarity(g.flatten(), w.flatten(), dim=0) > 0.98, key


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def test_a_dora_forward_after_an_eval_pass_that_repacked_the_4bit_weight():
    """bitsandbytes repacks a 4-bit weight in place for its AVX512-BF16 CPU kernel on the first
    eval forward under no_grad (block scales become bf16, in another layout; the kernel then
    computes in bf16). lora_func must read the repacked weight as the kernel does: the generic
    dequantization of the repacked bytes is garbage."""
    import bitsandbytes.functional as bf
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    model = quantized_llama("bnb-nf4")
    adapter = perturbed(build(model, "dora"), 0.3)
    ids = tokens()
    before = lf.adapted_call(model, adapter, ids).logits.detach()
    with torch.no_grad():
        model(ids)  # repacks, on a CPU with AVX512-BF16
    for module in model.modules():  # elsewhere: repack as such a CPU would
        weight = getattr(module, "weight", None)
        if type(weight).__name__ == "Params4bit" and not getattr(weight.quant_state, "packing_format_for_cpu", False):
            weight.data, weight.quant_state = _convert_weight_packed_for_cpu(weight.data, weight.quant_state)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.quant_state.packing_format_for_cpu
    # The registry's weight is the one bnb's kernel multiplies by (up to the kernel's bf16).
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    kind = quantized.kind_of_tensor(q_proj.weight)
    with torch.no_grad():
        kernel = kind.call(q_proj)(x)
        assert _relative_error(F.linear(x, kind.dequantize(q_proj), q_proj.bias), kernel) < 1e-2
        garbage = bf.dequantize_4bit(q_proj.weight.data.reshape(-1, 1), q_proj.weight.quant_state)
        assert _relative_error(F.linear(x, garbage.reshape(64, 64).float(), q_proj.bias), kernel) > 0.2
    after = lf.adapted_call(model, adapter, ids).logits.detach()
    assert _relative_error(after, before) < 5e-2  # bf16 block scales and kernel, not garbage
    grads = torch.func.grad(lambda p: loss(model, adapter.with_params(p), ids, False))(adapter.params)
    assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in grads.values())


def test_bnb_int8_matches_peft_lora_and_dora_on_the_same_model():
    """LLM.int8 quantizes the activations too, so the oracle is peft's bitsandbytes layer on the
    same quantized model. Only the first layer's q/v are quantized (and adapted): the int8
    rounding of a later layer's input would turn round-off into 1/127 jumps in either run."""
    import peft

    targets = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    for variant in ("lora", "dora"):
        model = quantized_llama("bnb-int8-first")
        assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Params"
        adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec(variant, targets=targets, r=4, alpha=8)), 0.3)
        ids = tokens()
        ours = lf.adapted_call(model, adapter, ids).logits
        grads = torch.func.grad(lambda p: loss(model, adapter.with_params(p), ids, False))(adapter.params)  # noqa: B023
        pm = peft.get_peft_model(
            quantized_llama("bnb-int8-first"),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, use_dora=variant == "dora"),
        )
        peft_layers = copy_into_peft(pm, adapter)
        assert sorted(peft_layers) == targets
        theirs = pm(ids).logits
        assert (ours - model(ids).logits).abs().max() > 1e-2
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0, msg=variant)
        ce_loss(theirs, ids).backward()
        for key, module in peft_layers.items():
            torch.testing.assert_close(grads[f"{key}.lora_A"], module.lora_A["default"].weight.grad, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(grads[f"{key}.lora_B"], module.lora_B["default"].weight.grad, atol=1e-5, rtol=1e-4)
            if variant == "dora":
                torch.testing.assert_close(
                    grads[f"{key}.lora_magnitude_vector"], module.lora_magnitude_vector["default"].weight.grad, atol=1e-5, rtol=1e-4
                )


def test_pissa_on_a_quantized_base_is_refused_with_peft_practice():
    model = quantized_llama("bnb-nf4")
    with pytest.raises(ValueError, match=r"pissa replaces the base weight.*quantize its residual"):
        lf.init_adapter(model, lf.AdapterSpec("pissa", targets=["q_proj"], r=2))


def test_overlays_refuse_quantized_targets_and_auto_picks_the_module_route():
    model = quantized_llama("torchao-nf4")
    adapter = perturbed(build(model, "lora"), 0.3)
    base = lf.base_params(model)
    for make in (lf.overlay, lf.merge_overlay):
        with pytest.raises(ValueError, match=r"hold quantized weights.*adapted_call"):
            make(base, adapter)
    with pytest.raises(ValueError, match=r"hold quantized weights"):
        lf.adapted_call(model, adapter, tokens(), route="overlay")
    torch.testing.assert_close(lf.adapted_call(model, adapter, tokens()).logits, lf.adapted_call(model, adapter, tokens(), route="module").logits, atol=0, rtol=0)


def test_targets_have_the_layers_sizes_not_the_packed_weights():
    model = quantized_llama("bnb-nf4")
    assert tuple(model.model.layers[0].mlp.down_proj.weight.shape) != (64, 128)  # packed
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["down_proj"], r=4))
    layer = adapter.layers[0]
    assert (layer.target.d_in, layer.target.d_out) == (128, 64)
    assert dequantized_weight(model.model.layers[0].mlp.down_proj).shape == (64, 128)


@pytest.mark.parametrize("scheme_name", ["bnb-nf4", "torchao-int8"])
def test_save_load_both_ways_and_a_dense_merge(scheme_name, tmp_path):
    """An adapter trained on a quantized base reloads exactly there and onto the float model (off
    by the dequantization round-off only); merge names a dense dtype and never rounds the delta."""
    model = quantized_llama(scheme_name)
    oracle = float_oracle(model)
    ids = tokens()
    for variant in ("lora", "dora"):
        adapter = perturbed(build(model, variant), 0.3)
        want = lf.adapted_call(model, adapter, ids).logits
        lf.save(adapter, tmp_path / f"{variant}.safetensors")
        lf.save_peft(adapter, tmp_path / variant)
        for loaded in (lf.load(tmp_path / f"{variant}.safetensors", model=model), lf.load_peft(tmp_path / variant, model)):
            assert torch.equal(lf.adapted_call(model, loaded, ids).logits, want)
        for loaded in (lf.load(tmp_path / f"{variant}.safetensors", model=oracle), lf.load_peft(tmp_path / variant, oracle)):
            torch.testing.assert_close(lf.adapted_call(oracle, loaded, ids).logits, want, atol=SCHEME_ATOL.get(scheme_name, ATOL), rtol=0)
        with pytest.raises(TypeError, match=r"are quantized.*dtype=torch.bfloat16"):
            lf.merged_state_dict(model, adapter)
        merged = lf.merged_state_dict(model, adapter, dtype=torch.float32)
        dense = float_llama_like(oracle)
        dense.load_state_dict(merged)
        torch.testing.assert_close(dense(ids).logits, lf.adapted_call(oracle, same_values(adapter, build(oracle, variant)), ids, merged=True).logits, atol=ATOL, rtol=0)
        assert (dense(ids).logits - oracle(ids).logits).abs().max() > 1e-2  # the delta is in


def float_llama_like(model):
    from tests.quantized_models import float_llama

    fresh = float_llama(seed=1)
    assert sorted(fresh.state_dict()) == sorted(model.state_dict())
    return fresh


def _nf4_in_plain_torch(weight: torch.Tensor, blocksize: int = 64) -> torch.Tensor:
    """NF4 without bitsandbytes' kernels: each block of ``blocksize`` consecutive values (row-major)
    scaled by its absmax, rounded to the nearest NF4 code, scaled back."""
    import bitsandbytes.functional as bf

    code = bf.get_4bit_type("nf4", device="cpu").float()
    blocks = weight.flatten().view(-1, blocksize)
    absmax = blocks.abs().max(-1, keepdim=True).values
    nearest = ((blocks / absmax)[..., None] - code).abs().argmin(-1)
    return (code[nearest] * absmax).view(weight.shape)


@pytest.mark.parametrize("d_in", [128, 48])
def test_bitsandbytes_cpu_4bit_weights_are_nf4_only_for_whole_64_value_blocks(d_in):
    # What a CPU QLoRA run computes with: bitsandbytes' own dequantization, the weight its forward
    # uses too (lora_func.quantized reads it the same way, so every path stays consistent with the
    # plain quantized model). bitsandbytes 0.50.2 gets it wrong when a row is not a whole number
    # of 64-value blocks: at 48 inputs it is 0.37 of scale off NF4. The tiny test models have such
    # widths, so their quantized-base tests check the adapter math on those weights, not NF4.
    # Asserted as it is (docs/testing.md, known gaps): once bitsandbytes fixes it, the 48 case
    # fails and its branch goes.
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    weight = torch.randn(16, d_in, generator=torch.Generator().manual_seed(0))
    packed = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4", compress_statistics=False)._quantize("cpu")
    got = bf.dequantize_4bit(packed.data, packed.quant_state).float()
    want = _nf4_in_plain_torch(weight)
    assert float((want - weight).abs().max()) < 0.2 * float(weight.abs().max())  # the reference is NF4
    off = float((got - want).abs().max()) / float(want.abs().max())
    if d_in % 64 == 0:
        assert off <= 1e-6, off
    else:
        assert off > 0.1, f"bitsandbytes' CPU dequantize_4bit is now NF4 at {d_in} inputs ({off:.1e} off): drop this branch and docs/testing.md's known gap"
