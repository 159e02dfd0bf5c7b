"""QLoRA: memory and step time of LoRA on a 4-bit (nf4) base, against the bf16 base and peft.

One run, side by side, on one Llama with random weights (built from a config, saved, and
loaded back with bitsandbytes' nf4 quantization, double quantization, bf16 compute):

- bytes the base holds (every parameter and buffer storage, quantization state included):
  nf4 against the same model in bf16;
- bytes autograd keeps for backward during one LoRA training step (a deterministic count):
  lora_func against peft on the same nf4 model, and on the bf16 model;
- the peak memory of a whole step: on CUDA ``torch.cuda.max_memory_allocated``; on the CPU the
  process's peak resident set (``VmHWM``, reset with ``/proc/self/clear_refs`` after the models
  are built), in a fresh process per configuration so that one cannot inherit another's peak;
- the step time of lora_func over peft's on the nf4 model: median of interleaved rounds with
  its 95 % confidence interval.

    python bench/qlora.py                                  # CPU: hidden 256, 4 layers
    python bench/qlora.py --device cuda --hidden 2048 --layers 16 --vocab 32000 --seq 1024   # ~1B
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

import lora_func as lf


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage the model holds (parameters, buffers, quantization state)."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if isinstance(t, torch.Tensor) and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()

    for t in [*model.parameters(), *model.buffers()]:
        add(t)
        state = getattr(t, "quant_state", None)
        if state is not None:
            for value in state.as_dict(packed=True).values():
                add(value)
    return sum(seen.values())


def models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the bf16 model, the same weights loaded in nf4)."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    bf16 = c.build_model(args)
    with tempfile.TemporaryDirectory() as directory, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf16.save_pretrained(directory)
        quant = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16
        )
        nf4 = LlamaForCausalLM.from_pretrained(directory, quantization_config=quant, dtype=torch.bfloat16, attn_implementation="sdpa")
    return bf16, nf4.to(args.device).eval()


def steps(s: c.Setup, model: torch.nn.Module, rank: int, args: argparse.Namespace) -> dict[str, c.Step]:
    """lora_func's and peft's LoRA training step on ``model``."""
    setup = c.Setup(model, lf.base_params(model), s.embeds, s.labels, s.calib_ids, s.dtype, s.device)
    adapter = c.our_adapter(setup, "lora", rank)
    ours = c.Step(
        lambda: c.loss_of(lf.adapted_call(model, adapter, inputs_embeds=s.embeds, base=setup.base).logits, s.labels),
        [s.embeds, *adapter.params.values()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = c.peft_model(setup, "lora", rank)
    return {"lora_func": ours, "peft": c.peft_step(setup, peft_model)}


PEAK_CONFIGS = ("nf4:lora_func", "nf4:peft", "bf16:lora_func")


def cpu_peak(args: argparse.Namespace, config: str) -> tuple[int, int]:
    """(resident bytes before one step of ``config``, peak resident bytes while it runs): the
    models are built, the other base freed, the high-water mark reset, one step run."""
    bf16, nf4 = models(args)
    s = c.build_setup(args, model=bf16)
    base, name = config.split(":")
    step = steps(s, nf4 if base == "nf4" else bf16, args.rank, args)[name]
    other = bf16 if base == "nf4" else nf4
    for p in [*other.parameters(), *other.buffers()]:  # not this configuration's base: free it
        p.data = torch.empty(0, dtype=p.dtype)
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = c.vm_bytes("VmRSS")
    step.step()
    return before, c.vm_bytes("VmHWM")


def _peak_in_child(argv: list[str], config: str) -> tuple[int, int] | None:
    import subprocess

    out = subprocess.run(
        [sys.executable, __file__, *argv, "--peak-child", config], capture_output=True, text=True, check=False
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("peak ")]
    return (int(lines[-1].split()[1]), int(lines[-1].split()[2])) if lines else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.add_model_args(parser)
    parser.set_defaults(dtype="bfloat16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-peak", dest="peak", action="store_false", help="skip the CPU peak measurement (3 child processes)")
    parser.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    c.setup(args)
    if args.peak_child:
        print("peak {} {}".format(*cpu_peak(args, args.peak_child)))
        return 0
    c.set_clock("wall")
    bf16, nf4 = models(args)
    s = c.build_setup(args, model=bf16)
    nf4_steps = steps(s, nf4, args.rank, args)
    bf16_steps = steps(s, bf16, args.rank, args)
    device = torch.device(args.device)
    print(f"# {c.machine_line(args)}; hidden {args.hidden}, {args.layers} layers, {args.batch} x {args.seq} tokens, LoRA r={args.rank} on q,v")
    base_bf16, base_nf4 = held_bytes(bf16), held_bytes(nf4)
    print(f"# base held: bf16 {c.fmt_bytes(base_bf16)}, nf4 {c.fmt_bytes(base_nf4)} ({base_nf4 / base_bf16:.3f} of bf16)")
    print("| base | step | saved for backward | peak (CUDA) |")
    print("|---|---|---|---|")
    for base_name, table in (("nf4", nf4_steps), ("bf16", bf16_steps)):
        for name, step in table.items():
            saved = c.saved_tensor_bytes(step.forward, [*step.inputs])
            peak = c.fmt_bytes(c.cuda_peak_bytes(step.step)) if device.type == "cuda" else "n/a (CPU)"
            print(f"| {base_name} | {name} | {c.fmt_bytes(saved)} | {peak} |")
    if device.type == "cpu" and args.peak and Path("/proc/self/clear_refs").exists():
        child_argv = [a for a in argv if a != "--no-peak"]
        peaks = {config: _peak_in_child(child_argv, config) for config in PEAK_CONFIGS}
        cells = "; ".join(
            f"{k} {c.fmt_bytes(v[1])} (resident before the step {c.fmt_bytes(v[0])}, step +{c.fmt_bytes(v[1] - v[0])})" if v else f"{k} failed"
            for k, v in peaks.items()
        )
        print(f"# CPU peak resident memory of one step, whole process: {cells}")
    stats, noise = c.interleaved_ratios(
        {"peft": nf4_steps["peft"].step, "lora_func": nf4_steps["lora_func"].step}, "peft", rounds=args.rounds, warmup=args.warmup, device=device
    )
    ours = stats["lora_func"]
    lo, hi = ("-inf" if math.isinf(ours.lo) else f"{ours.lo:.3f}"), ("inf" if math.isinf(ours.hi) else f"{ours.hi:.3f}")
    print(f"# step time on nf4, lora_func / peft: {ours.median:.3f} [{lo}, {hi}] ({ours.ms:.1f} ms vs {stats['peft'].ms:.1f} ms; peft noise {noise:.1%})")
    return 0


if __name__ == "__main__":
    c.reexec_with_steady_allocator()
    sys.exit(main())
