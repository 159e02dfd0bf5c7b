"""Input-level adapters (lora_func.prompts) against HF peft 0.21, float64, on a tiny Llama and GPT-2.

One table over the methods (and their encoders and inits). Per row and model:

- the training form: ``init_prompt`` with a seeded generator draws what peft draws after
  ``torch.manual_seed`` (same method, options, dtype); with every trainable tensor perturbed
  (random, non-symmetric), the real positions' logits, the loss (from the logits, float64; and
  the model's own ``labels=`` loss) and the gradient of every trainable tensor equal peft's
  ``get_peft_model`` (rel 1e-9; RMSNorm computes in the input dtype on both sides);
- peft's checkpoint (``save_pretrained`` of that model) loaded with ``lora_func.load_peft`` equals
  ``PeftModel.from_pretrained`` (logits, loss, per-tensor gradients), and greedy ``generate`` with
  the KV cache (left-padded where the prompt puts tokens in front) gives peft's tokens and scores;
- ``save_peft`` of a perturbed prompt loads in peft with the same outputs, and ``lf.save`` /
  ``lf.load`` give the prompt back exactly.

Then the functional features over the same rows: a stack under ``vmap`` equals a loop, one prompt
per row (``mixed_call``, ``mixed_adapted`` + ``generate``) equals each prompt alone,
``per_example_grads`` and ``private_grads`` equal loops of ``torch.func.grad``, a prompt composed
with LoRA equals the LoRA adapter on hand-built input embeddings; the inits from text and from a
source prompt; the errors of the new public functions are in tests/test_error_catalogue.py.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import peft
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import lora_func as lf
from lora_func.demo.model import ASSETS
from tests.bank_oracle import rmsnorm_in_input_dtype
from tests.models import tiny_model, tokens

RTOL = 1e-9
C = "CAUSAL_LM"
F64 = torch.float64


@dataclasses.dataclass(frozen=True)
class Row:
    """One method (with its options): peft's config and our spec for it."""

    config: Callable[[], Any]
    spec: Callable[[], lf.PromptSpec]
    kinds: tuple[str, ...] = ("llama", "gpt2")
    tasks: bool = False  # multitask: task_ids per row
    cpt: bool = False  # CPT: input_type_mask


CPT_OPTIONS = dict(cpt_token_ids=[5, 6, 7, 8, 9], cpt_mask=[1, 1, 1, 1, 1], cpt_tokens_type_mask=[1, 2, 3, 4, 0],
                   opt_weighted_loss_type="decay", opt_loss_decay_factor=0.7)
ROWS = {
    "prompt_tuning": Row(lambda: peft.PromptTuningConfig(task_type=C, num_virtual_tokens=3), lambda: lf.PromptSpec("prompt_tuning", 3, dtype=F64)),
    "prompt_tuning-sample_vocab": Row(
        lambda: peft.PromptTuningConfig(task_type=C, num_virtual_tokens=3, prompt_tuning_init="SAMPLE_VOCAB"),
        lambda: lf.PromptSpec("prompt_tuning", 3, dtype=F64, init="sample_vocab"), kinds=("llama",),
    ),
    "prefix_tuning": Row(lambda: peft.PrefixTuningConfig(task_type=C, num_virtual_tokens=3), lambda: lf.PromptSpec("prefix_tuning", 3, dtype=F64)),
    "prefix_tuning-projection": Row(
        lambda: peft.PrefixTuningConfig(task_type=C, num_virtual_tokens=3, prefix_projection=True, encoder_hidden_size=12),
        lambda: lf.PromptSpec("prefix_tuning", 3, dtype=F64, prefix_projection=True, encoder_hidden_size=12),
    ),
    "p_tuning-mlp": Row(
        lambda: peft.PromptEncoderConfig(task_type=C, num_virtual_tokens=3, encoder_hidden_size=12),
        lambda: lf.PromptSpec("p_tuning", 3, dtype=F64, encoder_hidden_size=12),
    ),
    "p_tuning-lstm": Row(
        lambda: peft.PromptEncoderConfig(task_type=C, num_virtual_tokens=3, encoder_hidden_size=6, encoder_reparameterization_type="LSTM"),
        lambda: lf.PromptSpec("p_tuning", 3, dtype=F64, encoder_hidden_size=6, encoder="lstm"),
    ),
    "multitask_prompt_tuning": Row(
        lambda: peft.MultitaskPromptTuningConfig(task_type=C, num_virtual_tokens=3, num_tasks=3, num_ranks=2),
        lambda: lf.PromptSpec("multitask_prompt_tuning", 3, dtype=F64, num_tasks=3, num_ranks=2), tasks=True,
    ),
    "cpt": Row(lambda: peft.CPTConfig(task_type=C, **CPT_OPTIONS), lambda: lf.PromptSpec("cpt", dtype=F64, **CPT_OPTIONS), cpt=True),
    "cartridge": Row(
        lambda: peft.CartridgeConfig(task_type=C, num_virtual_tokens=3, num_frozen_tokens=1),
        lambda: lf.PromptSpec("cartridge", 3, dtype=F64, num_frozen_tokens=1),
    ),
    "adaption_prompt": Row(
        lambda: peft.AdaptionPromptConfig(task_type=C, adapter_len=3, adapter_layers=2),
        lambda: lf.PromptSpec("adaption_prompt", 3, dtype=F64, adapter_layers=2),
    ),
}
CASES = [(name, kind) for name, row in ROWS.items() for kind in row.kinds]
IDS = tokens()
RIGHT_PADDED = torch.ones_like(IDS)
RIGHT_PADDED[0, -2:] = 0  # (left padding gives fully masked rows: NaN in float64 eager attention)
LEFT_PADDED = torch.ones_like(IDS)
LEFT_PADDED[0, :2] = 0
TASKS = torch.tensor([2, 0])
TYPES = torch.tensor([[1, 1, 2, 2, 3, 4, 4, 4], [1, 2, 2, 3, 4, 4, 5, 8]])


@functools.cache
def model64(kind: str) -> torch.nn.Module:
    return rmsnorm_in_input_dtype(tiny_model(kind, dtype=F64))


@contextlib.contextmanager
def default_float64():
    """peft builds prompt encoders in the default dtype and loads a checkpoint into them: float64
    (a float32 encoder would round the loaded float64 tensors)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def our_name(peft_name: str) -> str:
    """peft's parameter name -> the prompt's key."""
    name = peft_name.removeprefix("prompt_encoder.default.").removeprefix("base_model.model.")
    return name.removesuffix(".weight") if name in ("embedding.weight", "delta_embedding.weight") else name


def prompt_tensors(pm: Any) -> dict[str, Tensor]:
    """peft's prompt tensors (its prompt encoder's, or the adaption prompts), by our keys."""
    return {our_name(n): p for n, p in pm.named_parameters() if n.startswith("prompt_encoder.") or ".adaption_" in n}


def inputs(row: Row) -> dict[str, Tensor]:
    return {"task_ids": TASKS} if row.tasks else {}


def rel(got: Tensor, want: Tensor) -> float:
    return float(((got - want).abs().max() / want.abs().max()).detach())


def real(logits: Tensor, prompt: lf.Prompt) -> Tensor:
    """The real positions' logits (the virtual tokens' come first where the prompt adds tokens)."""
    return logits[:, logits.shape[1] - IDS.shape[1] :]


def ce(logits: Tensor) -> Tensor:
    logits = logits[:, logits.shape[1] - IDS.shape[1] :]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), IDS[:, 1:].reshape(-1))


def forward(call: Callable[..., Any], row: Row) -> Any:
    extra = {"input_type_mask": TYPES.clone()} if row.cpt else {}  # (peft's CPT edits it in place)
    return call(input_ids=IDS, attention_mask=RIGHT_PADDED, labels=IDS, **inputs(row), **extra)


def loss_of(out: Any, row: Row) -> Tensor:
    """CPT's loss is its own (the model's output carries it); the others' from the logits."""
    return out.loss if row.cpt else ce(out.logits)


@functools.cache
def peft_model(name: str, kind: str) -> tuple[Any, lf.Prompt, lf.Prompt]:
    """(peft's model with every trainable tensor perturbed, our seeded init before the
    perturbation, the same prompt with peft's perturbed values)."""
    row, model = ROWS[name], model64(kind)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model), row.config()).to(F64).eval()
    init = lf.init_prompt(model, row.spec(), generator=torch.Generator().manual_seed(0))
    init_values = {k: v.detach().clone() for k, v in prompt_tensors(pm).items()}
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    values = {k: v.detach().clone() for k, v in prompt_tensors(pm).items()}
    prompt = init.with_params({k: values[k].requires_grad_(True) for k in init.params}).with_buffers({k: values[k] for k in init.buffers})
    assert set(init_values) == set(init.params) | set(init.buffers)
    for key, value in init_values.items():  # seeded inits are peft's, draw for draw
        mine = init.params[key] if key in init.params else init.buffers[key]
        assert torch.equal(mine.detach(), value), key
    return pm, init, prompt


def assert_same_call(ours: Any, theirs: Any, prompt: lf.Prompt, ours_grads: list[Tensor], theirs_grads: list[Tensor], names: list[str]) -> None:
    assert rel(real(ours.logits, prompt), real(theirs.logits, prompt)) < RTOL
    assert rel(ours.loss, theirs.loss) < 1e-6  # the model's labels= loss casts to float32
    for name, a, b in zip(names, ours_grads, theirs_grads, strict=True):
        assert b.abs().max() > 0 or name.endswith("delta_embedding") or a.abs().max() == 0, name
        assert rel(a, b) < RTOL if b.abs().max() > 0 else torch.equal(a, b), name


@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_training_form_equals_peft(name, kind):
    row, model = ROWS[name], model64(kind)
    pm, _, prompt = peft_model(name, kind)
    theirs = forward(pm, row)
    peft_params = {our_name(n): p for n, p in pm.named_parameters() if p.requires_grad}
    names = sorted(peft_params)
    assert names == sorted(prompt.params)
    theirs_grads = torch.autograd.grad(loss_of(theirs, row), [peft_params[n] for n in names])
    ours = forward(functools.partial(lf.adapted_call, model, prompt), row)
    ours_grads = torch.autograd.grad(loss_of(ours, row), [prompt.params[n] for n in names])
    assert_same_call(ours, theirs, prompt, list(ours_grads), list(theirs_grads), names)
    assert all(g.abs().max() > 0 for n, g in zip(names, ours_grads, strict=True)), "every trainable tensor moves the loss"


def _peft_loaded(directory: Any, kind: str) -> tuple[Any, dict[str, Tensor]]:
    with warnings.catch_warnings(), default_float64():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(model64(kind)), directory).eval()
    tensors = prompt_tensors(loaded)
    return loaded, tensors


@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_peft_checkpoint_loads_and_generates_as_peft(name, kind, tmp_path):
    row, model = ROWS[name], model64(kind)
    pm, _, _ = peft_model(name, kind)
    pm.save_pretrained(tmp_path)
    ours = lf.load_peft(tmp_path, model)
    loaded, theirs_tensors = _peft_loaded(tmp_path, kind)
    names = sorted(ours.params)
    if row.cpt:
        # peft's loaded CPT serves its embedding (the saved prompt) and never reads the delta: our
        # zero delta's gradient is the prompt's, on the rows CPT trains (types 1, 2, 3 mod 4).
        theirs_tensors = {"delta_embedding": theirs_tensors["embedding"]}
    for n in names:
        theirs_tensors[n].requires_grad_(True)
    theirs = forward(loaded, row)
    theirs_grads = torch.autograd.grad(loss_of(theirs, row), [theirs_tensors[n] for n in names])
    if row.cpt:
        theirs_grads = (theirs_grads[0] * torch.tensor([1.0, 1, 1, 0, 0], dtype=F64).unsqueeze(-1),)
    out = forward(functools.partial(lf.adapted_call, model, ours), row)
    ours_grads = torch.autograd.grad(loss_of(out, row), [ours.params[n] for n in names])
    assert_same_call(out, theirs, ours, list(ours_grads), list(theirs_grads), names)
    # Greedy generation with the KV cache: peft's tokens and scores, left-padded where the
    # prompt's tokens come first (position ids from the mask, as generate makes them).
    mask = LEFT_PADDED if ours.method.entry != "attention" else torch.ones_like(IDS)
    kwargs = dict(input_ids=IDS, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True, **inputs(row))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: "Position ids are not supported ... Ignoring position ids."
        want = loaded.generate(**kwargs)
        warnings.simplefilter("error")
        with lf.adapted(model, ours):
            got = model.generate(**kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert max(rel(a, b) for a, b in zip(got.logits, want.logits, strict=True)) < RTOL
    assert "prepare_inputs_for_generation" not in model.__dict__ and "forward" not in model.__dict__


@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_save_peft_loads_in_peft_and_lf_files_round_trip(name, kind, tmp_path):
    row, model = ROWS[name], model64(kind)
    _, _, prompt = peft_model(name, kind)
    directory = lf.save_peft(prompt, tmp_path / "peft")
    loaded, _ = _peft_loaded(directory, kind)
    want = forward(loaded, row)
    got = forward(functools.partial(lf.adapted_call, model, prompt), row)
    assert rel(real(got.logits, prompt), real(want.logits, prompt)) < RTOL
    again = lf.load_peft(directory, model)
    assert rel(real(forward(functools.partial(lf.adapted_call, model, again), row).logits, prompt), real(got.logits, prompt)) < RTOL
    path = lf.save(prompt, tmp_path / "prompt.safetensors")
    back = lf.load(path, model=model)
    assert back.spec == prompt.spec and back.geometry == prompt.geometry
    for flat, other in ((back.params, prompt.params), (back.buffers, prompt.buffers)):
        assert sorted(flat) == sorted(other) and all(torch.equal(flat[k], other[k].detach()) for k in flat)
    assert all(t.requires_grad for t in back.params.values())


# ----------------------------------------------------------------------------- functional features


def _pair(name: str) -> tuple[lf.Prompt, lf.Prompt]:
    """Two different prompts of the row on the Llama (peft's perturbed values, and those doubled
    and shifted)."""
    _, _, a = peft_model(name, "llama")
    b = a.with_params({k: (v.detach() * -1.5 + 0.1).requires_grad_(True) for k, v in a.params.items()})
    return a, b


def _call_kwargs(row: Row, rows: slice = slice(None)) -> dict[str, Tensor]:
    extra = {"input_type_mask": TYPES[rows]} if row.cpt else {}
    return {"attention_mask": RIGHT_PADDED[rows], **({"task_ids": TASKS[rows]} if row.tasks else {}), **extra}


LLAMA_ROWS = [name for name, row in ROWS.items() if "llama" in row.kinds]


@pytest.mark.parametrize("name", LLAMA_ROWS)
def test_a_stack_under_vmap_and_ensemble_call_equal_a_loop(name):
    row, model = ROWS[name], model64("llama")
    a, b = _pair(name)
    loop = torch.stack([lf.adapted_call(model, p, IDS, **_call_kwargs(row)).logits for p in (a, b)])
    assert rel(loop[0], loop[1]) > 1e-3  # the two prompts differ
    stacked = lf.stack([a, b])
    vmapped = torch.func.vmap(lambda p: lf.adapted_call(model, p, IDS, use_cache=False, **_call_kwargs(row)).logits)(stacked)
    assert rel(vmapped, loop) < RTOL
    ensemble = lf.ensemble_call(model, stacked, IDS, **_call_kwargs(row)).logits
    assert rel(ensemble, loop) < RTOL
    assert [p.spec for p in lf.unstack(stacked)] == [a.spec, b.spec]
    assert all(torch.equal(lf.take(stacked, 1).params[k], b.params[k].detach()) for k in b.params)


@pytest.mark.parametrize("name", LLAMA_ROWS)
def test_one_prompt_per_row_equals_each_alone_in_calls_and_generate(name):
    row, model = ROWS[name], model64("llama")
    a, b = _pair(name)
    index = torch.tensor([1, 0])
    alone = [lf.adapted_call(model, (a, b)[int(index[r])], IDS[r : r + 1], **_call_kwargs(row, slice(r, r + 1))).logits for r in range(2)]
    mixed = lf.mixed_call(model, [a, b], index, IDS, **_call_kwargs(row), batching="layers").logits
    assert rel(mixed, torch.cat(alone)) < RTOL
    both = lf.mixed_call(model, lf.stack([a, b]), index, IDS, use_cache=False, **_call_kwargs(row)).logits
    assert rel(both, mixed) < RTOL
    generate = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    task = {"task_ids": TASKS} if row.tasks else {}
    with torch.no_grad(), lf.mixed_adapted(model, lf.stack([a, b]), index):
        together = model.generate(input_ids=IDS, attention_mask=torch.ones_like(IDS), **task, **generate)
    for r in range(2):
        with torch.no_grad(), lf.adapted(model, (a, b)[int(index[r])]):
            one = model.generate(input_ids=IDS[r : r + 1], attention_mask=torch.ones_like(IDS[r : r + 1]),
                                 **({"task_ids": TASKS[r : r + 1]} if row.tasks else {}), **generate)
        assert torch.equal(together.sequences[r], one.sequences[0])
        assert max(rel(x[r], y[0]) for x, y in zip(together.logits, one.logits, strict=True)) < RTOL
    assert "prepare_inputs_for_generation" not in model.__dict__ and "forward" not in model.__dict__


def _example_loss(model: torch.nn.Module, row: Row) -> Callable[..., Tensor]:
    def loss(prompt: lf.Prompt, ids: Tensor, mask: Tensor, *rest: Tensor) -> Tensor:
        extra = {"task_ids": rest[0]} if row.tasks else {}
        return ce_of(lf.adapted_call(model, prompt, ids, attention_mask=mask, use_cache=False, **extra).logits, ids)

    return loss


def ce_of(logits: Tensor, ids: Tensor) -> Tensor:
    logits = logits[:, logits.shape[1] - ids.shape[1] :]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("name", ["prompt_tuning", "prefix_tuning", "p_tuning-lstm", "multitask_prompt_tuning", "adaption_prompt"])
def test_per_example_and_private_grads_equal_loops_of_grad(name):
    row, model = ROWS[name], model64("llama")
    prompt, _ = _pair(name)
    loss = _example_loss(model, row)
    batch = (IDS, RIGHT_PADDED, *((TASKS,) if row.tasks else ()))
    grads = lf.per_example_grads(loss, prompt, *batch)
    for r in range(2):
        example = tuple(t[r : r + 1] for t in batch)
        one = torch.func.grad(lambda p, example=example: loss(prompt.with_params(p), *example))(prompt.params)
        for key in one:
            assert one[key].abs().max() > 0 and rel(grads[key][r], one[key]) < RTOL, key
    private = lf.private_grads(loss, prompt, *batch, max_grad_norm=1e9, noise_multiplier=0.0)
    assert all(rel(private[k], grads[k].mean(0)) < RTOL for k in grads)
    clipped = lf.private_grads(loss, prompt, *batch, max_grad_norm=1e-3, noise_multiplier=0.0)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    assert bool((norms > 1e-2).all())  # every example is clipped
    # (clipped_sum takes the norms in float32: the clip factor is float32-exact)
    assert all(rel(clipped[k], (grads[k] * (1e-3 / (norms + 1e-6)).view(-1, *[1] * (grads[k].dim() - 1))).mean(0)) < 1e-5 for k in grads)


@pytest.mark.parametrize("name", ["prompt_tuning", "prefix_tuning", "adaption_prompt"])
def test_a_prompt_composed_with_lora_is_lora_on_the_prompted_inputs(name):
    """``compose(prompt, lora)``: the oracle applies the LoRA adapter alone, to inputs built by
    hand (the prompt's embeddings in front, or its prefix cache), or to the peft model's own
    adaption-prompt attention (peft cannot hold both in one model)."""
    model = model64("llama")
    prompt, _ = _pair(name)
    targets = ["q_proj", "v_proj", "embed_tokens"] if name == "prompt_tuning" else ["q_proj", "v_proj"]
    lora = lf.init_adapter(model, lf.AdapterSpec("lora", targets=targets, r=2, dtype=F64), generator=torch.Generator().manual_seed(1))
    lora = lora.with_params({k: (torch.randn_like(v) * 0.3).requires_grad_(True) for k, v in lora.params.items()})
    both = lf.compose(prompt, lora)
    out = lf.adapted_call(model, both, IDS, attention_mask=RIGHT_PADDED).logits
    grads = torch.autograd.grad(ce(out), list(both.params.values()))
    n = prompt.spec.num_virtual_tokens
    mask = torch.cat([torch.ones(2, n, dtype=RIGHT_PADDED.dtype), RIGHT_PADDED], dim=1)
    if name == "prompt_tuning":
        def oracle(p: lf.Prompt, a: lf.Adapter) -> Tensor:
            embed = F.embedding(IDS, lf.merge_overlay(lf.base_params(model), a)["model.embed_tokens.weight"])
            inputs_embeds = torch.cat([p.params["embedding"].expand(2, -1, -1), embed], dim=1)
            return lf.adapted_call(model, a, inputs_embeds=inputs_embeds, attention_mask=mask).logits
    elif name == "prefix_tuning":
        from transformers import DynamicCache

        def oracle(p: lf.Prompt, a: lf.Adapter) -> Tensor:
            g = p.geometry
            flat = p.params["embedding"].expand(2, -1, -1).reshape(2, n, g.num_layers * 2, g.kv_heads, g.head_dim)
            cache = DynamicCache(flat.permute(2, 0, 3, 1, 4).split(2))
            return lf.adapted_call(model, a, IDS, attention_mask=mask, past_key_values=cache).logits
    else:
        # peft's model holds the same adaption prompts; the LoRA adapter goes on its wrapped
        # attention's projections (renamed "self_attn.model.q_proj" there).
        pm, _, _ = peft_model(name, "llama")
        wrapped = pm.base_model.model
        on_wrapped = lf.init_adapter(wrapped, lf.AdapterSpec("lora", targets=targets, r=2, dtype=F64))
        on_wrapped = on_wrapped.with_params({k: lora.params[k.replace(".self_attn.model.", ".self_attn.")].detach().clone().requires_grad_(True) for k in on_wrapped.params})
        base = lf.base_params(wrapped) | {n: p for n, p in wrapped.named_parameters() if ".adaption_" in n}  # peft's, live
        want = torch.func.functional_call(wrapped, lf.overlay(base, on_wrapped), (IDS,), {"attention_mask": RIGHT_PADDED}).logits
        theirs = prompt_tensors(pm)
        want_grads = torch.autograd.grad(ce(want), [theirs[k] for k in prompt.params] + list(on_wrapped.params.values()))
    if name != "adaption_prompt":
        want = oracle(prompt, lora)
        want_grads = torch.autograd.grad(ce(want), list(prompt.params.values()) + list(lora.params.values()))
    assert rel(out, want) < RTOL
    for key, got, expected in zip(both.params, grads, want_grads, strict=True):
        assert expected.abs().max() > 0 and rel(got, expected) < RTOL, key
    assert rel(out, lf.adapted_call(model, prompt, IDS, attention_mask=RIGHT_PADDED).logits) > 1e-3  # the LoRA part counts



# ----------------------------------------------------------------------------- inits from text and from a source


@functools.cache
def demo() -> tuple[torch.nn.Module, Any]:
    """The shipped pretrained tiny Llama and its tokenizer (text inits need real token ids)."""
    from lora_func.demo.model import load_model

    return load_model()


TEXT = "what is 3 plus 4 ?"


@pytest.mark.parametrize(
    ("config", "spec"),
    [
        (lambda: peft.PromptTuningConfig(task_type=C, num_virtual_tokens=11, prompt_tuning_init="TEXT", prompt_tuning_init_text=TEXT, tokenizer_name_or_path=str(ASSETS)),
         lambda: lf.PromptSpec("prompt_tuning", 11, init="text", init_text=TEXT)),
        (lambda: peft.PromptTuningConfig(task_type=C, num_virtual_tokens=2, prompt_tuning_init="TEXT", prompt_tuning_init_text=TEXT, tokenizer_name_or_path=str(ASSETS)),
         lambda: lf.PromptSpec("prompt_tuning", 2, init="text", init_text=TEXT)),
        (lambda: peft.MultitaskPromptTuningConfig(task_type=C, num_virtual_tokens=4, num_tasks=2, prompt_tuning_init="TEXT", prompt_tuning_init_text=TEXT,
                                                  tokenizer_name_or_path=str(ASSETS)),
         lambda: lf.PromptSpec("multitask_prompt_tuning", 4, num_tasks=2, init="text", init_text=TEXT)),
        (lambda: peft.CartridgeConfig(task_type=C, num_virtual_tokens=4, num_frozen_tokens=1),
         lambda: lf.PromptSpec("cartridge", 4, num_frozen_tokens=1, init="text", init_text=TEXT)),
    ],
    ids=["prompt_tuning-repeated", "prompt_tuning-trimmed", "multitask", "cartridge"],
)
def test_text_inits_are_peft_s(config, spec):
    """On the shipped tiny Llama with its tokenizer: the word embeddings of the text's tokens,
    repeated or trimmed to n (a cartridge: the frozen model's first n cached keys and values, as
    peft's ``initialize_kv_prefix_from_text(..., use_chat_template=False)``)."""
    model, tokenizer = demo()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model), config())
    the_spec = spec()
    if the_spec.method == "cartridge":
        peft.initialize_kv_prefix_from_text(pm, tokenizer, text=TEXT, use_chat_template=False)
    ours = lf.init_prompt(model, the_spec, generator=torch.Generator().manual_seed(0), tokenizer=tokenizer)
    theirs = prompt_tensors(pm)
    for key in theirs:
        mine = ours.params[key] if key in ours.params else ours.buffers[key]
        assert torch.equal(mine.detach(), theirs[key].detach()), key
    assert ours.method.entry != "embeds" or torch.equal(ours.params["embedding"][0], model.get_input_embeddings().weight[tokenizer(TEXT)["input_ids"][0]])


@pytest.mark.parametrize("init", ["average_source_tasks", "exact_source_task", "only_source_shared"])
def test_multitask_inits_from_a_source_prompt_are_peft_s(init, tmp_path):
    model = model64("llama")
    _, _, source = peft_model("multitask_prompt_tuning", "llama")
    lf.save_peft(source, tmp_path)  # peft reads the source's state dict from a file
    tasks = 1 if init != "only_source_shared" else 3
    torch.manual_seed(0)
    with warnings.catch_warnings():  # (peft's encoder is float32: its draws, and the source rounded to float32)
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(copy.deepcopy(model), peft.MultitaskPromptTuningConfig(
            task_type=C, num_virtual_tokens=3, num_tasks=tasks, num_ranks=2, prompt_tuning_init=init.upper(), prompt_tuning_init_task=2,
            prompt_tuning_init_state_dict_path=str(tmp_path / "adapter_model.safetensors")))
    spec = lf.PromptSpec("multitask_prompt_tuning", 3, dtype=F64, num_tasks=tasks, num_ranks=2, init=init, init_task=2)
    ours = lf.init_prompt(model, spec, generator=torch.Generator().manual_seed(0), source=lf.load_peft(tmp_path, model))
    theirs = prompt_tensors(pm)
    for key, value in theirs.items():
        assert torch.equal(ours.params[key].detach().to(value.dtype), value.detach()), key
    assert torch.equal(ours.params["embedding"], source.params["embedding"])
    if init == "exact_source_task":
        assert torch.equal(ours.params["prefix_task_cols"][0], source.params["prefix_task_cols"][2])


@pytest.mark.parametrize("name", ["prompt_tuning", "adaption_prompt"])
def test_activation_checkpointing_recomputes_with_the_prompt(name):
    """Backward recomputes each checkpointed decoder layer: with the prompt's attention (adaption
    prompt) applied again there, the gradients equal the ones without checkpointing."""
    _, _, prompt = peft_model(name, "llama")
    plain = model64("llama")
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()
    grads = []
    for model in (plain, checkpointed):
        out = lf.adapted_call(model, prompt, IDS, attention_mask=RIGHT_PADDED)
        grads.append(torch.autograd.grad(ce(out.logits), list(prompt.params.values())))
    assert all(rel(a, b) < RTOL and b.abs().max() > 0 for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("name", ["prompt_tuning", "prefix_tuning"])
def test_inputs_embeds_instead_of_input_ids(name):
    model = model64("llama")
    prompt, _ = _pair(name)
    embeds = model.get_input_embeddings()(IDS).detach()
    want = lf.adapted_call(model, prompt, IDS, attention_mask=RIGHT_PADDED).logits
    assert rel(lf.adapted_call(model, prompt, inputs_embeds=embeds, attention_mask=RIGHT_PADDED).logits, want) < RTOL
