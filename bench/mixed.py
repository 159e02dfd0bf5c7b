"""Many adapters in one batch, inside the target layers: 16 sequences with 16 distinct adapters
against the same batch with one adapter, forward, training step and generation; peft's
``adapter_names`` alongside.

One tiny Llama (hidden 256, 4 layers, vocab 2048, SDPA attention), a batch of 16 left-padded
sequences of 64 tokens, LoRA r=8 on q_proj/v_proj, CPU, one run:

- forward: ``lora_func.mixed_call`` (row ``b`` with adapter ``b``) vs
  ``lora_func.adapted_call`` with one adapter (the lazy path, the same low-rank products
  unbatched); peft ``model(..., adapter_names=[...])`` vs peft with its active adapter;
- training step: forward, loss, ``loss.backward()`` into the 16 adapters' leaves vs into one
  adapter's (peft's ``adapter_names`` is inference-only: no peft row);
- generation of 32 new tokens (greedy, KV cache): ``with lora_func.mixed_adapted(...)`` vs
  ``with lora_func.adapted(model, one, merged=False)`` (lazy, the fair reference: the same
  per-token adapter products) and ``merged=True`` (no adapter cost at all, shown for scale);
  peft ``generate(adapter_names=...)`` vs peft with one adapter.

Timings are interleaved rounds (each round runs every method once), each ratio the median over
rounds of the per-round ratio. Default clock: this process's CPU time on one thread.

``--variant dora`` (any registered variant) measures the ``vmap`` path of the other variants
(no peft rows then).

Run: python bench/mixed.py [--rounds 9] [--clock cpu|wall] [--threads 1] [--variant lora] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

import lora_func as lf

TARGETS = ["q_proj", "v_proj"]


def build(hidden: int, layers: int, vocab: int, seed: int = 0) -> LlamaForCausalLM:
    # The route leaves attention alone: the model's default (SDPA).
    return c.gqa_llama(
        hidden, layers, vocab, attention="sdpa", seed=seed, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )


def batch(size: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A serving batch: left padding, pad positions holding token 0."""
    ids, mask = c.left_padded_batch(size, length, vocab)
    return ids.masked_fill(mask == 0, 0), mask


def token_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten())


def tenant(model: LlamaForCausalLM, spec: lf.AdapterSpec, seed: int) -> lf.Adapter:
    """A trained-looking adapter (B != 0), leaves that require grad."""
    adapter = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(1000 + seed)
    return adapter.with_params({k: (0.02 * torch.randn(v.shape, generator=g)).requires_grad_() for k, v in adapter.params.items()})


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    c.add_interleaved_args(parser, rounds=9)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--variant", default="lora", help="a registered variant without calibration data (not eva); peft rows for lora only")
    parser.add_argument("--no-peft", action="store_true")
    args = parser.parse_args(argv)
    clock = c.CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    if args.quick:
        hidden, layers, vocab, size, length, rounds, r, new_tokens = 32, 1, 61, 4, 8, 1, 2, 3
    else:
        hidden, layers, vocab, size, length, rounds, r, new_tokens = 256, 4, 2048, 16, 64, args.rounds, 8, args.new_tokens
    alpha = 16.0
    model = build(hidden, layers, vocab)
    spec = lf.AdapterSpec(args.variant, targets=TARGETS, r=r, alpha=alpha)
    adapters = [tenant(model, spec, seed) for seed in range(size)]
    one = adapters[0]
    index = torch.arange(size)  # sequence b -> adapter b: every adapter distinct
    ids, mask = batch(size, length, vocab)
    base = lf.base_params(model)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.clock} clock; Llama hidden {hidden}, "
          f"{layers} layers, vocab {vocab}, sdpa attention; {args.variant} r={r} on {TARGETS}; batch {size} x {length} tokens "
          f"(left-padded), {size} distinct adapters; {rounds} interleaved rounds")

    def forward_one():
        with torch.no_grad():
            return lf.adapted_call(model, one, ids, attention_mask=mask, base=base).logits

    def forward_mixed():
        with torch.no_grad():
            return lf.mixed_call(model, adapters, index, ids, attention_mask=mask, base=base, batching="layers").logits

    def train_one():
        for t in one.params.values():
            t.grad = None
        token_loss(lf.adapted_call(model, one, ids, attention_mask=mask, base=base).logits, ids, mask).backward()

    def train_mixed():
        for a in adapters:
            for t in a.params.values():
                t.grad = None
        token_loss(lf.mixed_call(model, adapters, index, ids, attention_mask=mask, base=base, batching="layers").logits, ids, mask).backward()

    generation = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}

    def generate_with(context: Callable[[], object]) -> Callable[[], torch.Tensor]:
        def run():
            with torch.no_grad(), context():
                return model.generate(ids, attention_mask=mask, **generation)

        return run

    methods = {
        "lora_func one adapter, forward": forward_one,
        f"lora_func {size} adapters mixed_call, forward": forward_mixed,
        "lora_func one adapter, training step": train_one,
        f"lora_func {size} adapters mixed_call, training step": train_mixed,
        "lora_func one adapter lazy, generate": generate_with(lambda: lf.adapted(model, one, merged=False)),
        "lora_func one adapter merged, generate": generate_with(lambda: lf.adapted(model, one)),
        f"lora_func {size} adapters mixed_adapted, generate": generate_with(lambda: lf.mixed_adapted(model, adapters, index)),
    }
    references = {
        f"lora_func {size} adapters mixed_call, forward": "lora_func one adapter, forward",
        f"lora_func {size} adapters mixed_call, training step": "lora_func one adapter, training step",
        "lora_func one adapter merged, generate": "lora_func one adapter lazy, generate",
        f"lora_func {size} adapters mixed_adapted, generate": "lora_func one adapter lazy, generate",
    }
    peft = None
    if not args.no_peft and args.variant == "lora":
        try:
            peft = c.peft_named_adapters(model, adapters, r, alpha, TARGETS)
        except ImportError:
            print("peft not installed: no peft rows")
    if peft is not None:
        names = [f"a{int(i)}" for i in index]

        def peft_forward(**kw):
            def run():
                with torch.no_grad():
                    return peft(ids, attention_mask=mask, **kw).logits

            return run

        def peft_generate(**kw):
            def run():
                with torch.no_grad():
                    return peft.generate(input_ids=ids, attention_mask=mask, **generation, **kw)

            return run

        methods["peft one adapter, forward"] = peft_forward()
        methods[f"peft {size} adapters adapter_names, forward"] = peft_forward(adapter_names=names)
        methods["peft one adapter, generate"] = peft_generate()
        methods[f"peft {size} adapters adapter_names, generate"] = peft_generate(adapter_names=names)
        references["peft one adapter, forward"] = "lora_func one adapter, forward"
        references[f"peft {size} adapters adapter_names, forward"] = "peft one adapter, forward"
        references["peft one adapter, generate"] = "lora_func one adapter lazy, generate"
        references[f"peft {size} adapters adapter_names, generate"] = "peft one adapter, generate"
        # Correctness of what is timed: both routes serve every sequence with its own adapter.
        with torch.no_grad():
            ours = forward_mixed()
            theirs = methods[f"peft {size} adapters adapter_names, forward"]()
        print(f"max |lora_func mixed - peft adapter_names| logits: {(ours - theirs).abs().max():.1e}")

    times = c.timed_rounds(methods, rounds, clock)
    c.print_paired_table(
        f"{size} sequences, {size} distinct adapters vs one adapter (target: mixed <= 1.10x one adapter for forward and "
        f"generation, and ahead of peft)",
        times,
        references,
    )
    results = {
        "forward_mixed_over_one": c.paired_ratio(times, f"lora_func {size} adapters mixed_call, forward", "lora_func one adapter, forward"),
        "train_mixed_over_one": c.paired_ratio(times, f"lora_func {size} adapters mixed_call, training step", "lora_func one adapter, training step"),
        "generate_mixed_over_one_lazy": c.paired_ratio(times, f"lora_func {size} adapters mixed_adapted, generate", "lora_func one adapter lazy, generate"),
        "generate_mixed_over_one_merged": c.paired_ratio(times, f"lora_func {size} adapters mixed_adapted, generate", "lora_func one adapter merged, generate"),
    }
    if peft is not None:
        results["forward_mixed_over_peft_mixed"] = c.paired_ratio(
            times, f"lora_func {size} adapters mixed_call, forward", f"peft {size} adapters adapter_names, forward"
        )
        results["generate_mixed_over_peft_mixed"] = c.paired_ratio(
            times, f"lora_func {size} adapters mixed_adapted, generate", f"peft {size} adapters adapter_names, generate"
        )
        results["peft_forward_mixed_over_one"] = c.paired_ratio(times, f"peft {size} adapters adapter_names, forward", "peft one adapter, forward")
        results["peft_generate_mixed_over_one"] = c.paired_ratio(times, f"peft {size} adapters adapter_names, generate", "peft one adapter, generate")
    print(f"\nsummary: {json.dumps({key: round(value, 3) for key, value in results.items()})}")
    return results


if __name__ == "__main__":
    c.reexec_with_steady_allocator()
    main()
