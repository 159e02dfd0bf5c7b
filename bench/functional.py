"""What the functional design buys: per-example gradients, mixed-adapter batches, ensembles.

One tiny Llama (hidden 256, 4 layers, batch 16 x 64 tokens, LoRA r=8 on q_proj/v_proj by
default), CPU, one run:

1. per-example gradients: ``lora_func.per_example_grads`` (``vmap(grad)``) against the
   batched backward of the same loss, a Python loop, and, when installed, peft + ``vmap(grad)``
   and Opacus (``GradSampleModule`` hooks) on a peft model with the same weights;
2. mixed-adapter batches: 16 distinct adapters in one batch (``mixed_call``) against one
   adapter for the whole batch, forward and training step, and peft's ``adapter_names``
   (inference only) against peft with one adapter;
3. ensembles: ``ensemble_call`` over K adapters, peak allocated CPU memory of the lazy path
   against the merged one (which builds K merged copies of every target weight).

Timings are interleaved rounds (each round runs every method once) and each ratio is the
median over rounds of the per-round ratio, so a machine whose load drifts during the run
(shared CI runners) biases every method alike. The default clock is this process's CPU time
on one thread (``--clock cpu --threads 1``): on a shared machine other processes then cost
nothing; ``--clock wall --threads N`` measures elapsed time on N threads.

Run: python bench/functional.py [--rounds 15] [--clock cpu|wall] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

import lora_func as lf
from lora_func.many import ensemble_call, mixed_call, per_example_grads

TARGETS = ["q_proj", "v_proj"]


def build(hidden: int, layers: int, vocab: int, seed: int = 0) -> LlamaForCausalLM:
    # vmap needs eager attention (lora_func.many).
    return c.gqa_llama(hidden, layers, vocab, attention="eager", seed=seed, max_position_embeddings=256, use_cache=False)


def token_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over examples of each example's mean next-token cross-entropy on its real tokens."""
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return (per_token.sum(1) / (labels != -100).sum(1)).mean()


def perturbed(adapter: lf.Adapter, seed: int) -> lf.Adapter:
    """The adapter with small random non-zero params (a trained-looking adapter, B != 0)."""
    g = torch.Generator().manual_seed(seed)
    return adapter.with_params({k: (0.02 * torch.randn(v.shape, generator=g)).requires_grad_() for k, v in adapter.params.items()})


clock = c.CLOCKS["cpu"]


def peak_allocated(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on the CPU while ``fn`` runs (torch profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as handle:
            events = json.load(handle)["traceEvents"]
    return max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)


def per_example_section(model, adapter, ids, mask, r, alpha, rounds):
    base = lf.base_params(model)
    params = {k: v.detach() for k, v in adapter.params.items()}

    def loss(a, ids_, mask_):
        return token_loss(lf.adapted_call(model, a, ids_, attention_mask=mask_, base=base).logits, ids_, mask_)

    def batched():
        return grad(lambda p: loss(adapter.with_params(p), ids, mask))(params)

    leaves = {k: v.detach().requires_grad_(True) for k, v in adapter.params.items()}

    def batched_backward():
        for leaf in leaves.values():
            leaf.grad = None
        loss(adapter.with_params(leaves), ids, mask).backward()

    def vmap_grad():
        f = grad(lambda p, i, m: loss(adapter.with_params(p), i[None], m[None]))
        return vmap(f, in_dims=(None, 0, 0))(params, ids, mask)

    def loop():
        return [grad(lambda p: loss(adapter.with_params(p), ids[i : i + 1], mask[i : i + 1]))(params) for i in range(len(ids))]  # noqa: B023 (called at once)

    reference = "lora_func batched .backward()"
    methods = {
        reference: batched_backward,
        "lora_func batched torch.func.grad": batched,
        "lora_func per_example_grads": lambda: per_example_grads(loss, adapter, ids, mask),
        "lora_func vmap(grad) (the torch.func idiom)": vmap_grad,
        "lora_func Python loop over examples": loop,
    }
    references = {name: reference for name in methods if name != reference}
    try:
        peft = c.peft_named_adapters(model, [adapter], r, alpha, TARGETS)
    except ImportError:
        peft = None
        print("peft not installed: no peft columns")
    if peft is not None:
        trainable = {n: p for n, p in peft.named_parameters() if p.requires_grad}

        def peft_loss(p, ids_, mask_):
            return token_loss(functional_call(peft, p, (ids_,), {"attention_mask": mask_}).logits, ids_, mask_)

        def peft_backward():
            for p in trainable.values():
                p.grad = None
            token_loss(peft(ids, attention_mask=mask).logits, ids, mask).backward()

        detached = {n: p.detach() for n, p in trainable.items()}
        methods["peft batched backward"] = peft_backward
        methods["peft + vmap(grad) per example"] = lambda: vmap(
            grad(lambda p, i, m: peft_loss(p, i[None], m[None])), in_dims=(None, 0, 0)
        )(detached, ids, mask)
        references["peft + vmap(grad) per example"] = "peft batched backward"
        try:
            import opacus
            from opacus import GradSampleModule
        except ImportError:
            print("opacus not installed: no Opacus column")
        else:
            gsm = GradSampleModule(c.peft_named_adapters(model, [adapter], r, alpha, TARGETS).train(), loss_reduction="mean")  # hooks record in train mode only

            def opacus_step():
                gsm.zero_grad(set_to_none=True)
                token_loss(gsm(ids, attention_mask=mask).logits, ids, mask).backward()
                return [p.grad_sample for p in gsm.parameters() if p.requires_grad]

            methods[f"opacus {opacus.__version__} GradSampleModule (peft model)"] = opacus_step
            references[f"opacus {opacus.__version__} GradSampleModule (peft model)"] = "peft batched backward"
    times = c.timed_rounds(methods, rounds, clock)
    c.print_paired_table(f"Per-example gradients, batch {tuple(ids.shape)} (target: per_example_grads <= 1.10x batched backward)", times, references)
    return c.paired_ratio(times, "lora_func per_example_grads", reference)


def mixed_section(model, adapters, ids, mask, r, alpha, rounds):
    base = lf.base_params(model)
    stacked = lf.stack(adapters)
    index = torch.arange(len(ids)) % len(adapters)
    one = adapters[0]

    def single_forward():
        with torch.no_grad():
            return lf.adapted_call(model, one, ids, attention_mask=mask, base=base).logits

    def mixed_forward():
        with torch.no_grad():
            return mixed_call(model, stacked, index, ids, attention_mask=mask, base=base).logits

    def single_train():
        f = lambda p: token_loss(lf.adapted_call(model, one.with_params(p), ids, attention_mask=mask, base=base).logits, ids, mask)
        return grad(f)({k: v.detach() for k, v in one.params.items()})

    def mixed_train():
        def f(p):
            logits = mixed_call(model, stacked.with_params(p), index, ids, attention_mask=mask, base=base).logits
            return token_loss(logits, ids, mask)

        return grad(f)({k: v.detach() for k, v in stacked.params.items()})

    n = len(adapters)
    methods = {
        "lora_func one adapter, forward": single_forward,
        f"lora_func {n} adapters mixed_call, forward": mixed_forward,
        "lora_func one adapter, grad step": single_train,
        f"lora_func {n} adapters mixed_call, grad step": mixed_train,
    }
    references = {
        f"lora_func {n} adapters mixed_call, forward": "lora_func one adapter, forward",
        f"lora_func {n} adapters mixed_call, grad step": "lora_func one adapter, grad step",
    }
    try:
        peft = c.peft_named_adapters(model, adapters, r, alpha, TARGETS)
    except ImportError:
        peft = None
    if peft is not None:
        names = [f"a{int(i)}" for i in index]

        def peft_single():
            with torch.no_grad():
                return peft(ids, attention_mask=mask).logits

        def peft_mixed():
            with torch.no_grad():
                return peft(ids, attention_mask=mask, adapter_names=names).logits

        methods["peft one adapter, forward"] = peft_single
        methods[f"peft {n} adapters adapter_names, forward"] = peft_mixed
        references[f"peft {n} adapters adapter_names, forward"] = "peft one adapter, forward"
    times = c.timed_rounds(methods, rounds, clock)
    c.print_paired_table(f"Mixed-adapter batch, {n} distinct adapters, batch {tuple(ids.shape)} (target <= 1.10x one adapter)", times, references)
    return c.paired_ratio(times, f"lora_func {n} adapters mixed_call, forward", "lora_func one adapter, forward")


def ensemble_section(model, adapters, ids, mask) -> None:
    base = lf.base_params(model)
    stacked = lf.stack(adapters)
    k = len(adapters)
    target_bytes = sum(base[layer.target.weight_key].nbytes for layer in adapters[0].layers)

    def run(merged: bool):
        with torch.no_grad():
            return ensemble_call(model, stacked, ids, attention_mask=mask, base=base, merged=merged).logits

    lazy, merged = peak_allocated(lambda: run(False)), peak_allocated(lambda: run(True))
    print(f"\nEnsemble of K={k} adapters, batch {tuple(ids.shape)}: peak allocated CPU memory during ensemble_call")
    print(f"  lazy overlay (default) {lazy / 2**20:8.1f} MiB")
    print(f"  merged weights         {merged / 2**20:8.1f} MiB")
    print(f"  K merged copies of the {len(adapters[0].layers)} target weights would be {k * target_bytes / 2**20:.1f} MiB")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.add_interleaved_args(parser, rounds=15)
    args = parser.parse_args(argv)
    global clock
    clock = c.CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    if args.quick:
        hidden, layers, vocab, size, length, rounds, k = 32, 1, 61, 4, 8, 1, 2
    else:
        hidden, layers, vocab, size, length, rounds, k = 256, 4, 512, 16, 64, 7, 8
        rounds = args.rounds
    r, alpha = 8 if not args.quick else 2, 16.0
    model = build(hidden, layers, vocab)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.clock} clock; Llama hidden {hidden}, {layers} layers, "
          f"vocab {vocab}; LoRA r={r} on {TARGETS}; {rounds} interleaved rounds")
    spec = lf.AdapterSpec("lora", targets=TARGETS, r=r, alpha=alpha)
    adapters = [perturbed(lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(i)), i) for i in range(size)]
    ids, mask = c.left_padded_batch(size, length, vocab)
    results = {
        "per_example_over_batched": per_example_section(model, adapters[0], ids, mask, r, alpha, rounds),
        "mixed_over_single": mixed_section(model, adapters, ids, mask, r, alpha, rounds),
    }
    ensemble_section(model, adapters[:k], ids[:2], mask[:2])
    print(f"\nsummary: {json.dumps({key: round(value, 3) for key, value in results.items()})}")
    return results


if __name__ == "__main__":
    c.reexec_with_steady_allocator()
    main()
