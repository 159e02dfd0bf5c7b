"""The target kinds beyond Linear / Conv1D against HF peft 0.21: LoRA on ``nn.Embedding``
(``embed_tokens``), on ``nn.Conv2d`` / ``nn.Conv1d``, on 3-D MoE expert parameters (tiny
Mixtral, ``target_parameters``; eager expert loop and grouped_mm) and LN tuning (Llama's
RMSNorm, GPT-2's LayerNorm with bias, a GPT-2 Conv1D).

Each case: peft's trainable tensors perturbed at random and saved by peft; ``load_peft`` of
that checkpoint gives peft's logits and every tensor's gradient (float64, relative 1e-9; the
Mixtral cases fp32, relative 2e-5); and the ``save_peft`` of a lora_func adapter (perturbed on
the lora_func side) loads in peft with lora_func's logits.
"""

from __future__ import annotations

import re
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
import peft
from peft import BOFTConfig, LNTuningConfig, LoHaConfig, LoKrConfig, LoraConfig, PeftModel, TinyLoraConfig, get_peft_model
from torch import nn
from torch.func import grad
from transformers import MixtralConfig, MixtralForCausalLM

import lora_func as lf
from lora_func.adapter import leaves
from tests.models import tiny_model, tokens
from tests.peft_helpers import ce_loss

R, ALPHA = 4, 6.0


def _rmsnorm_in_input_dtype(model: nn.Module) -> None:
    """transformers' RMSNorm computes in fp32; in float64 oracle tests it computes in the input
    dtype, on both sides (peft's LN tuning copies the patched module)."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(forward, m)


def _llama64(seed: int = 0) -> nn.Module:
    model = tiny_model("llama", seed=seed, dtype=torch.float64)
    _rmsnorm_in_input_dtype(model)
    return model


class ConvNet(nn.Module):
    """A Conv2d (stride, padding), a Conv2d with a non-square kernel, a Conv1d and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(8, 6, (3, 2), padding=1)
        self.seq = nn.Conv1d(6, 5, 3)
        self.head = nn.Linear(5 * 18, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.head(F.relu(self.seq(h.flatten(2))).flatten(1))


def _convnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ConvNet().to(torch.float64).eval()


class PointConvNet(ConvNet):
    """:class:`ConvNet` with a 1x1 Conv2d after ``conv2`` (peft's LyCORIS forms treat it as a Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.point = nn.Conv2d(6, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.point(F.relu(self.conv2(F.relu(self.conv1(x))))))
        return self.head(F.relu(self.seq(h.flatten(2))).flatten(1))


def _pointconvnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return PointConvNet().to(torch.float64).eval()


class TwoTapConvNet(PointConvNet):
    """:class:`PointConvNet` whose Conv1d has a kernel of two taps: the smallest kernel on which
    ``use_effective_conv2d`` takes the CP form."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Conv1d(6, 5, 2)
        self.head = nn.Linear(5 * 19, 7)


def _twotapconvnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TwoTapConvNet().to(torch.float64).eval()


_LYC_CONVS = ["conv1", "conv2", "point", "seq"]


class MLP(nn.Module):
    """``out(relu(lin2(relu(lin1(x)))))``: a square Linear, a narrow one (8 outputs) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(16, 16)
        self.lin2 = nn.Linear(16, 8)
        self.out = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.lin2(F.relu(self.lin1(x)))))


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MLP().to(torch.float64).eval()


def _mlp_input():
    return torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _square_mean(out, x):
    return out.square().mean()


class ConvZoo(nn.Module):
    """Every conv peft adapts somewhere: ``nn.Conv2d`` / ``Conv3d`` / ``Conv1d`` (kernel 3, padding 1),
    each also with ``groups > 1``, then a Linear head; input ``(B, 4, 6, 6)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.grp2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.conv3 = nn.Conv3d(2, 2, 3, padding=1)
        self.grp3 = nn.Conv3d(2, 2, (1, 3, 3), padding=(0, 1, 1), groups=2)
        self.conv1 = nn.Conv1d(8, 8, 3, padding=1)
        self.grp1 = nn.Conv1d(8, 8, 3, padding=1, groups=4)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.grp2(torch.tanh(self.conv2(x))))
        b = h.shape[0]
        v = torch.tanh(self.grp3(torch.tanh(self.conv3(h.reshape(b, 2, 4, 6, 6)))))
        s = torch.tanh(self.grp1(torch.tanh(self.conv1(v.reshape(b, 8, 36)))))
        return self.head(s.mean(-1))


def _zoo(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = ConvZoo().to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # weights large enough that every layer moves the output
    return model


def _zoo_input():
    return torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


_PLAIN_CONVS = ["conv2", "conv3", "conv1"]


def _mixtral(implementation: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.2, experts_implementation=implementation,
    )
    model = MixtralForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model.eval()


def _peft(model: nn.Module, config) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft 0.21 reads transformers 5's is_gradient_checkpointing
        # peft's LN tuning warns "Unsupported layer type" for every norm class it does not list
        warnings.filterwarnings("ignore", "Unsupported layer type", UserWarning)
        out = get_peft_model(model, config)
    return out.eval()


def _trained(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """peft's trainable parameters, sorted by name (AdaLoRA's ``ranknum``, a constant peft leaves
    requiring grad and does not save, left out)."""
    return [(n, p) for n, p in sorted(model.named_parameters()) if p.requires_grad and ".ranknum." not in n]


def _perturb(model: nn.Module, seed: int = 5, scale: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in _trained(model):
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _save_pretrained(model: nn.Module, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Setting save_embedding_layers to True ..."
        model.save_pretrained(path)


def _from_pretrained(base: nn.Module, path) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # save_peft writes no peft_version: peft's OFT then warns its Cayley-Neumann form changed in 0.18
        warnings.filterwarnings("ignore", "The cayley-neumann parameterization has been slightly changed", UserWarning)
        warnings.filterwarnings("ignore", "Unsupported layer type", UserWarning)
        return PeftModel.from_pretrained(base, path).eval()


# (model builder, peft config, inputs, loss(output, inputs), relative tolerance)
def _lm_loss(out, ids):
    return ce_loss(out.logits, ids)


def _conv_input():
    return torch.randn(2, 3, 8, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _tokens_with_padding():
    """Token ids with the padding id (0, the embedding's padding_idx) in them: its row of the
    embedding's lora_A must get no gradient, as in peft."""
    ids = tokens()
    ids[0, :2] = 0
    return ids


CASES = {
    "embedding": (_llama64, lambda: LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["embed_tokens", "q_proj"]), _tokens_with_padding, _lm_loss, 1e-9),
    "conv": (_convnet, lambda: LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["conv1", "conv2", "seq"]), _conv_input, lambda out, x: out.square().mean(), 1e-9),
    # LoHa / LoKr on conv kernels: the flattened forms (1x1 included); the CP forms of
    # use_effective_conv2d (1x1 falls back, Conv1d's (r, r, k, 1) core); LoKr's whole W2 (peft's
    # odd layout on the Conv1d), factored W2 (conv1 at r=1), decompose_both with decompose_factor.
    "loha-conv": (_pointconvnet, lambda: LoHaConfig(r=R, alpha=ALPHA, target_modules=_LYC_CONVS), _conv_input, lambda out, x: out.square().mean(), 1e-9),
    "loha-conv-cp": (
        _pointconvnet, lambda: LoHaConfig(r=2, alpha=ALPHA, target_modules=_LYC_CONVS, use_effective_conv2d=True),
        _conv_input, lambda out, x: out.square().mean(), 1e-9,
    ),
    "lokr-conv": (
        _pointconvnet, lambda: LoKrConfig(r=R, alpha=ALPHA, target_modules=_LYC_CONVS, rank_pattern={"conv1": 1}),
        _conv_input, lambda out, x: out.square().mean(), 1e-9,
    ),
    "lokr-conv-cp": (
        _pointconvnet,
        lambda: LoKrConfig(r=1, alpha=ALPHA, target_modules=_LYC_CONVS, use_effective_conv2d=True, decompose_both=True, decompose_factor=4),
        _conv_input, lambda out, x: out.square().mean(), 1e-9,
    ),
    # the CP forms on a two-tap Conv1d kernel
    "loha-conv-cp-two-taps": (
        _twotapconvnet, lambda: LoHaConfig(r=2, alpha=ALPHA, target_modules=_LYC_CONVS, use_effective_conv2d=True),
        _conv_input, lambda out, x: out.square().mean(), 1e-9,
    ),
    "lokr-conv-cp-two-taps": (
        _twotapconvnet,
        lambda: LoKrConfig(r=1, alpha=ALPHA, target_modules=_LYC_CONVS, use_effective_conv2d=True, decompose_both=True, decompose_factor=4),
        _conv_input, lambda out, x: out.square().mean(), 1e-9,
    ),
    "experts-eager": (
        lambda seed=0: _mixtral("eager", seed),
        lambda: LoraConfig(r=R, lora_alpha=ALPHA, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        tokens, _lm_loss, 2e-5,
    ),
    "experts-grouped_mm": (
        lambda seed=0: _mixtral("grouped_mm", seed),
        lambda: LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj"], target_parameters=["1.mlp.experts.down_proj"]),
        tokens, _lm_loss, 2e-5,
    ),
    # peft without its CUDA extension (every CPU) builds one butterfly factor whatever the config
    # says: loaded with the others at the identity
    "boft-one-of-two-factors": (
        _mlp, lambda: BOFTConfig(target_modules=["lin1", "lin2"], boft_block_size=4, boft_n_butterfly_factor=2), _mlp_input, _square_mean, 1e-9,
    ),
    # peft lowers r to a layer's min(d_in, d_out) (lin2: 8), the config keeps r = 12
    "tinylora-rank-above-a-layer": (
        _mlp, lambda: TinyLoraConfig(target_modules=["lin1", "lin2"], r=12, u=3), _mlp_input, _square_mean, 1e-9,
    ),
    # the layer kinds peft adapts for each method, with and without groups where peft has them
    "dora-conv": (_zoo, lambda: LoraConfig(r=R, lora_alpha=ALPHA, use_dora=True, target_modules=_PLAIN_CONVS), _zoo_input, _square_mean, 1e-9),
    "dora-embedding": (
        _llama64, lambda: LoraConfig(r=R, lora_alpha=ALPHA, use_dora=True, target_modules=["embed_tokens", "q_proj"]), _tokens_with_padding, _lm_loss, 1e-9,
    ),
    "hira-conv": (_zoo, lambda: peft.HiraConfig(r=R, target_modules=_PLAIN_CONVS), _zoo_input, _square_mean, 1e-9),
    "ia3-conv": (
        _zoo, lambda: peft.IA3Config(target_modules=["conv2", "grp2", "conv3", "grp3"], feedforward_modules=["conv3"]),
        _zoo_input, _square_mean, 1e-9,
    ),
    # peft's OFT conv forward is not its merge (below): the oracle is its merged kernel
    "oft-conv": (_zoo, lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=["conv2"]), _zoo_input, _square_mean, 1e-9),
    "hra-conv": (_zoo, lambda: peft.HRAConfig(r=2, target_modules=["conv2"]), _zoo_input, _square_mean, 1e-9),
    "boft-conv": (_zoo, lambda: BOFTConfig(boft_block_size=4, target_modules=["conv2"]), _zoo_input, _square_mean, 1e-9),
    "adalora-conv": (
        _zoo, lambda: peft.AdaLoraConfig(init_r=R, target_r=2, total_step=10, target_modules=["conv2"]), _zoo_input, _square_mean, 1e-9,
    ),
    "loha-grouped-conv": (_zoo, lambda: LoHaConfig(r=2, alpha=ALPHA, target_modules=["grp2", "grp1"]), _zoo_input, _square_mean, 1e-9),
    "lokr-grouped-conv": (_zoo, lambda: LoKrConfig(r=2, alpha=ALPHA, target_modules=["grp2", "grp1"]), _zoo_input, _square_mean, 1e-9),
    "tinylora-embedding": (
        _llama64, lambda: TinyLoraConfig(r=R, u=3, target_modules=["embed_tokens", "q_proj"]), _tokens_with_padding, _lm_loss, 1e-9,
    ),
    # peft's ParamWrapper on a 2-D parameter a module uses itself (num_experts 1: a Linear's math)
    "lora-2d-parameter": (
        lambda seed=0: tiny_model("parameters", seed=seed, dtype=torch.float64),
        lambda: LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["head"], target_parameters=["hold.w"]), tokens, _lm_loss, 1e-9,
    ),
    # peft's MultiheadAttention: in_proj and out_proj merged for each call (the out_proj's update
    # twice, see docs/variants.md); the gradients below
    "lora-mha": (
        lambda seed=0: tiny_model("attention", seed=seed, dtype=torch.float64),
        lambda: LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["attn", "head"]), tokens, _lm_loss, 1e-9,
    ),
    # peft's selection and pattern options together: rank_pattern / alpha_pattern as regexes,
    # layers_to_transform + layers_pattern, exclude_modules (the loaded layers are the file's)
    "lora-patterns-and-selection": (
        _llama64,
        lambda: LoraConfig(
            r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[0, 1], layers_pattern="layers",
            exclude_modules=["model.layers.1.self_attn.v_proj"], rank_pattern={r"layers\.0\..*_proj": 2}, alpha_pattern={r".*down_proj": 3.0},
        ),
        tokens, _lm_loss, 1e-9,
    ),
    "ln_tuning-rmsnorm": (_llama64, lambda: LNTuningConfig(target_modules=["input_layernorm", "norm"]), tokens, _lm_loss, 1e-9),
    "ln_tuning-layernorm": (
        lambda seed=0: tiny_model("gpt2", seed=seed, dtype=torch.float64),
        lambda: LNTuningConfig(target_modules=["ln_1", "ln_f"]), tokens, _lm_loss, 1e-9,
    ),
    # peft's LN tuning copies any layer: a GPT-2 Conv1D's copy holds its (d_in, d_out) weight
    "ln_tuning-conv1d": (
        lambda seed=0: tiny_model("gpt2", seed=seed, dtype=torch.float64),
        lambda: LNTuningConfig(target_modules=["c_fc"]), tokens, _lm_loss, 1e-9,
    ),
}


def _peft_grads(peft_model, inputs, loss) -> dict[str, torch.Tensor]:
    peft_model.zero_grad()
    loss(peft_model(inputs), inputs).backward()
    return {n: p.grad.detach().clone() for n, p in _trained(peft_model)}


def _as_peft(adapter: lf.Adapter, tensors: dict[str, torch.Tensor], tmp_path) -> dict[str, torch.Tensor]:
    """lora_func tensors (gradients) under peft's keys and shapes, by save_peft's own mapping
    checked independently: every key/shape pair must be peft's."""
    from safetensors.torch import load_file

    lf.save_peft(adapter.with_params({k: v.detach() for k, v in tensors.items()}), tmp_path)
    return load_file(str(tmp_path / "adapter_model.safetensors"))


def _peft_key(name: str) -> str:
    """peft's parameter name -> its key in the checkpoint (no adapter name; a tensor held once
    for every layer, TinyLoRA's vectors, under ``base_model.``)."""
    key = re.sub(r"^base_model\.model\..*\.tinylora_v\.", "base_model.tinylora_v.", name.replace(".default", ""))
    return key.removesuffix(".weight") if key.endswith("lora_magnitude_vector.weight") else key


class _BlockDiag:
    """Stands in for peft's CUDA ``FastBlockDiag`` (``(m, k, b, b) -> (m, k·b, k·b)``): peft's BOFT
    with its extension, on the CPU."""

    @staticmethod
    def apply(blocks):
        return torch.stack([torch.block_diag(*factor) for factor in blocks])


def _make_kron_mended(w1, w2, scale=1.0):
    """peft's LoKr ``make_kron`` on copies in plain strides: on a Conv1d's CP form peft's own
    crashes in 0.21.2 (its einsum gives the ``(k, n, ks, 1)`` W2 a size-1 axis of stride
    ``k·n·ks``, which ``torch.kron`` cannot view)."""
    if len(w2.shape) == 4:
        w1 = w1.unsqueeze(2).unsqueeze(2)
    return torch.kron(w1.clone(memory_format=torch.contiguous_format), w2.clone(memory_format=torch.contiguous_format)) * scale


def _oft_conv_merged(self, x, *args, **kwargs):
    """peft's OFT ``Conv2d`` as its merge computes it (``merge``: ``W ← (R W_flatᵀ)ᵀ``), under autograd.
    peft 0.21.2's own forward rotates unfolded patches of the input (stride 1, no padding) and folds
    them back, summing the overlaps: not the identity even at ``R = I`` (checked in the fixture),
    and not its merge."""
    base = self.get_base_layer()
    rotation = self.oft_R["default"].get_weight()
    flat = base.weight.reshape(base.weight.shape[0], -1)
    merged = (rotation @ flat.T.to(rotation.dtype)).T.reshape(base.weight.shape).to(x.dtype)
    return F.conv2d(x, merged, base.bias, base.stride, base.padding, base.dilation, base.groups)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    build, config, inputs, loss, rtol = CASES[request.param]
    mend = pytest.MonkeyPatch()
    if request.param.startswith("boft"):
        import peft.tuners.boft.layer as boft_layer

        mend.setattr(boft_layer, "_FBD_CUDA", False)  # peft without its CUDA extension (every CPU)
    if request.param.startswith("lokr-conv-cp"):
        import peft.tuners.lokr.layer as lokr_layer

        mend.setattr(lokr_layer, "make_kron", _make_kron_mended)
    peft_model = _peft(build(), config())
    if request.param == "oft-conv":
        import peft.tuners.oft.layer as oft_layer

        x = inputs()
        own_at_init = peft_model(x)
        assert (own_at_init - build()(x)).abs().max() > 1e-2, "peft's OFT conv forward is the identity at init: use it as the oracle"
        mend.setattr(oft_layer.Conv2d, "forward", _oft_conv_merged)
        torch.testing.assert_close(peft_model(x), build()(x), rtol=1e-12, atol=1e-12)  # the merge is
    _perturb(peft_model)
    path = tmp_path_factory.mktemp(request.param)
    _save_pretrained(peft_model, path)
    lf_model = build()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "a BOFT checkpoint with boft_n_butterfly_factor", UserWarning)
        adapter = lf.load_peft(path, lf_model)
    yield types.SimpleNamespace(name=request.param, peft=peft_model, model=lf_model, adapter=adapter, x=inputs(), loss=loss, rtol=rtol, build=build)
    mend.undo()


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    got, want = got.detach(), want.detach()
    scale = want.abs().max().clamp_min(1e-30)
    assert (got - want).abs().max() <= rtol * scale, f"{what}: off by {float((got - want).abs().max() / scale):.2e} relative"


def test_load_peft_gives_peft_outputs_on_every_route(case):
    want = case.peft(case.x)
    want = want.logits if hasattr(want, "logits") else want
    base = case.model(case.x)
    base = base.logits if hasattr(base, "logits") else base
    assert (want - base).abs().max() > 1e-3 * base.abs().max(), "the perturbed adapter must change the output"
    for route in ("overlay", "module"):
        for merged in (False, True):
            out = lf.adapted_call(case.model, case.adapter, case.x, route=route, merged=merged)
            _close(out.logits if hasattr(out, "logits") else out, want.detach(), case.rtol, f"{route} merged={merged}")


def _make_weight_cp_by_autograd(t1, w1a, w1b, t2, w2a, w2b, scale):
    """peft's LoHa ``make_weight_cp`` forward, differentiated by autograd: peft 0.21's
    ``HadaWeightCP.backward`` swaps the two Hadamard factors in the ``hada_w1_a`` / ``hada_w2_a``
    gradients (each uses the other factor's ``t·w_b``)."""
    rebuild1 = torch.einsum("i j k l, j r, i p -> p r k l", t1, w1b, w1a)
    return rebuild1 * torch.einsum("i j k l, j r, i p -> p r k l", t2, w2b, w2a) * scale


def _check_by_finite_differences(case, key: str, ours: torch.Tensor) -> None:
    """The directional derivative of peft's forward loss along a random direction of tensor ``key``
    (central differences) equals ``ours`` along it (relative 1e-6)."""
    param = dict(case.peft.named_parameters())[key.replace(".weight", ".default.weight")]
    direction = torch.randn(param.shape, generator=torch.Generator().manual_seed(11), dtype=param.dtype)
    eps = 1e-5

    def at(step: float) -> float:
        with torch.no_grad():
            param.add_(step * direction)
            try:
                return float(case.loss(case.peft(case.x), case.x))
            finally:
                param.sub_(step * direction)

    numeric = (at(eps) - at(-eps)) / (2 * eps)
    analytic = float((ours * direction).sum())
    assert abs(numeric - analytic) <= 1e-6 * abs(analytic), (key, numeric, analytic)


def test_load_peft_gives_peft_gradients_per_tensor(case, tmp_path, monkeypatch):
    want = _peft_grads(case.peft, case.x, case.loss)
    if case.name.startswith("loha-conv-cp"):
        import peft.tuners.loha.layer as loha_layer

        peft_own = want
        monkeypatch.setattr(loha_layer, "make_weight_cp", _make_weight_cp_by_autograd)
        want = _peft_grads(case.peft, case.x, case.loss)
        off = {k: float((peft_own[k] - want[k]).abs().max() / want[k].abs().max()) for k in want}
        # peft's own backward is wrong exactly for the CP layers' hada_w*_a (the others agree)
        assert {k for k, v in off.items() if v > 0.1} == {k for k in want if "_a." in k and k.split(".")[2] != "point"}, off
        assert all(v < case.rtol for k, v in off.items() if "_a." not in k or k.split(".")[2] == "point"), off

    def loss(params):
        return case.loss(lf.adapted_call(case.model, case.adapter.with_params(params), case.x), case.x)

    got = grad(loss)(dict(case.adapter.params))
    as_peft = _as_peft(case.adapter, got, tmp_path)
    want = {_peft_key(k): v for k, v in want.items()}
    # save_peft writes the buffers too (TinyLoRA's frozen factors): every other key is a gradient
    frozen = {slot.peft_key("") for _, leaf in leaves(case.adapter) for slot in leaf.variant.tensors.values() if slot.buffer}
    assert sorted(k for k in as_peft if k.rsplit(".", 1)[-1] not in frozen) == sorted(want)
    for key, g in want.items():
        assert g.abs().max() > 0, f"peft's {key} gets no gradient: the case cannot tell"
        ours = as_peft[key].to(g.dtype)
        if case.name.startswith("boft-one-of") and key.endswith("boft_R"):
            # peft's one factor is our first; the factors added at the identity train too
            assert ours.shape[0] == 2 and g.shape[0] == 1 and ours[1:].abs().max() > 0, key
            ours = ours[:1]
        if case.name == "lora-mha" and ".out_proj." in key:
            # peft's merge adds the out_proj's update twice, once out of the graph (an in-place
            # `.data +=`): its gradient is half its forward's; the forward's, by finite differences, is ours
            _close(ours, 2 * g, case.rtol, key)
            _check_by_finite_differences(case, key, ours)
            continue
        _close(ours, g, case.rtol, key)
        if "lora_embedding_A" in key:  # the padding id's column: no gradient, as peft's
            assert torch.count_nonzero(as_peft[key][:, 0]) == 0 and torch.count_nonzero(g[:, 0]) == 0
    # Every route gives the same gradients: lazy (the embedding's gather) and merged, overlay and
    # module. On ids without the padding id: a lookup in the merged table with padding_idx stops
    # the padding rows' gradient to lora_B too, where peft's (and the lazy) form only stops lora_A's.
    x = tokens() if "embedding" in case.name else case.x

    def routed(params, route="overlay", merged=False):
        return case.loss(lf.adapted_call(case.model, case.adapter.with_params(params), x, route=route, merged=merged), x)

    reference = grad(routed)(dict(case.adapter.params))
    for route in ("overlay", "module"):
        for merged in (False, True):
            other = grad(routed)(dict(case.adapter.params), route, merged)
            for key, g in reference.items():
                _close(other[key], g, case.rtol, f"{route} merged={merged} {key}")


def test_save_peft_loads_in_peft_with_the_same_outputs(case, tmp_path):
    g = torch.Generator().manual_seed(9)
    adapter = case.adapter.with_params(
        {k: (v.detach() + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)) for k, v in case.adapter.params.items()}
    )
    lf.save_peft(adapter, tmp_path, model=case.model)
    with pytest.MonkeyPatch.context() as mend:
        if case.name.startswith("boft-one-of"):
            import peft.tuners.boft.layer as boft_layer

            # every factor asked for: peft without its extension builds one and refuses the file,
            # peft with it (emulated on the CPU) loads it
            with pytest.raises(RuntimeError, match=r"size mismatch for base_model\.model\.lin1\.boft_R"):
                _from_pretrained(case.build(), tmp_path)
            mend.setattr(boft_layer, "_FBD_CUDA", object())
            mend.setattr(boft_layer, "FastBlockDiag", _BlockDiag)
        got = _from_pretrained(case.build(), tmp_path)(case.x)
    want = lf.adapted_call(case.model, adapter, case.x)
    _close(got.logits if hasattr(got, "logits") else got, want.logits if hasattr(want, "logits") else want, case.rtol, "peft on save_peft")
    again = lf.load_peft(tmp_path, case.build())
    for key, tensor in adapter.params.items():
        assert torch.equal(again.params[key], tensor.to(again.params[key].dtype)), key


@pytest.mark.parametrize(
    ("variant", "config"),
    [
        ("loha", lambda: LoHaConfig(r=2, alpha=ALPHA, target_modules=_LYC_CONVS, use_effective_conv2d=True, init_weights=False)),
        ("loha", lambda: LoHaConfig(r=2, alpha=ALPHA, target_modules=_LYC_CONVS, use_effective_conv2d=True)),
        ("lokr", lambda: LoKrConfig(r=1, alpha=ALPHA, target_modules=_LYC_CONVS, use_effective_conv2d=True, decompose_both=True, decompose_factor=4, init_weights=False)),
        ("lokr", lambda: LoKrConfig(r=1, alpha=ALPHA, target_modules=_LYC_CONVS, init_weights="lycoris")),
        ("lokr", lambda: LoKrConfig(r=R, alpha=ALPHA, target_modules=_LYC_CONVS, init_weights=False)),
    ],
    ids=["loha-cp-random", "loha-cp-default", "lokr-cp-random", "lokr-lycoris", "lokr-whole-random"],
)
def test_conv_inits_draw_peft_s_numbers(variant, config, tmp_path):
    """On conv kernels ``init_adapter`` draws what peft draws, in its order and on its shapes (a
    CP factor's fan-in is peft's ``(r, d)`` one): from the same seed, the same tensors exactly."""
    cfg = config()
    torch.manual_seed(11)
    peft_model = _peft(_pointconvnet(), cfg)  # the base built first, then the adapters' draws
    want = {_peft_key(n): p.detach() for n, p in peft_model.named_parameters() if p.requires_grad}
    options = {"use_effective_conv2d": cfg.use_effective_conv2d}
    options["init"] = {True: "default", False: "random", "lycoris": "lycoris"}[cfg.init_weights]
    if variant == "lokr":
        options |= {"decompose_both": cfg.decompose_both, "decompose_factor": cfg.decompose_factor}
    model = _pointconvnet()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(11)
    _pointconvnet()  # the same global draws as peft's base build above
    generator.set_state(torch.get_rng_state())
    spec = lf.AdapterSpec(variant, targets=_LYC_CONVS, r=cfg.r, alpha=ALPHA, **options)
    adapter = lf.init_adapter(model, spec, generator=generator)
    got = _as_peft(adapter, dict(adapter.params), tmp_path)
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(got[key].to(tensor.dtype), tensor), key



def _redraw_lora(layer, cfg):
    layer.reset_lora_parameters("default", True)
    dora = layer.lora_magnitude_vector["default"]
    a, b = (layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]) if layer.lora_embedding_A else (
        layer.lora_A["default"].weight, layer.lora_B["default"].weight)
    dora.update_layer(base_layer=layer.get_base_layer(), lora_A=a, lora_B=b, scaling=layer.scaling["default"])


# case -> (variant, peft config, model builder, spec options, peft's init of one layer from the global RNG)
KIND_INITS = {
    "dora-conv": ("dora", lambda: LoraConfig(r=R, lora_alpha=ALPHA, use_dora=True, target_modules=_PLAIN_CONVS), _zoo, {}, _redraw_lora),
    # peft's embedding init: A = 0, B ~ N(0, 1)
    "dora-embedding": (
        "dora", lambda: LoraConfig(r=R, lora_alpha=ALPHA, use_dora=True, target_modules=["embed_tokens", "q_proj"]), _llama64, {}, _redraw_lora,
    ),
    "hira-conv-random": (
        "hira", lambda: peft.HiraConfig(r=R, target_modules=_PLAIN_CONVS, init_weights=False), _zoo, {"init": "random"},
        lambda layer, cfg: layer.update_layer("default", R, cfg),
    ),
    "boft-conv-random": (
        "boft", lambda: BOFTConfig(boft_block_size=4, target_modules=["conv2"], init_weights=False), _zoo, {"init": "random", "boft_block_size": 4},
        lambda layer, cfg: layer.reset_boft_parameters("default", False),
    ),
    # an attention's in_proj then its out_proj from one stream (peft's layer holds the out_proj's)
    "lora-mha": (
        "lora", lambda: LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["attn"]),
        lambda seed=0: tiny_model("attention", seed=seed, dtype=torch.float64), {},
        lambda layer, cfg: (layer.reset_lora_parameters("default", True), layer.base_layer.out_proj.reset_lora_parameters("default", True)),
    ),
    # issue 44: OFT, HRA, AdaLoRA and IA3 on a conv
    "oft-conv-random": (
        "oft", lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=["conv2"], init_weights=False), _zoo,
        {"init": "random", "oft_block_size": 4}, lambda layer, cfg: layer.reset_oft_parameters("default", False),
    ),
    "hra-conv-paired": (
        "hra", lambda: peft.HRAConfig(r=2, target_modules=["conv2"]), _zoo, {"init": "paired"}, lambda layer, cfg: layer.reset_hra_parameters("default"),
    ),
    "hra-conv-random": (
        "hra", lambda: peft.HRAConfig(r=2, target_modules=["conv2"], init_weights=False), _zoo, {"init": "random"},
        lambda layer, cfg: layer.reset_hra_parameters_random("default"),
    ),
    "adalora-conv": (
        "adalora", lambda: peft.AdaLoraConfig(init_r=R, target_r=2, total_step=10, target_modules=["conv2"]), _zoo,
        {"init_r": R, "target_r": 2, "total_step": 10}, lambda layer, cfg: layer.reset_lora_parameters("default"),
    ),
    # no draws: ones (peft draws, then overwrites them), on a conv and a grouped conv
    "ia3-conv": ("ia3", lambda: peft.IA3Config(target_modules=["conv2", "grp2"], feedforward_modules=[]), _zoo, {}, None),
    # no draws: the SVD of the stored (V, d) table and the seeded projections, as peft's
    "tinylora-embedding": ("tinylora", lambda: TinyLoraConfig(r=R, u=3, target_modules=["embed_tokens", "q_proj"]), _llama64, {"u": 3}, None),
}


@pytest.mark.parametrize("case", sorted(KIND_INITS))
def test_inits_on_the_new_kinds_draw_peft_s_numbers(case, tmp_path):
    """``init_adapter`` on convs and embeddings gives peft's tensors, trainable and frozen: each
    layer's init from a generator seeded as peft's global RNG draws peft's numbers in its order and
    shapes (a conv factor's ``(r, in·K)`` view is its ``(r, in, *k)`` in memory order), with peft's
    embedding inits and its SVD of the stored table (fp32 models: peft draws in the weight's dtype)."""
    variant, config, build, options, redraw = KIND_INITS[case]
    cfg = config()
    with pytest.MonkeyPatch.context() as mend:
        if variant == "boft":
            import peft.tuners.boft.layer as boft_layer

            mend.setattr(boft_layer, "_FBD_CUDA", False)
        peft_model = _peft(build().float(), cfg)  # fp32: a float64 draw is another number
    model = build().float()

    def spec(targets):
        r = 1 if variant in ("boft", "oft", "ia3") else R if variant == "adalora" else cfg.r
        return lf.AdapterSpec(variant, targets=targets, r=r, alpha=ALPHA, **options)

    # (an attention's out_proj is drawn with the attention: peft saves it only with it)
    targets = [layer.target.module for layer in lf.init_adapter(model, spec(list(cfg.target_modules))).layers if layer.target.layout != "mha_out"]
    modules = dict(peft_model.named_modules())
    # one layer at a time, re-seeded (peft's layer constructors draw too); no draws: all at once
    for names in [[name] for name in targets] if redraw is not None else [targets]:
        if redraw is not None:
            torch.manual_seed(11)
            redraw(modules[f"base_model.model.{names[0]}"], cfg)
        own = lf.init_adapter(model, spec(names), generator=torch.Generator().manual_seed(11))
        got = _as_peft(own, dict(own.params), tmp_path / names[0])
        want = {_peft_key(n): t for n, t in peft_model.state_dict().items() if _peft_key(n) in got}
        assert want and set(got) <= set(want) | {k for k in got if "tinylora_v" in k}, (sorted(got), sorted(want))
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), key


@pytest.mark.parametrize("parameter", ["hold.w", "hold.experts"])
def test_target_parameters_inits_draw_peft_s_numbers(parameter, tmp_path):
    """LoRA on a bare 2-D parameter (and, beside it, the 3-D one): ``init_adapter`` from a
    generator seeded as peft's global RNG draws peft's ``ParamWrapper`` tensors exactly (its
    ``reset_lora_parameters``: A kaiming-uniform in peft's shape, B zeros)."""
    cfg = LoraConfig(r=2, lora_alpha=ALPHA, target_modules=[], target_parameters=[parameter])
    peft_model = _peft(tiny_model("parameters"), cfg)
    torch.manual_seed(11)
    modules = dict(peft_model.named_modules())
    modules["base_model.model.model.hold" if "base_model.model.model.hold" in modules else "base_model.model.hold"].reset_lora_parameters("default", True)
    model = tiny_model("parameters")
    own = lf.init_adapter(model, lf.AdapterSpec("lora", targets=[], r=2, alpha=ALPHA, target_parameters=[parameter]), generator=torch.Generator().manual_seed(11))
    got = _as_peft(own, dict(own.params), tmp_path)
    want = {_peft_key(n): t for n, t in peft_model.state_dict().items() if _peft_key(n) in got}
    assert sorted(want) == sorted(got) and any("lora_A" in k for k in got)
    for key, tensor in want.items():
        assert tensor.abs().max() > 0 or "lora_B" in key, key
        assert torch.equal(got[key], tensor), key
