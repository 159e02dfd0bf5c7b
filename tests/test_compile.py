"""The compile path: ``overlay_mode`` (the lazy overlay as a torch-function mode) in eager
code equals the stand-ins, and torch.compile of the adapted step (DESIGN.md: compile the
function that calls functional_call): every variant, lazy and merged, on both layer kinds,
traces with ``fullgraph=True``, gives eager's outputs and gradients, and new adapter values
reuse the graph.

The backend is ``aot_eager``: dynamo's trace and AOTAutograd's joint graph (where an adapter
can break) without inductor's code generation (a minute per graph on a CPU, and not ours to
test; bench/compile.py times inductor). Small models keep the traces fast: one per README family
(its variants' forms, each on its own layer, lazy and merged together), one per Conv1D case; one
tiny Llama checks a whole transformers model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lora_func as lf
from tests.contract_helpers import build
from tests.contract_helpers import perturbed as perturbed_row
from tests.models import tiny_model, tokens
from tests.one_layer import VOCAB, calibration, one_layer, perturbed
from tests.variant_table import ROWS

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _value_and_grads(fn, params, idle=frozenset()):
    """``fn(params)`` (a scalar, or a vector of losses) and, per loss, its gradients (``idle``: keys
    of tensors that act in training steps only, Row.training_only: none taken)."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    value = fn(leaves)
    losses = value.reshape(-1)
    active = [v for k, v in leaves.items() if k not in idle]
    return value, [torch.autograd.grad(one, active, retain_graph=True) for one in losses]


def _check_compiled(loss, adapter, base_value, names=("loss",)):
    """``loss``: a scalar, or one loss per entry of ``names`` (several paths in one graph).
    ``adapter``: an adapter or a composition of adapters on different layers (each tensor's
    Row.training_only by its own variant)."""
    compiled = torch.compile(loss, fullgraph=True, backend=BACKEND)
    idle = {prefix + key for prefix, part in _parts(adapter) for key in part.params if key.rsplit(".", 1)[-1] in ROWS[part.spec.variant].training_only}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for shift in (0.0, 0.05):  # the second call: new adapter values, the same graph
            params = {k: v.detach() + shift for k, v in adapter.params.items()}
            want_value, want_grads = _value_and_grads(loss, params, idle)
            got_value, got_grads = _value_and_grads(compiled, params, idle)
            params = {k: v for k, v in params.items() if k not in idle}
            torch.testing.assert_close(got_value, want_value, rtol=1e-5, atol=1e-6)
            for name, got_one, want_one in zip(names, got_grads, want_grads, strict=True):
                for key, got, want in zip(params, got_one, want_one, strict=True):
                    assert float(want.abs().max()) > 0, f"{name} {key}: no gradient to compare"
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=f"{name} {key}")
            # The adapter reached the compiled model: each loss is not the base model's.
            for name, got, base in zip(names, got_value.reshape(-1), base_value.reshape(-1).expand(len(names)), strict=True):
                assert not torch.allclose(got, base, rtol=1e-4, atol=1e-6), name


def _parts(adapter):
    """(key prefix, adapter) of each part: a composition's keys are ``<i>/<key>``."""
    return [(f"{i}/", part) for i, part in enumerate(adapter.parts)] if isinstance(adapter, lf.Composed) else [("", adapter)]


def _loss_and_grads(model, params_of, adapter, ids):
    """Cross-entropy of ``functional_call(model, params_of(p))`` and its gradients w.r.t. the adapter
    (the tensors that act in eval mode: Row.training_only left out)."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in adapter.params.items()}
    with params_of(adapter.with_params(leaves)) as params:
        logits = torch.func.functional_call(model, params, (ids,)).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    active = [k for k in leaves if k.rsplit(".", 1)[-1] not in ROWS[adapter.spec.variant].training_only]
    return logits.detach(), dict(zip(active, torch.autograd.grad(loss, [leaves[k] for k in active]), strict=True))


class _StandIns:
    """``overlay(base, adapter)`` as a context manager yielding the dict, for symmetry with the mode."""

    def __init__(self, base, adapter):
        self.params = lf.overlay(base, adapter)

    def __enter__(self):
        return self.params

    def __exit__(self, *exc):
        return False


class _Mode:
    def __init__(self, base, adapter, strict=False):
        self.base, self.mode = base, lf.overlay_mode(base, adapter, lazy_only=strict)

    def __enter__(self):
        self.mode.__enter__()
        return self.base

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("variant", sorted(ROWS))
def test_overlay_mode_in_eager_code_equals_the_stand_ins(variant, kind):
    row = ROWS[variant]
    model, adapter = build(row, kind)
    adapter = perturbed_row(adapter, row.perturb_scale)
    base, ids = lf.base_params(model), tokens(2, 8)
    want_logits, want_grads = _loss_and_grads(model, lambda a: _StandIns(base, a), adapter, ids)
    got_logits, got_grads = _loss_and_grads(model, lambda a: _Mode(base, a), adapter, ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    for key, want in want_grads.items():
        torch.testing.assert_close(got_grads[key], want, rtol=1e-6, atol=1e-7 * float(want.abs().max()), msg=key)
    # Only the base dict's own tensors are routed (by identity): copies are just the base model.
    clones = {id(v): v.clone() for v in base.values()}  # one clone per tensor: tied names stay tied
    copies = {k: clones[id(v)] for k, v in base.items()}
    with lf.overlay_mode(base, adapter):
        plain = torch.func.functional_call(model, copies, (ids,)).logits
    torch.testing.assert_close(plain, model(ids).logits, rtol=0, atol=0)


def test_overlay_mode_gives_other_ops_the_merged_weight_or_raises_when_lazy_only():
    model = tiny_model("gpt2")
    adapter = lf.init_adapter(model, lf.AdapterSpec("lora", targets=["lm_head"], r=2, tied="both"))
    adapter = perturbed(adapter, seed=3)
    base, ids = lf.base_params(model), tokens(2, 8)
    with lf.overlay_mode(base, adapter):
        got = torch.func.functional_call(model, base, (ids,)).logits
    # The embedding lookup reads the tied weight too: it gets the merged weight, as with overlay().
    torch.testing.assert_close(got, lf.adapted_call(model, adapter, ids, merged=True).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"embedding on adapted weight\(s\) \['lm_head.weight'\] has no low-rank path"):
        with lf.overlay_mode(base, adapter, lazy_only=True):
            torch.func.functional_call(model, base, (ids,))


def test_compiled_adapted_call_keeps_the_path_it_was_asked_for():
    """Under compile ``merged=True`` merges and ``merged=False`` runs the lazy mode. A tied
    ``lm_head`` tells them apart: the embedding lookup reads the adapted weight, which the
    merged path serves and the strict lazy path refuses, compiled as in eager code. One GPT-2
    block: only the tied head is adapted, and the merged compile traces every block."""
    model = tiny_model("gpt2", layers=1)
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("lora", targets=["lm_head"], r=2, tied="both")), seed=3)
    base, ids = lf.base_params(model), tokens(2, 8)

    def logits(merged):
        return lf.adapted_call(model, adapter, ids, merged=merged, lazy_only=True, base=base).logits

    want = logits(True)
    got = torch.compile(lambda: logits(True), fullgraph=True, backend=BACKEND)()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for call in (lambda: logits(False), torch.compile(lambda: logits(False), fullgraph=True, backend=BACKEND)):
        with pytest.raises(Exception, match=r"embedding on adapted weight\(s\) \['lm_head.weight'\] has no low-rank path"):
            call()


def _one_variant_per_forms() -> list[str]:
    """What compiles is the forms: one variant per (weight_form, activation_form) pair (eva runs
    LoRA's; olora and corda run PiSSA's): the variant that defines them, else the first by name."""
    seen: dict[tuple, str] = {}
    for name in sorted(ROWS, key=lambda n: (n not in ("lora", "pissa"), n)):
        variant = lf.get_variant(name)
        seen.setdefault((variant.weight_form, variant.activation_form), name)
    return sorted(seen.values())


def _families() -> dict[str, list[str]]:
    """The variants to compile, one variant per forms (:func:`_one_variant_per_forms`), by the
    README's families (tests/test_docs.py checks every variant is in one): one compiled function
    per family holds each member's lazy and merged path."""
    from tests.test_docs import readme_families

    compiled = set(_one_variant_per_forms())
    # (a variant without a merged weight compiles alone, on the lazy path only: in a family's
    # composition its merged path would refuse the whole call)
    lazy_only = {name for name in compiled if not lf.get_variant(name).merges}
    families = {family: sorted((compiled - lazy_only) & set(names)) for family, names in readme_families().items()}
    left = compiled - {name for names in families.values() for name in names}
    return {family: names for family, names in families.items() if names} | {name: [name] for name in sorted(left)}


class _Parallel(nn.Module):
    """``x -> Σ layers[name](x)``: one ``nn.Linear`` (12 -> 10, with a bias) per variant of a
    family, each adapted by its own variant."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 12)  # calibration runs the model on token batches
        self.layers = nn.ModuleDict({name: nn.Linear(12, 10) for name in names})

    def forward(self, input_ids: torch.Tensor | None = None, x: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(input_ids) if x is None else x
        return sum(layer(h) for layer in self.layers.values())


def _compiled_case_adapter(variant: str, model: nn.Module, target: str) -> lf.Adapter:
    row = ROWS[variant]
    # c3a: r is a block size, which must divide d_in = 12 and d_out = 10; trainable tokens: rows below 10
    tokens_below = {"token_indices": [6, 4, 9]} if variant == "trainable_tokens" else {}
    spec = lf.AdapterSpec(variant, targets=[target], **{**row.spec_kwargs, "r": 2 if variant == "c3a" else 4, **tokens_below})
    adapter = lf.init_adapter(
        model, spec, generator=torch.Generator().manual_seed(1), calibration=calibration(2) if row.calibration else None
    )
    return perturbed(adapter, seed=3)


def _check_both_paths_compile(model: nn.Module, adapter, merges: bool = True) -> None:
    base, x = lf.base_params(model), torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(4))
    target = torch.randn(3, 5, 10, generator=torch.Generator().manual_seed(5))

    modes = (False, True)[: 1 + merges]  # (no merged weight: the lazy path only)

    def losses(params):
        adapted = adapter.with_params(params)
        return torch.stack([((lf.adapted_call(model, adapted, x=x, merged=merged, base=base) - target) ** 2).mean() for merged in modes])

    _check_compiled(losses, adapter, ((model(x=x) - target) ** 2).mean(), names=("lazy", "merged")[: len(modes)])


FAMILIES = _families()


@pytest.mark.parametrize("family", sorted(FAMILIES), ids=lambda family: "-".join(family.replace("'", "").split()))
def test_every_variant_compiles_fullgraph_without_recompiling(family):
    """Every variant's forms on nn.Linear, one compiled function per family: the family's variants
    each adapt their own layer of one model (a composition of adapters on different layers), the
    lazy and the merged path in the same graph. Both trace with ``fullgraph=True`` (a graph break
    in any member's forms fails it), the losses equal eager's and every tensor's gradient, per
    path, equals eager's and is non-zero (an adapter the compiled graph dropped has a zero or
    different gradient). One trace of the call machinery per path instead of one per variant."""
    names = FAMILIES[family]
    torch.manual_seed(0)
    model = _Parallel(names).requires_grad_(False).eval()
    merges = all(lf.get_variant(name).merges for name in names)
    _check_both_paths_compile(model, lf.compose([_compiled_case_adapter(name, model, f"layers.{name}") for name in names]), merges)


@pytest.mark.parametrize("variant", ["lora", "pissa"])
def test_conv1d_layers_compile_fullgraph_without_recompiling(variant):
    """GPT-2 Conv1D for LoRA's and PiSSA's forms: a layout changes only the stand-in's op around
    the forms (the same code for every variant), so the Conv1D rows are not repeated per variant."""
    model = one_layer("conv1d", 12, 10, bias=True, dtype=torch.float32, seed=0)
    _check_both_paths_compile(model, _compiled_case_adapter(variant, model, "proj"))


def test_lazy_path_of_a_transformers_model_compiles_fullgraph():
    """A whole transformers model (embedding, rotary, mask, attention, MLP, head) on the lazy
    path. One decoder layer: dynamo traces every layer again (a second one cost 40 % more), and
    that the members on different layers of one model stay apart in the graph is what the family
    compiles check (one layer per member, every tensor's gradient against eager)."""
    model = tiny_model("llama", layers=1)
    adapter = perturbed(lf.init_adapter(model, lf.AdapterSpec("dora", targets=["q_proj", "v_proj", "down_proj"], r=2)), seed=3)
    base, ids = lf.base_params(model), tokens(2, 8)

    def loss(params):
        logits = lf.adapted_call(model, adapter.with_params(params), ids, base=base).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    base_loss = torch.nn.functional.cross_entropy(model(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    _check_compiled(loss, adapter, base_loss)
