"""``torch.compile`` of the adapted training step: does it trace with ``fullgraph=True``, how
much faster is it, and does it recompile when only the adapter's values change?

Compiles the function that calls ``functional_call`` (the loss of an adapter's params), as
DESIGN.md recommends, for:

- ``merged``: ``functional_call(model, merge_overlay(base, adapter.with_params(p)), ...)``;
- ``lazy``: the same with ``overlay`` (``AdaptedWeight`` stand-ins, made with
  ``Tensor._make_wrapper_subclass``, which dynamo cannot trace: reported, not timed);
- ``lazy adapted_call``: ``lf.adapted_call(model, adapter, ...)``, which under ``torch.compile``
  runs the lazy path as a torch-function mode over the base tensors
  (``lora_func._lazy.AdaptedCalls``); dynamo traces it with ``fullgraph=True``.

Then it times eager vs compiled steps (interleaved, medians) with the frozen base compiled
too, and calls each compiled step with fresh adapter values under
``torch._dynamo.config.error_on_recompile = True``.

    python bench/compile.py
    python bench/compile.py --device cuda --dtype bfloat16 --hidden 2048 --layers 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

import lora_func as lf


def make_loss(s: c.Setup, adapter: Any, path: str):
    model, base = s.model, s.base

    def loss_fn(params: dict, embeds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ad = adapter.with_params(params)
        kwargs = {"inputs_embeds": embeds}
        if path == "lazy adapted_call":
            out = lf.adapted_call(model, ad, base=base, **kwargs)
        else:
            make = lf.merge_overlay if path == "merged" else lf.overlay
            out = torch.func.functional_call(model, make(base, ad), (), kwargs, tie_weights=True, strict=False)
        return c.loss_of(out.logits, labels)

    return loss_fn


def grads_of(loss_fn, params: dict, s: c.Setup) -> tuple:
    loss = loss_fn(params, s.embeds, s.labels)
    return torch.autograd.grad(loss, [s.embeds, *params.values()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_model_args(parser)
    parser.add_argument("--variants", default="lora,dora,hra")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--clock", default="cpu", choices=("wall", "cpu"))
    args = parser.parse_args(argv)
    c.setup(args)
    import torch._dynamo

    s = c.build_setup(args)
    print(f"# torch.compile of the adapted training step; {c.machine_line(args)}; {args.clock} clock")
    print(f"# Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} x {args.seq}, r={args.rank}")
    print()

    base_model, embeds, labels = s.model, s.embeds, s.labels

    def base_loss(e: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return c.loss_of(base_model(inputs_embeds=e).logits, y)

    compiled_base = torch.compile(base_loss, fullgraph=True)
    t0 = time.perf_counter()
    torch.autograd.grad(compiled_base(embeds, labels), [embeds])
    print(f"frozen base: compiled (fullgraph) in {time.perf_counter() - t0:.0f} s")
    steps = {
        "base eager": lambda: torch.autograd.grad(base_loss(embeds, labels), [embeds]),
        "base compiled": lambda: torch.autograd.grad(compiled_base(embeds, labels), [embeds]),
    }
    rows = []
    for row in args.variants.split(","):
        adapter = c.our_adapter(s, row, args.rank)
        params = adapter.params
        for path in ("merged", "lazy", "lazy adapted_call"):
            loss_fn = make_loss(s, adapter, path)
            compiled = torch.compile(loss_fn, fullgraph=True)
            t0 = time.perf_counter()
            try:
                # A new dict, not adapter.params itself: called with the closure adapter's own
                # dict, dynamo guards on that aliasing ("adapter.params is params") and
                # recompiles once on the first different dict.
                got = grads_of(compiled, dict(params), s)
            except Exception as err:  # noqa: BLE001 - the finding is the error
                text = " ".join(str(err).split())
                reason = "`Tensor._make_wrapper_subclass` is not traceable" if "_make_wrapper_subclass" in text else text[:160]
                rows.append(f"| {row} | {path} | no ({type(err).__name__}: {reason}) | — | — |")
                torch._dynamo.reset()
                continue
            secs = time.perf_counter() - t0
            want = grads_of(loss_fn, params, s)
            err = max(float((g - w).abs().max() / w.abs().max().clamp(min=1e-30)) for g, w in zip(got, want))
            # Fresh adapter values (same shapes): must reuse the compiled graph.
            torch._dynamo.config.error_on_recompile = True
            recompiled = "none"
            try:
                for k in range(3):
                    fresh = {n: (v.detach() + 0.01 * (k + 1)).requires_grad_(True) for n, v in params.items()}
                    grads_of(compiled, fresh, s)
            except Exception as e:  # noqa: BLE001
                recompiled = f"yes ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})"
            finally:
                torch._dynamo.config.error_on_recompile = False
            rows.append(f"| {row} | {path} | yes ({secs:.0f} s to compile) | {err:.1e} | {recompiled} |")
            steps[f"{row} {path} eager"] = lambda f=loss_fn, p=params: grads_of(f, p, s)
            steps[f"{row} {path} compiled"] = lambda f=compiled, p=params: grads_of(f, p, s)
    print()
    print("| variant | path | fullgraph=True traces | max rel. grad diff vs eager | recompiles on new adapter values |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    stats, noise = c.interleaved_ratios(steps, "base eager", rounds=args.rounds, warmup=1, device=s.device, seed=args.seed)
    base_c = stats["base compiled"].median
    print(f"## step time (ms, median of {args.rounds} interleaved rounds; base noise {noise:.1%})")
    print()
    print("| step | eager ms | compiled ms | compile speed-up | ratio to frozen base (eager / compiled) |")
    print("|---|---|---|---|---|")
    print(f"| frozen base | {stats['base eager'].ms:.1f} | {stats['base compiled'].ms:.1f} | {1 / base_c:.2f}x | 1 / 1 |")
    for name in steps:
        if not name.endswith(" eager") or name == "base eager":
            continue
        stem = name.removesuffix(" eager")
        e, k = stats[name], stats[f"{stem} compiled"]
        print(f"| {stem} | {e.ms:.1f} | {k.ms:.1f} | {e.median / k.median:.2f}x | {e.median:.3f} / {k.median / base_c:.3f} |")
    return 0


if __name__ == "__main__":
    c.reexec_with_steady_allocator()
    raise SystemExit(main())
