"""README's first paragraph, kept true: after every public call that runs the model, also one that
raises inside the model, the model's forwards and ``torch.utils.checkpoint``'s functions are
torch's own again, nothing is left in a module's ``__dict__``, and no application stays active.
(While a call runs, the module-call route swaps target modules' ``forward`` and the checkpoint
re-entry hook replaces two names of ``torch.utils.checkpoint``: README, "What lora_func changes
while a call runs".)"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import lora_func as lf
from lora_func import _application
from lora_func.train import TrainState, make_optimizer, train_step
from tests.models import tiny_model, tokens

GENERATOR = torch_checkpoint._checkpoint_without_reentrant_generator
FUNCTION = torch_checkpoint.CheckpointFunction
CHECKPOINT = torch_checkpoint.checkpoint


def _state(model: torch.nn.Module) -> list:
    """What must be the same before and after a call: the checkpoint names, every module's
    class forward and instance dict entries named forward."""
    return [
        torch_checkpoint._checkpoint_without_reentrant_generator,
        torch_checkpoint.CheckpointFunction,
        torch_checkpoint.checkpoint,
        *((name, type(m).forward, "forward" in m.__dict__, "prepare_inputs_for_generation" in m.__dict__) for name, m in model.named_modules()),
    ]


def _setup(checkpointing: bool = False):
    model = tiny_model("llama")
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    spec = lf.AdapterSpec("lora", targets=["q_proj", "v_proj"], r=2)
    a = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))
    b = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(1))
    return model, a, b


def _train_step(model, a, b, ids):
    train_step(model, TrainState(a.detach(), make_optimizer(a.detach(), 1e-3)), {"input_ids": ids})


def _generate(model, a, b, ids):
    with torch.no_grad(), lf.adapted(model, a, merged=False, route="module"):
        model.generate(ids[:1, :4], max_new_tokens=2, do_sample=False)


def _mixed_generate(model, a, b, ids):
    with torch.no_grad(), lf.mixed_adapted(model, [a, b], [0, 1]):
        model.generate(ids[:2, :4], max_new_tokens=2, do_sample=False)


def _prompt(model, method="prompt_tuning", **options):
    return lf.init_prompt(model, lf.PromptSpec(method, 2, **options), generator=torch.Generator().manual_seed(0))


def _prompt_generate(model, a, b, ids):
    with torch.no_grad(), lf.adapted(model, lf.compose(_prompt(model, "prefix_tuning"), a)):
        model.generate(ids[:1, :4], max_new_tokens=2, do_sample=False)


def _mixed_prompt_generate(model, a, b, ids):
    p = _prompt(model)
    with torch.no_grad(), lf.mixed_adapted(model, [p, p.with_params({"embedding": p.params["embedding"] + 1})], [0, 1]):
        model.generate(ids[:2, :4], max_new_tokens=2, do_sample=False)


def _poly(model):
    spec = lf.AdapterSpec("poly", targets=["q_proj", "v_proj"], r=2, n_tasks=3, n_skills=2, init_weights=False)
    return lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(0))


def _routed_generate(model, a, b, ids):
    with torch.no_grad(), lf.routed.task_adapted(model, _poly(model), torch.tensor([2, 0])):
        model.generate(ids[:2, :4], max_new_tokens=2, do_sample=False)


CALLS = {
    "adapted_call overlay": lambda model, a, b, ids: lf.adapted_call(model, a, ids).logits.sum().backward(),
    "adapted_call module": lambda model, a, b, ids: lf.adapted_call(model, a, ids, route="module").logits.sum().backward(),
    "adapted_call merged": lambda model, a, b, ids: lf.adapted_call(model, a, ids, merged=True),
    "adapted (generate)": _generate,
    "mixed_call": lambda model, a, b, ids: lf.mixed_call(model, [a, b], [0, 1], ids[:2], batching="layers").logits.sum().backward(),
    "mixed_adapted (generate)": _mixed_generate,
    "ensemble_call": lambda model, a, b, ids: lf.ensemble_call(model, lf.stack([a, b]), ids, randomness="different").logits.sum().backward(),
    "ensemble_call vmap": lambda model, a, b, ids: lf.ensemble_call(model, lf.stack([a, b]), ids, batching="vmap", use_cache=False),
    "mixed_call": lambda model, a, b, ids: lf.mixed_call(model, lf.stack([a, b]), [0, 1], ids[:2]),
    "train_step": _train_step,
    "prompt adapted_call": lambda model, a, b, ids: lf.adapted_call(model, _prompt(model), ids, labels=ids).loss.backward(),
    "adaption prompt + lora adapted_call": lambda model, a, b, ids: lf.adapted_call(
        model, lf.compose(_prompt(model, "adaption_prompt", adapter_layers=2), a), ids).logits.sum().backward(),
    "prompt adapted (generate)": _prompt_generate,
    "prompt mixed_adapted (generate)": _mixed_prompt_generate,
    "routed task_call": lambda model, a, b, ids: lf.routed.task_call(model, _poly(model), ids[:2], task_ids=torch.tensor([1, 2])).logits.sum().backward(),
    "routed task_adapted (generate)": _routed_generate,
    "arrow adapted_call": lambda model, a, b, ids: lf.adapted_call(model, lf.routed.arrow([a, b], top_k=1), ids).logits.sum().backward(),
    "xlora_call": lambda model, a, b, ids: lf.routed.xlora_call(model, lf.routed.xlora([a, b], hidden_size=model.config.hidden_size), ids).logits.sum().backward(),
}


# Calls without a backward: checkpointing recomputes nothing there, so they run once, plain.
NO_BACKWARD = ("adapted (generate)", "mixed_adapted (generate)", "ensemble_call vmap", "mixed_call", "prompt adapted (generate)",
               "prompt mixed_adapted (generate)", "routed task_adapted (generate)")
CASES = [(call, False) for call in sorted(CALLS)] + [(call, True) for call in sorted(CALLS) if call not in NO_BACKWARD]


@pytest.mark.parametrize(("call", "checkpointing"), CASES, ids=[f"{c}-{'checkpointing' if on else 'plain'}" for c, on in CASES])
def test_after_every_call_the_model_and_torch_checkpoint_are_untouched(call, checkpointing):
    model, a, b = _setup(checkpointing)
    before = _state(model)
    assert before[:3] == [GENERATOR, FUNCTION, CHECKPOINT]
    seen_inside = []
    original_forward = type(model.model.layers[0].self_attn.q_proj).forward

    def spy(module, args):
        # While the call runs, the hook is in place (the hook is what is documented).
        seen_inside.append(torch_checkpoint.CheckpointFunction is not FUNCTION)

    handle = model.model.layers[0].self_attn.register_forward_pre_hook(spy)
    try:
        CALLS[call](model, a, b, tokens())
    finally:
        handle.remove()
    assert _state(model) == before
    assert type(model.model.layers[0].self_attn.q_proj).forward is original_forward
    assert not _application.active_applications()
    if call != "ensemble_call vmap":  # (under vmap the hook runs inside the transform: not observed by a module hook)
        assert seen_inside and all(seen_inside), "the checkpoint hook is in place during an adapted call"


class Boom(Exception):
    pass


@pytest.mark.parametrize("route", ["overlay", "module", "mixed"])
def test_a_call_that_raises_inside_the_model_leaves_nothing_behind(route):
    model, a, b = _setup()
    before = _state(model)

    def explode(module, args):
        # Inside the call: the route's changes are on the model now.
        if route != "overlay":
            assert "forward" in model.model.layers[0].self_attn.q_proj.__dict__
        assert torch_checkpoint.CheckpointFunction is not FUNCTION
        raise Boom

    handle = model.model.layers[1].register_forward_pre_hook(explode)
    try:
        with pytest.raises(Boom):
            if route == "mixed":
                lf.mixed_call(model, [a, b], [0, 1], tokens()[:2], batching="layers")
            else:
                lf.adapted_call(model, a, tokens(), route=route)
    finally:
        handle.remove()
    assert _state(model) == before
    assert not _application.active_applications()
    assert torch_checkpoint._checkpoint_without_reentrant_generator is GENERATOR and torch_checkpoint.CheckpointFunction is FUNCTION
