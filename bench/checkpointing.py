"""What autograd keeps for backward with activation checkpointing: a deterministic count.

Bytes of the distinct storages saved for backward during one training forward (weights,
adapter tensors and the input embeddings excluded: what the step adds), for the frozen base
and for LoRA (lazy and merged overlay, the module-call route, and peft), each without and with
HF gradient checkpointing (non-reentrant). With checkpointing a decoder layer keeps only its
input; everything inside it, the adapter's low-rank path included, is recomputed in backward.

Target: LoRA with checkpointing keeps at most 1.2x what the frozen base keeps with
checkpointing. Counts, not timings: the same on any machine.

    python bench/checkpointing.py            # hidden 256, 8 layers, 8 x 512 tokens, bf16 base
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

import lora_func as lf

TARGET = 1.2


def saved_bytes(s: c.Setup, forward, exclude) -> int:
    return c.saved_tensor_bytes(forward, [*s.base.values(), *exclude, s.embeds])


def measure(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """``{row: (bytes without checkpointing, bytes with)}``."""
    s = c.build_setup(args)
    model = s.model.train()  # HF checkpoints only in training mode (the model has no dropout)
    adapter = c.our_adapter(s, "lora", args.rank)
    peft_model = c.peft_model(s, "lora", args.rank) if args.peft else None
    kwargs = {"inputs_embeds": s.embeds, "use_cache": False}

    rows = {
        "frozen base": (lambda: model(**kwargs).logits.float().sum(), ()),
        "lora lazy (overlay)": (lambda: lf.adapted_call(model, adapter, base=s.base, **kwargs).logits.float().sum(), adapter.params.values()),
        "lora merged (overlay)": (
            lambda: lf.adapted_call(model, adapter, base=s.base, merged=True, **kwargs).logits.float().sum(),
            adapter.params.values(),
        ),
        "lora lazy (module-call route)": (
            lambda: lf.adapted_call(model, adapter, base=s.base, route="module", **kwargs).logits.float().sum(),
            adapter.params.values(),
        ),
    }
    if peft_model is not None:
        peft_model.train()
        rows["peft lora"] = (lambda: peft_model(**kwargs).logits.float().sum(), list(peft_model.parameters()))
    out = {}
    for name, (forward, exclude) in rows.items():
        counts = []
        for on in (False, True):
            for m in (model, peft_model):
                if m is None:
                    continue
                if on:
                    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
                else:
                    m.activation_checkpointing_disable()
            counts.append(saved_bytes(s, forward, list(exclude)))
        out[name] = (counts[0], counts[1])
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_model_args(parser)
    parser.set_defaults(dtype="bfloat16", layers=8, seq=512)
    parser.add_argument("--no-peft", dest="peft", action="store_false", help="leave out the peft row")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    c.setup(args)
    counts = measure(args)
    base_on = counts["frozen base"][1]
    print(f"# {c.machine_line(args)}; hidden {args.hidden}, {args.layers} layers, {args.batch} x {args.seq} tokens, LoRA r={args.rank} on q,v")
    print("| configuration | saved, no checkpointing | saved, checkpointing | / frozen base with checkpointing |")
    print("|---|---|---|---|")
    worst = 0.0
    for name, (off, on) in counts.items():
        ratio = on / base_on
        if name.startswith("lora"):
            worst = max(worst, ratio)
        print(f"| {name} | {c.fmt_bytes(off)} | {c.fmt_bytes(on)} | {ratio:.3f} |")
    verdict = "HOLDS" if worst <= TARGET else "FAILS"
    print(f"# target: lora with checkpointing <= {TARGET}x the frozen base with checkpointing: {worst:.3f} -> {verdict}")
    return 0 if verdict == "HOLDS" else 1


if __name__ == "__main__":
    sys.exit(main())
