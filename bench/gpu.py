"""The GPU table (issue 46): every method against the frozen base and HF peft on one CUDA device, in
one prepared run that ends within a time budget (8 minutes on an H200 by default).

A bf16 Llama of about 1B parameters built from a config with random weights (Llama 3.2 1B's layout:
hidden 2048, 16 layers, 32 heads of 64 with 8 key/value heads, MLP 8192, tied embeddings; vocab
32000; 1.04 B parameters; no download), adapters fp32
(the default dtype policy), r = 8. Six sections, run in this order of priority (the budget skips
what no longer fits, with a printed line):

1. ``train``: every registered method on q, k, v, o, gate, up, down (LN tuning: the two norms
   of each layer; peft's where peft has it) at the GPU-bound size 8 x 2048 tokens: the training
   step (bench/_common.py: forward, loss over every position, backward to the adapter and the
   input embeddings) over the frozen base's, lazy and merged, peft's, and the peak memory of a
   step over the base's. The first ``--core`` methods run first, the rest after the other
   sections (``rest``).
   ``launch``: a representative subset at the launch-bound size 8 x 256, eager and
   ``torch.compile``d (lora_func's steps through ``adapted_call``, which compiles with
   ``fullgraph=True``; the base and peft compiled as modules).
2. ``ensemble``: K = 8 LoRA adapters trained at once (``ensemble_call``) against 8 separate
   ``adapted_call`` steps, at 8 x 256 tokens per member and at 2 x 2048 (8 x 2048 per member
   would hold 8 times the activations of section 1's step: over the device's memory).
3. ``private``: ``private_grads`` with the batched loss against the non-private step, and
   Opacus's ``GradSampleModule`` (hooks and functorch modes) with the same clipping and noise on
   a peft model of the same LoRA, at both sizes.
4. ``serve``: greedy generation, a batch of 8 left-padded prompts with a different LoRA per
   row (``mixed_adapted``) against one adapter for every row (lazy and merged) and against
   peft's mixed batch (``generate(adapter_names=...)``), tokens per second.
5. ``pretrained``: the pretrained model the project ships (lora_func/demo/assets) as one more
   training row (a larger real model cannot be downloaded: the device reaches no network and
   nothing here downloads weights).
6. ``liger``: LoRA on a copy of the model patched by liger-kernel (fused RMSNorm, SwiGLU, rotary
   and linear cross-entropy), lazy and merged, and peft's LoRA on it: the loss equals the
   unpatched model's, and the step time; or the precise reason it cannot run.

Timing: wall clock around ``torch.cuda.synchronize()``; the configurations of a row are timed
in interleaved rounds (a fresh order each round, the base re-timed around them:
``_common.interleaved_ratios``); each cell is the median over rounds of the per-round ratio,
with the spread (lowest and highest round) in brackets. A verdict is "holds"/"fails" only when
the whole spread is on one side of the limit, else "unresolved". Each row fails on its own: an
error prints in its row and the run goes on. The tables print as they fill and are rewritten to
``--out`` after every section.

    python bench/gpu.py --out gpu_table.md              # on the device (docs/benchmarks.md: device run)
    python bench/gpu.py --smoke                         # every section on the CPU at tiny size (CI)
    python bench/gpu.py --sections train --methods lora,dora --budget 120
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

START = time.perf_counter()

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# This checkout's lora_func (on the device machine it is not installed), then bench/'s modules.
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c  # noqa: E402

import lora_func as lf  # noqa: E402
ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
# Section 1's order: the first --core run before the other sections, the rest after them; the
# inits that take an SVD of every weight (or a k-means) last, as their init is slow on 112 targets.
PRIORITY = (
    "lora", "dora", "ia3", "vera", "oft", "loha", "hra", "adalora",
    "delora", "ia3_ff", "lokr", "boft", "gralora", "miss", "road", "hira", "c3a", "shira", "fourierft", "waveft",
    "randlora", "vblora", "pvera", "tinylora", "unilora", "ln_tuning", "olora", "eva", "pissa",
    "lora_ga", "corda", "loftq", "mica", "adamss", "antipasto", "kasa",
)
# At run time peft's step for these inits is its plain LoRA on the base its init changed (or
# quantized): their peft column is peft's LoRA (the step does not depend on the values).
PEFT_AS_LORA = ("pissa", "olora", "corda", "lora_ga", "loftq")
# Options for the GPU run: PiSSA's randomized SVD (peft's "pissa_niter_4"; the same step, an init
# in milliseconds instead of a full SVD of each of 112 weights).
GPU_OPTIONS: dict[str, dict[str, Any]] = {"pissa": {"niter": 4}}
REPRESENTATIVE = ("lora", "dora", "ia3", "vera", "oft", "loha")
SECTIONS = ("train", "launch", "ensemble", "private", "serve", "pretrained", "rest", "liger")
SMOKE_METHODS = ("lora", "dora", "ia3", "vera", "ln_tuning", "pissa")

# Targets (issue 46, on the H200).
LORA_LAZY_LIMIT = 1.06  # LoRA lazy over the frozen base, GPU-bound
LAUNCH_COMPILED_LIMIT = 1.10  # every representative compiled over the compiled base, launch-bound
ENSEMBLE_LIMITS = {"launch": 0.3, "gpu": 1.0}  # K at once over K separate steps
PRIVATE_LIMIT = 1.10  # private step over the non-private one
SERVE_LIMIT = 0.8  # per-row serving throughput over one adapter's


# ------------------------------------------------------------------------------ sizes


def sizes(smoke: bool) -> dict[str, Any]:
    """Model and step sizes: the ~1B model on the device, a tiny one for ``--smoke``."""
    if smoke:
        return {"hidden": 64, "layers": 1, "heads": 4, "kv_heads": 2, "mlp": 160, "vocab": 128, "rank": 4,
                "gpu": (2, 32), "launch": (2, 8), "ens_launch": (2, 8), "ens_gpu": (1, 32), "prompt": (4, 8), "new_tokens": 3}
    # Llama 3.2 1B's layout (MLP 8192, 8 key/value heads, tied embeddings) with a 32k vocabulary.
    return {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "mlp": 8192, "vocab": 32000, "rank": 8,
            "gpu": (8, 2048), "launch": (8, 256), "ens_launch": (8, 256), "ens_gpu": (2, 2048), "prompt": (8, 128), "new_tokens": 64}


def build_llama(z: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The benchmark Llama, random weights from ``seed``, built on ``device`` directly (a 1B model
    initialised on the CPU would take most of a minute), frozen, eval mode, SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=z["vocab"], hidden_size=z["hidden"], intermediate_size=z["mlp"], num_hidden_layers=z["layers"],
        num_attention_heads=z["heads"], num_key_value_heads=z["kv_heads"], max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    return model


def setup_for(model: torch.nn.Module, batch: int, seq: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> c.Setup:
    ns = argparse.Namespace(batch=batch, seq=seq, vocab=model.config.vocab_size, seed=seed, device=str(device), dtype=str(dtype).removeprefix("torch."))
    return c.build_setup(ns, model=model)


# ------------------------------------------------------------------------------ budget


class RowTimeout(Exception):
    """A row ran past its time limit (``--row-limit`` or what its section had left)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`RowTimeout` in this (main) thread after ``seconds``; a no-op where signals
    cannot (another thread, no SIGALRM). Python checks for the signal between bytecodes, so a long
    kernel call ends first."""
    usable = hasattr(signal, "SIGALRM") and hasattr(signal, "setitimer") and seconds > 0
    if usable:
        try:
            previous = signal.signal(signal.SIGALRM, _raise_timeout)
        except ValueError:  # not the main thread
            usable = False
    if not usable:
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _raise_timeout(signum: int, frame: Any) -> None:
    raise RowTimeout("over its time limit")


class Budget:
    """The run's deadline (``--budget`` seconds after the script started) and each section's."""

    def __init__(self, total: float, row_limit: float) -> None:
        self.deadline = START + total
        self.row_limit = row_limit
        self.section_deadline = self.deadline

    def left(self) -> float:
        return min(self.deadline, self.section_deadline) - time.perf_counter()

    def start_section(self, cap: float, reserve: float) -> float:
        """Begin a section allowed ``cap`` seconds, keeping ``reserve`` for the sections after
        it; returns the seconds it has."""
        now = time.perf_counter()
        self.section_deadline = min(now + cap, self.deadline - reserve)
        return self.section_deadline - now

    def fits(self, estimate: float) -> bool:
        return self.left() >= estimate

    def row(self) -> contextlib.AbstractContextManager[None]:
        return time_limit(max(1.0, min(self.row_limit, self.left())))


def short_error(error: BaseException) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text[:220].replace("|", "/")


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ report


class Report:
    """The Markdown the run prints and writes: a header, then per section its lines, in order."""

    def __init__(self, path: Path | None, header: list[str]) -> None:
        self.path = path
        self.parts: dict[str, list[str]] = {"header": header}
        self.order = ["header"]
        print("\n".join(header), flush=True)

    def add(self, section: str, *lines: str) -> None:
        if section not in self.parts:
            self.parts[section] = []
            self.order.append(section)
        self.parts[section].extend(lines)
        for line in lines:
            print(line, flush=True)

    def write(self) -> None:
        if self.path is None:
            return
        text = "\n".join("\n".join(self.parts[s]) for s in self.order) + "\n"
        self.path.write_text(text)


def _run(command: Sequence[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=20, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def header_lines(args: argparse.Namespace, z: dict[str, Any], device: torch.device) -> list[str]:
    import peft
    import transformers

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[:1] or ["unknown (no nvidia-smi)"]
        where = f"{name}, {total:.0f} GiB; driver {driver[0]}; CUDA {torch.version.cuda}; cuDNN {torch.backends.cudnn.version()}"
    else:
        where = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    commit = _run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]) or "unknown"
    versions = [f"torch {torch.__version__}", f"transformers {transformers.__version__}", f"peft {peft.__version__}"]
    for name in ("opacus", "liger_kernel", "triton"):
        versions.append(f"{name} {_version(name)}")
    gb = z["gpu"]
    lb = z["launch"]
    return [
        f"# lora_func GPU table{' (--smoke: tiny sizes on the CPU, not a measurement)' if args.smoke else ''}",
        "",
        f"- run: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}, lora_func {commit}, "
        f"Python {platform.python_version()}",
        f"- device: {where}",
        f"- software: {', '.join(versions)}",
        f"- model: Llama, random weights, hidden {z['hidden']}, {z['layers']} layers, {z['heads']} heads / {z['kv_heads']} "
        f"key-value heads, MLP {z['mlp']}, vocab {z['vocab']}, SDPA, bf16 base, fp32 adapters, r = {z['rank']}",
        f"- sizes: GPU-bound {gb[0]} x {gb[1]} tokens, launch-bound {lb[0]} x {lb[1]}; {args.rounds} interleaved rounds; "
        f"budget {args.budget:.0f} s, row limit {args.row_limit:.0f} s",
        "- cells: median over rounds of the per-round ratio [lowest, highest round]; memory: peak allocated during "
        f"one step over the frozen base's{' (CPU: bytes saved for backward over the base)' if device.type != 'cuda' else ''}",
        "",
    ]


def _version(module: str) -> str:
    from importlib import metadata

    for name in (module, module.replace("_", "-")):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def cell(values: Sequence[float] | None) -> str:
    if not values:
        return "—"
    med, lo, hi = spread(values)
    return f"{med:.3f} [{lo:.3f}, {hi:.3f}]"


def verdict(values: Sequence[float], limit: float, *, at_least: bool = False) -> str:
    """``holds`` / ``fails`` when every round is on one side of ``limit``, else ``unresolved``."""
    lo, hi = min(values), max(values)
    if at_least:
        return "holds" if lo >= limit else "fails" if hi < limit else "unresolved"
    return c.verdict(lo, hi, limit)


# ------------------------------------------------------------------------------ measuring


def memory_of(step: c.Step, exclude: Sequence[torch.Tensor], device: torch.device) -> int:
    """Peak CUDA memory of one step over what was allocated before it; on the CPU, the bytes the
    forward saves for backward (``exclude``: weights, adapter tensors, inputs). Runs the step."""
    if device.type == "cuda":
        return c.cuda_peak_bytes(step.step)
    return c.saved_tensor_bytes(step.forward, exclude)


def gib(n: float, device: torch.device | None = None) -> str:
    """Bytes in GiB (MiB on the CPU, whose tiny --smoke sizes would all read +0.00 GiB)."""
    if device is not None and device.type != "cuda":
        return f"{n / 2**20:+.3f} MiB"
    return f"{n / 2**30:+.2f}"


def timed_group(steps: dict[str, Callable[[], Any]], baseline: str, rounds: int, device: torch.device) -> dict[str, c.RatioStats]:
    """Interleaved rounds (every step warmed up once before)."""
    stats, _noise = c.interleaved_ratios(steps, baseline, rounds=rounds, warmup=0, device=device, base_every=3)
    return stats


def try_step(name: str, make: Callable[[], tuple[c.Step, list[torch.Tensor]]], device: torch.device,
             steps: dict[str, Callable[[], Any]], memory: dict[str, int], errors: dict[str, str]) -> None:
    """Build one configuration and run it once (its memory measurement, which warms it up); an
    error is recorded for its cell and the configuration left out of the timing."""
    try:
        step, exclude = make()
        memory[name] = memory_of(step, exclude, device)
        steps[name] = step.step
    except RowTimeout:
        raise
    except Exception as error:  # fail-soft: the error is the row's finding
        errors[name] = short_error(error)


# ------------------------------------------------------------------------------ section 1: every method


def method_targets(method: str) -> tuple[str, ...]:
    return NORMS if method == "ln_tuning" else ALL7


def peft_for(s: c.Setup, method: str, rank: int, targets: Sequence[str], adapter: Any) -> torch.nn.Module | None:
    if method in PEFT_AS_LORA:
        return c.peft_model(s, "lora", rank, targets=targets)
    return c.peft_model(s, method, rank, targets=targets, adapter=adapter)


def train_rows(ctx: Context, methods: Sequence[str], section: str) -> None:
    """Section 1 at the GPU-bound size: one Markdown row per method."""
    rep, s, budget = ctx.report, ctx.gpu, ctx.budget
    if section not in ctx.report.parts:
        rep.add(section, "", f"## 1. Every method, GPU-bound: {s.embeds.shape[0]} x {s.embeds.shape[1]} tokens, targets q,k,v,o,gate,up,down",
                "", "Step time over the frozen base's (median [lowest, highest round]); lazy/peft paired per round; "
                f"peak memory over the base's, GiB. Targets: lazy <= peft on time and memory; LoRA lazy <= {LORA_LAZY_LIMIT}.",
                "", "| method | init s | lazy | merged | peft | lazy / peft | memory lazy / merged / peft | targets |",
                "|---|---|---|---|---|---|---|---|")
        ctx.base_memory = memory_of(c.base_step(s), [*s.base.values(), s.embeds], ctx.device)
    estimate = 10.0
    for method in methods:
        if not budget.fits(estimate):
            rep.add(section, f"| {method} | skipped: the budget's time ran out (needs ~{estimate:.0f} s, {max(budget.left(), 0):.0f} s left) | | | | | | |")
            ctx.skipped.append(method)
            continue
        began = time.perf_counter()
        try:
            with budget.row():
                line = train_row(ctx, method)
        except Exception as error:  # one method's failure is its row
            line = f"| {method} | error: {short_error(error)} | | | | | | |"
        finally:
            free(ctx.device)
        rep.add(section, line)
        estimate = max(estimate * 0.5, time.perf_counter() - began)
    rep.write()


def train_row(ctx: Context, method: str) -> str:
    s, device, rank = ctx.gpu, ctx.device, ctx.z["rank"]
    targets = method_targets(method)
    t0 = time.perf_counter()
    adapter = c.our_adapter(s, method, rank, targets=targets, options_override=GPU_OPTIONS.get(method))
    c._sync(device)
    init_s = time.perf_counter() - t0
    steps: dict[str, Callable[[], Any]] = {"base": c.base_step(s).step}
    memory: dict[str, int] = {}
    errors: dict[str, str] = {}
    own = [*s.base.values(), s.embeds, *adapter.params.values(), *adapter.buffers.values()]
    for path in ("lazy", "merged"):
        try_step(path, lambda p=path: (c.our_step(s, adapter, merged=p == "merged"), own), device, steps, memory, errors)
    pm = None
    try:
        pm = peft_for(s, method, rank, targets, adapter)
    except RowTimeout:
        raise
    except Exception as error:
        errors["peft"] = short_error(error)
    if pm is not None:
        try_step("peft", lambda: (c.peft_step(s, pm), [*pm.parameters(), *pm.buffers(), s.embeds]), device, steps, memory, errors)
    stats = timed_group(steps, "base", ctx.args.rounds, device) if len(steps) > 1 else {}

    def shown(name: str) -> str:
        if name in errors:
            return f"error: {errors[name]}"
        if name == "peft" and pm is None:
            return "— (peft has none)"
        return cell(stats[name].samples) if name in stats else "—"

    paired = []
    if "lazy" in stats and "peft" in stats:
        paired = [a / b for a, b in zip(stats["lazy"].samples, stats["peft"].samples, strict=True)]
    mem = " / ".join("—" if p not in memory else gib(memory[p] - ctx.base_memory, device) for p in ("lazy", "merged", "peft"))
    checks = []
    if paired:
        checks.append(f"time {verdict(paired, 1.0)}")
        checks.append(f"memory {'holds' if memory['lazy'] <= memory['peft'] else 'fails'}")
    if method == "lora" and "lazy" in stats:
        checks.append(f"lazy <= {LORA_LAZY_LIMIT}: {verdict(stats['lazy'].samples, LORA_LAZY_LIMIT)}")
    base_ms = f" (base {stats['base'].ms:.1f} ms)" if method == PRIORITY[0] and "base" in stats else ""
    return (f"| {method}{base_ms} | {init_s:.1f} | {shown('lazy')} | {shown('merged')} | {shown('peft')} | {cell(paired)} | {mem} | "
            f"{'; '.join(checks) or '—'} |")


# ------------------------------------------------------------------------------ section 1: launch-bound, compiled


def launch_rows(ctx: Context) -> None:
    rep, device, rank = ctx.report, ctx.device, ctx.z["rank"]
    section = "launch"
    s = setup_for(ctx.model, *ctx.z["launch"], device, ctx.dtype)
    smoke_note = " (--smoke compiles the merged and peft paths only: the lazy path's trace is tests/test_compile.py's)" if ctx.args.smoke else ""
    rep.add(section, "", f"## 1b. Launch-bound: {s.embeds.shape[0]} x {s.embeds.shape[1]} tokens, eager and torch.compile "
            f"({ctx.args.compile_backend})", "",
            "Eager: step over the eager frozen base's. Compiled: lora_func through `adapted_call` under "
            "`torch.compile(fullgraph=True)`, the base likewise, peft's model (first method only) with `torch.compile` as its users call it; "
            "each over the compiled base's; "
            f"compile s: first two calls of each (lazy / merged / peft){smoke_note}. "
            f"Target: every representative compiled <= {LAUNCH_COMPILED_LIMIT} x the compiled base.", "",
            "| method | eager lazy | eager merged | eager peft | compiled lazy | compiled merged | compiled peft | compile s | target |",
            "|---|---|---|---|---|---|---|---|---|")
    # Compiled variants of one function are recompilations of one code object: room for all of
    # them (put back, with dynamo's caches emptied, when the section ends).
    limits = {n: getattr(torch._dynamo.config, n) for n in ("cache_size_limit", "recompile_limit") if hasattr(torch._dynamo.config, n)}
    try:
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, max(64, value))
        compiled_rows(ctx, s, section, rank)
    finally:
        torch._dynamo.reset()
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, value)
    rep.write()


def compiled_rows(ctx: Context, s: c.Setup, section: str, rank: int) -> None:
    """The rows of :func:`launch_rows`: the frozen base, then each representative."""
    rep, budget, device = ctx.report, ctx.budget, ctx.device
    # One eager adapted_call first: lora_func resolves torch.distributed's FSDPModule type lazily
    # into a module dict, and a first call that resolves it while compiling makes its second call
    # recompile the whole step (docs/benchmarks.md, "The GPU table").
    with torch.no_grad():
        warm = c.our_adapter(s, "lora", rank, targets=("q_proj",))
        lf.adapted_call(ctx.model, warm, base=s.base, inputs_embeds=s.embeds[:, :2])
    compiled_base: Callable[[], Any] | None = None
    compile_estimate = 5.0 if ctx.args.smoke else 60.0
    t0 = time.perf_counter()
    try:
        with budget.row():
            compiled_base = compiled_base_step(s, ctx.args.compile_backend)
            compiled_base()
            compiled_base()
        compile_estimate = max(compile_estimate * 0.5, time.perf_counter() - t0)
        rep.add(section, f"| (frozen base) | eager {1e3 * timed_once(c.base_step(s).step, device):.1f} ms | | | compiled "
                f"{1e3 * timed_once(compiled_base, device):.1f} ms | | | {time.perf_counter() - t0:.0f} | |")
    except Exception as error:
        rep.add(section, f"| (frozen base) | | | | compile error: {short_error(error)} | | | | |")
        compiled_base = None
        torch._dynamo.reset()
    methods = [m for m in REPRESENTATIVE if ctx.methods is None or m in ctx.methods]
    if ctx.args.smoke:
        methods = methods[:2]
    for i, method in enumerate(methods):
        if not budget.fits(3.0):
            rep.add(section, f"| {method} | skipped: the budget's time ran out | | | | | | | |")
            continue
        try:
            line = launch_row(ctx, s, method, rank, compiled_base if i == 0 or not ctx.args.smoke else None, compile_estimate)
        except Exception as error:
            line = f"| {method} | error: {short_error(error)} | | | | | | | |"
        finally:
            free(device)
        rep.add(section, line)


def timed_once(fn: Callable[[], Any], device: torch.device) -> float:
    fn()
    return min(c.timed(fn, device) for _ in range(2))


def compiled_base_step(s: c.Setup, backend: str) -> Callable[[], Any]:
    model = s.model

    def loss(embeds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return c.loss_of(model(inputs_embeds=embeds).logits, labels)

    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    return lambda: torch.autograd.grad(compiled(s.embeds, s.labels), [s.embeds])


def compiled_adapted_step(s: c.Setup, adapter: Any, merged: bool, backend: str) -> Callable[[], Any]:
    model, base = s.model, s.base

    def loss(params: dict[str, torch.Tensor], embeds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = lf.adapted_call(model, adapter.with_params(params), base=base, merged=merged, inputs_embeds=embeds)
        return c.loss_of(out.logits, labels)

    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    params = adapter.params
    # a new dict each call: called with the adapter's own dict, dynamo guards on that aliasing
    return lambda: torch.autograd.grad(compiled(dict(params), s.embeds, s.labels), [s.embeds, *params.values()])


def compiled_peft_step(s: c.Setup, pm: torch.nn.Module, backend: str) -> Callable[[], Any]:
    trainable = [p for p in pm.parameters() if p.requires_grad]

    def loss(embeds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return c.loss_of(pm(inputs_embeds=embeds).logits, labels)

    # as peft's users compile it: graph breaks allowed (they are part of its compiled cost)
    compiled = torch.compile(loss, backend=backend)
    return lambda: torch.autograd.grad(compiled(s.embeds, s.labels), [s.embeds, *trainable])


def launch_row(ctx: Context, s: c.Setup, method: str, rank: int, compiled_base: Callable[[], Any] | None, compile_estimate: float) -> str:
    """One representative: its eager steps (under the row limit), then each compiled path under
    its own limit (a compile that runs out of time costs that cell, not the row)."""
    device, backend, budget = ctx.device, ctx.args.compile_backend, ctx.budget
    targets = method_targets(method)
    eager: dict[str, Callable[[], Any]] = {"base": c.base_step(s).step}
    errors: dict[str, str] = {}
    memory: dict[str, int] = {}
    with budget.row():
        adapter = c.our_adapter(s, method, rank, targets=targets, options_override=GPU_OPTIONS.get(method))
        own = [*s.base.values(), s.embeds, *adapter.params.values(), *adapter.buffers.values()]
        for path in ("lazy", "merged"):
            try_step(path, lambda p=path: (c.our_step(s, adapter, merged=p == "merged"), own), device, eager, memory, errors)
        pm = None
        try:
            pm = peft_for(s, method, rank, targets, adapter)
            if pm is not None:
                try_step("peft", lambda: (c.peft_step(s, pm), [*pm.parameters(), *pm.buffers(), s.embeds]), device, eager, memory, errors)
        except RowTimeout:
            raise
        except Exception as error:
            errors["peft"] = short_error(error)
        stats = timed_group(eager, "base", ctx.args.rounds, device) if len(eager) > 1 else {}
    compiled: dict[str, Callable[[], Any]] = {}
    compile_s: list[str] = []
    if compiled_base is not None:
        compiled["base"] = compiled_base
        makers: dict[str, Callable[[], Callable[[], Any]]] = {}
        if not ctx.args.smoke:
            makers["lazy"] = lambda: compiled_adapted_step(s, adapter, False, backend)
        makers["merged"] = lambda: compiled_adapted_step(s, adapter, True, backend)
        if pm is not None and method == REPRESENTATIVE[0]:
            makers["peft"] = lambda: compiled_peft_step(s, pm, backend)
        for path, make in makers.items():
            if not budget.fits(compile_estimate + 2.0):
                errors[f"c-{path}"] = f"skipped: no time left to compile (~{compile_estimate:.0f} s)"
                compile_s.append("—")
                continue
            t0 = time.perf_counter()
            try:
                with budget.row():
                    fn = make()
                    fn()
                    fn()  # a second call: any recompilation the first call triggers happens here, untimed
                compiled[path] = fn
            except Exception as error:  # RowTimeout included: that cell only
                # (no dynamo reset: it would drop the compiled base, whose recompilation costs as much)
                errors[f"c-{path}"] = short_error(error)
            compile_s.append(f"{time.perf_counter() - t0:.0f}")
            compile_estimate = max(compile_estimate, time.perf_counter() - t0)
    cstats = {}
    if len(compiled) > 1:
        with budget.row():
            cstats = timed_group(compiled, "base", ctx.args.rounds, device)

    def shown(name: str, table: dict[str, c.RatioStats], key: str) -> str:
        if key in errors:
            return errors[key] if errors[key].startswith("skipped") else f"error: {errors[key]}"
        return cell(table[name].samples) if name in table else "—"

    checks = [f"{p} {verdict(cstats[p].samples, LAUNCH_COMPILED_LIMIT)}" for p in ("lazy", "merged") if p in cstats]
    return (f"| {method} | {shown('lazy', stats, 'lazy')} | {shown('merged', stats, 'merged')} | {shown('peft', stats, 'peft')} | "
            f"{shown('lazy', cstats, 'c-lazy')} | {shown('merged', cstats, 'c-merged')} | {shown('peft', cstats, 'c-peft')} | "
            f"{' / '.join(compile_s) or '—'} | {'; '.join(checks) or '—'} |")


# ------------------------------------------------------------------------------ section 2: K adapters at once


def tenants(model: torch.nn.Module, k: int, rank: int, targets: Sequence[str] = ALL7) -> list[Any]:
    """``k`` LoRA adapters with B != 0 (leaves that require grad), on the model's device."""
    spec = lf.AdapterSpec("lora", targets=list(targets), r=rank, alpha=2 * rank)
    out = []
    for i in range(k):
        a = lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(i))
        g = torch.Generator().manual_seed(1000 + i)
        out.append(a.with_params({n: (v.detach() + 0.02 * torch.randn(v.shape, generator=g).to(v)).requires_grad_(True) for n, v in a.params.items()}))
    return out


def ensemble_rows(ctx: Context) -> None:
    from ensemble import _loss, _member_losses

    rep, device, budget, model = ctx.report, ctx.device, ctx.budget, ctx.model
    section = "ensemble"
    k = 8
    rep.add(section, "", f"## 2. K = {k} LoRA adapters trained at once vs {k} separate steps", "",
            f"`ensemble_call` (rows repeated per member, each member inside the target layers) against {k} `adapted_call` steps; "
            "tokens per member. Targets: <= 0.3 launch-bound, <= 1.0 GPU-bound.", "",
            "| size | ensemble ms | 8 separate ms | ensemble / separate | peak ensemble / separate | target |", "|---|---|---|---|---|---|")
    adapters = tenants(model, k, ctx.z["rank"])
    stacked = lf.stack([a.detach() for a in adapters])
    base = lf.base_params(model)
    for kind, (batch, seq) in (("launch", ctx.z["ens_launch"]), ("gpu", ctx.z["ens_gpu"])):
        if not budget.fits(5.0):
            rep.add(section, f"| {batch} x {seq} | skipped: the budget's time ran out | | | | |")
            continue
        try:
            with budget.row():
                ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(7)).to(device)

                def ensemble(ids: torch.Tensor = ids) -> None:
                    logits = lf.ensemble_call(model, stacked, ids, base=base, use_cache=False).logits
                    _member_losses(logits, ids).sum().backward()
                    for t in stacked.params.values():
                        t.grad = None

                def separate(ids: torch.Tensor = ids) -> None:
                    for a in adapters:
                        _loss(lf.adapted_call(model, a, ids, base=base, use_cache=False).logits, ids).backward()
                        for t in a.params.values():
                            t.grad = None

                peaks = {n: peak(fn, device) for n, fn in (("ensemble", ensemble), ("separate", separate))}
                stats = timed_group({"separate": separate, "ensemble": ensemble}, "separate", ctx.args.rounds, device)
                ratio = stats["ensemble"].samples
                limit = ENSEMBLE_LIMITS[kind]
                line = (f"| {batch} x {seq} ({kind}-bound) | {stats['ensemble'].ms:.1f} | {stats['separate'].ms:.1f} | {cell(ratio)} | "
                        f"{peaks['ensemble'] / max(peaks['separate'], 1):.2f} | <= {limit}: {verdict(ratio, limit)} |")
        except Exception as error:
            line = f"| {batch} x {seq} | error: {short_error(error)} | | | | |"
        finally:
            free(device)
        rep.add(section, line)
    rep.write()


def peak(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak CUDA memory of one call over what was allocated before (runs ``fn``); 1 on the CPU."""
    if device.type == "cuda":
        return c.cuda_peak_bytes(fn)
    fn()
    return 1


# ------------------------------------------------------------------------------ section 3: private step


def private_rows(ctx: Context) -> None:
    from privacy import C, SIGMA

    rep, device, budget, model, rank = ctx.report, ctx.device, ctx.budget, ctx.model, ctx.z["rank"]
    section = "private"
    rep.add(section, "", "## 3. The private step (DP-SGD) vs the non-private step and Opacus", "",
            f"`private_grads` (batched loss, clipping `auto`, C = {C}, sigma = {SIGMA}) over lora_func's non-private step; Opacus "
            "`GradSampleModule` on a peft model of the same LoRA (hooks / functorch) + the same clipping and noise, over "
            f"`private_grads`. Targets: private <= {PRIVATE_LIMIT}; Opacus / private > 1 (ahead of both).", "",
            "| tokens | private / non-private | Opacus hooks / private | Opacus functorch / private | peft non-private / ours | peak private / non-private | targets |",
            "|---|---|---|---|---|---|---|")
    (adapter,) = tenants(model, 1, rank)
    noise = torch.Generator(device=device).manual_seed(0) if device.type == "cuda" else torch.Generator().manual_seed(0)
    for batch, seq in (ctx.z["launch"], ctx.z["gpu"]):
        if not budget.fits(8.0):
            rep.add(section, f"| {batch} x {seq} | skipped: the budget's time ran out | | | | | |")
            continue
        try:
            with budget.row():
                line = private_row(ctx, adapter, noise, batch, seq)
        except Exception as error:  # a size's failure is its row
            line = f"| {batch} x {seq} | error: {short_error(error)} | | | | | |"
        finally:
            free(device)
        rep.add(section, line)
    rep.write()


def private_row(ctx: Context, adapter: Any, noise: torch.Generator, batch: int, seq: int) -> str:
    from privacy import C, SIGMA, opacus_clip_and_noise, token_losses

    from lora_func.privacy import batched_loss

    device, model, rank = ctx.device, ctx.model, ctx.z["rank"]
    base = lf.base_params(model)
    ids, mask = c.left_padded_batch(batch, seq, model.config.vocab_size)
    ids, mask = ids.to(device), mask.to(device)
    leaves = {k: v.detach().requires_grad_(True) for k, v in adapter.params.items()}
    live = adapter.with_params(leaves)

    def example_losses(a: Any, ids_: torch.Tensor, mask_: torch.Tensor) -> torch.Tensor:
        return token_losses(lf.adapted_call(model, a, ids_, attention_mask=mask_, base=base).logits, ids_, mask_)

    batched = batched_loss(example_losses)

    def non_private() -> Any:
        return torch.autograd.grad(example_losses(live, ids, mask).mean(), list(leaves.values()))

    def private() -> Any:
        return lf.private_grads(batched, live, ids, mask, max_grad_norm=C, noise_multiplier=SIGMA, generator=noise)

    methods: dict[str, Callable[[], Any]] = {"non-private": non_private, "private": private}
    errors: dict[str, str] = {}
    pm = c.peft_named_adapters(model, [adapter], rank, 2 * rank, ALL7)
    peft_params = [p for p in pm.parameters() if p.requires_grad]
    methods["peft"] = lambda: torch.autograd.grad(token_losses(pm(ids, attention_mask=mask).logits, ids, mask).mean(), peft_params)
    gsms: list[Any] = []
    try:
        try:
            from opacus import GradSampleModule
        except ImportError as error:
            errors["hooks"] = errors["functorch"] = f"not run: {short_error(error)}"
        else:
            for mode, functorch in (("hooks", False), ("functorch", True)):
                try:
                    gsm = GradSampleModule(c.peft_named_adapters(model, [adapter], rank, 2 * rank, ALL7).train(),
                                           loss_reduction="mean", force_functorch=functorch)
                    gsms.append(gsm)

                    def opacus_step(gsm: Any = gsm) -> Any:
                        gsm.zero_grad(set_to_none=True)
                        token_losses(gsm(ids, attention_mask=mask).logits, ids, mask).mean().backward()
                        return opacus_clip_and_noise_on(gsm, batch, noise, opacus_clip_and_noise)

                    opacus_step()
                    methods[mode] = opacus_step
                except RowTimeout:
                    raise
                except Exception as error:  # one Opacus mode's failure is its cell
                    errors[mode] = short_error(error)
        peaks = {n: peak(fn, device) for n, fn in methods.items() if n in ("non-private", "private")}
        stats = timed_group(methods, "non-private", ctx.args.rounds, device)
    finally:
        for gsm in gsms:
            with contextlib.suppress(Exception):
                gsm._close()

    def over(name: str, ref: str) -> list[float]:
        return [a / b for a, b in zip(_raw(stats, name), _raw(stats, ref), strict=True)]

    priv = stats["private"].samples
    cells, checks = [], [f"private <= {PRIVATE_LIMIT}: {verdict(priv, PRIVATE_LIMIT)}"]
    for mode in ("hooks", "functorch"):
        if mode in stats:
            ahead = over(mode, "private")
            cells.append(cell(ahead))
            checks.append(f"ahead of {mode}: {verdict(ahead, 1.0, at_least=True)}")
        else:
            cells.append(errors.get(mode, "—"))
    return (f"| {batch} x {seq} | {cell(priv)} | {cells[0]} | {cells[1]} | {cell(over('peft', 'non-private'))} | "
            f"{peaks['private'] / max(peaks['non-private'], 1):.2f} | {'; '.join(checks)} |")


def opacus_clip_and_noise_on(gsm: Any, batch: int, generator: torch.Generator, clip: Callable[..., Any]) -> Any:
    """bench/privacy.py's clipping and noise, with the noise drawn on the gradients' device."""
    params = [p for p in gsm.parameters() if p.requires_grad]
    if params and params[0].device.type == "cpu":
        return clip(gsm, batch, generator)
    from privacy import C, SIGMA

    norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in params]).norm(dim=0)
    factor = (C / (norms + 1e-6)).clamp(max=1.0)
    return [(torch.einsum("b,b...->...", factor, p.grad_sample) + SIGMA * C * torch.randn(p.shape, generator=generator, device=p.device)) / batch
            for p in params]


def _raw(stats: dict[str, c.RatioStats], name: str) -> tuple[float, ...]:
    """Per-round ratios to the group's baseline (1.0 for the baseline itself)."""
    st = stats[name]
    return st.samples if st.samples else (1.0,) * len(next(v.samples for v in stats.values() if v.samples))


# ------------------------------------------------------------------------------ section 4: serving


def serve_rows(ctx: Context) -> None:
    rep, device, budget, model, rank = ctx.report, ctx.device, ctx.budget, ctx.model, ctx.z["rank"]
    section = "serve"
    size, length = ctx.z["prompt"]
    new = ctx.z["new_tokens"]
    rep.add(section, "", f"## 4. Serving: {size} prompts of {length} tokens, {new} new tokens (greedy, KV cache), a different LoRA per row", "",
            f"Tokens per second (new tokens of the batch over the `generate` time) and the ratio to the reference. Targets: per-row >= "
            f"{SERVE_LIMIT} x one adapter for all rows, and ahead of peft's mixed batch.", "",
            "| configuration | tokens/s | ratio | vs | target |", "|---|---|---|---|---|")
    if not budget.fits(10.0):
        rep.add(section, "| all | skipped: the budget's time ran out | | | |")
        rep.write()
        return
    try:
        with budget.row():
            adapters = [a.detach() for a in tenants(model, size, rank)]
            index = torch.arange(size, device=device)
            ids, mask = c.left_padded_batch(size, length, model.config.vocab_size)
            ids, mask = ids.masked_fill(mask == 0, 0).to(device), mask.to(device)
            gen = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}

            def generate_with(context: Callable[[], Any]) -> Callable[[], Any]:
                def run() -> Any:
                    with torch.no_grad(), context():
                        return model.generate(ids, attention_mask=mask, **gen)
                return run

            methods = {
                "one adapter, lazy": generate_with(lambda: lf.adapted(model, adapters[0], merged=False)),
                "one adapter, merged": generate_with(lambda: lf.adapted(model, adapters[0])),
                "per-row (mixed_adapted)": generate_with(lambda: lf.mixed_adapted(model, adapters, index)),
            }
            errors = {}
            try:
                pm = c.peft_named_adapters(model, adapters, rank, 2 * rank, ALL7)
                names = [f"a{i}" for i in range(size)]

                def peft_generate(**kw: Any) -> Callable[[], Any]:
                    def run() -> Any:
                        with torch.no_grad():
                            return pm.generate(input_ids=ids, attention_mask=mask, **gen, **kw)
                    return run

                methods["peft one adapter"] = peft_generate()
                methods["peft per-row (adapter_names)"] = peft_generate(adapter_names=names)
                # What is timed serves each row with its own adapter on both sides: the prompts' logits agree.
                with torch.no_grad():
                    ours = lf.mixed_call(model, adapters, index, ids, attention_mask=mask, batching="layers").logits.float()
                    theirs = pm(input_ids=ids, attention_mask=mask, adapter_names=names).logits.float()
                    one = pm(input_ids=ids, attention_mask=mask).logits.float()
                agree = float((ours - theirs).abs().max() / (theirs - one).abs().max())
                rep.add(section, f"| (check) lora_func per-row vs peft adapter_names, prompt logits | max difference / max effect of the "
                        f"per-row adapters {agree:.1e} | | | |")
            except RowTimeout:
                raise
            except Exception as error:
                errors["peft"] = short_error(error)
            for fn in methods.values():
                fn()
            stats = timed_group(methods, "per-row (mixed_adapted)", ctx.args.rounds, device)
            tokens = size * new
            refs = {"one adapter, lazy": "", "one adapter, merged": "", "per-row (mixed_adapted)": "one adapter, merged",
                    "peft one adapter": "", "peft per-row (adapter_names)": "per-row (mixed_adapted)"}
            for name in methods:
                throughput = 1e3 * tokens / stats[name].ms
                ref = refs[name]
                ratio, target = "", ""
                if name == "per-row (mixed_adapted)":
                    for one in ("one adapter, merged", "one adapter, lazy"):
                        # per round: the reference's time over the per-row time = per-row throughput / its
                        per_round = list(_raw(stats, one))
                        ratio += f"{cell(per_round)} vs {one}; "
                        target += f">= {SERVE_LIMIT} vs {one.split(', ')[1]}: {verdict(per_round, SERVE_LIMIT, at_least=True)}; "
                    ref = ""
                elif name == "peft per-row (adapter_names)":
                    ahead = list(_raw(stats, name))  # peft's time over ours: > 1 = ours ahead
                    ratio = cell([1.0 / x for x in ahead])
                    target = f"ours ahead: {verdict(ahead, 1.0, at_least=True)}"
                rep.add(section, f"| {name} | {throughput:.0f} | {ratio.rstrip('; ')} | {ref} | {target.rstrip('; ')} |")
            if "peft" in errors:
                rep.add(section, f"| peft | error: {errors['peft']} | | | |")
    except Exception as error:
        rep.add(section, f"| all | error: {short_error(error)} | | | |")
    finally:
        free(device)
    rep.write()


# ------------------------------------------------------------------------------ section 5: the pretrained model


def pretrained_rows(ctx: Context) -> None:
    from transformers import LlamaForCausalLM

    rep, device, budget = ctx.report, ctx.device, ctx.budget
    section = "pretrained"
    path = Path(ctx.args.pretrained)
    rep.add(section, "", "## 5. The project's pretrained model", "",
            f"`{path.relative_to(REPO) if path.is_relative_to(REPO) else path}`: the small pretrained Llama the demo ships. A larger real "
            "model is not part of this run: the device reaches no network and nothing here downloads weights.", "",
            "| model | tokens | lazy | merged | peft | lazy / peft | memory lazy / merged / peft | base ms |", "|---|---|---|---|---|---|---|---|")
    if not (path / "config.json").exists():
        rep.add(section, f"| {path} | not present | | | | | | |")
        rep.write()
        return
    if not budget.fits(3.0):
        rep.add(section, "| pretrained | skipped: the budget's time ran out | | | | | | |")
        rep.write()
        return
    try:
        with budget.row():
            model = LlamaForCausalLM.from_pretrained(str(path), dtype=ctx.dtype).to(device).eval().requires_grad_(False)
            model.set_attn_implementation("sdpa")
            seq = min(16 if ctx.args.smoke else 128, model.config.max_position_embeddings)
            s = setup_for(model, 8, seq, device, ctx.dtype)
            rank = ctx.z["rank"]
            adapter = c.our_adapter(s, "lora", rank, targets=ALL7)
            steps: dict[str, Callable[[], Any]] = {"base": c.base_step(s).step}
            memory: dict[str, int] = {"base": memory_of(c.base_step(s), [*s.base.values(), s.embeds], device)}
            errors: dict[str, str] = {}
            own = [*s.base.values(), s.embeds, *adapter.params.values()]
            for p in ("lazy", "merged"):
                try_step(p, lambda p=p: (c.our_step(s, adapter, merged=p == "merged"), own), device, steps, memory, errors)
            pm = c.peft_model(s, "lora", rank, targets=ALL7)
            assert pm is not None
            try_step("peft", lambda: (c.peft_step(s, pm), [*pm.parameters(), *pm.buffers(), s.embeds]), device, steps, memory, errors)
            stats = timed_group(steps, "base", ctx.args.rounds, device)
            paired = [a / b for a, b in zip(stats["lazy"].samples, stats["peft"].samples, strict=True)] if {"lazy", "peft"} <= set(stats) else []
            mem = " / ".join("—" if p not in memory else gib(memory[p] - memory["base"], device) for p in ("lazy", "merged", "peft"))
            cells = [f"error: {errors[p]}" if p in errors else cell(stats[p].samples if p in stats else None) for p in ("lazy", "merged", "peft")]
            params = sum(p.numel() for p in model.parameters())
            line = (f"| lora on {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size} ({params / 1e6:.1f} M parameters) | "
                    f"8 x {seq} | {' | '.join(cells)} | {cell(paired)} | {mem} | {stats['base'].ms:.1f} |")
    except Exception as error:
        line = f"| pretrained | error: {short_error(error)} | | | | | | |"
    finally:
        free(device)
    rep.add(section, line)
    rep.write()


# ------------------------------------------------------------------------------ section 6: liger-kernel


def liger_reason(device: torch.device, model: torch.nn.Module | None = None) -> str | None:
    """Why liger-kernel cannot run here, or ``None`` when it can. Off a GPU, where it imports,
    ``model`` is patched and run once, and what its first kernel says is the reason."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as error:  # the reason is the finding
        return f"`import liger_kernel.transformers` fails: {short_error(error)} (liger-kernel's kernels are Triton kernels)"
    if device.type == "cuda":
        return None
    if model is None:
        return f"liger-kernel imports, but its kernels are Triton GPU kernels and this run's device is {device.type}"
    try:
        patched = liger_model(model)
        ids = torch.randint(3, model.config.vocab_size, (1, 8))
        with liger_rope():
            patched(input_ids=ids.to(device), labels=ids.to(device), skip_logits=True)
    except Exception as error:
        return (f"liger-kernel imports and patches the model, but its first Triton kernel fails on the {device.type}: "
                f"{short_error(error)}")
    return f"liger-kernel ran on the {device.type} (unexpected): not timed off a GPU"


@contextlib.contextmanager
def liger_rope() -> Iterator[None]:
    """liger's rotary kernel for the duration of a call: ``apply_liger_kernel_to_llama`` swaps
    it into transformers' module for every model; here it is put back after each liger step."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.llama import modeling_llama

    plain = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = liger_rotary_pos_emb
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = plain


def liger_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with liger's RMSNorm, SwiGLU and fused linear cross-entropy on it
    (the instance only: transformers' module is restored)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    saved = {name: getattr(modeling_llama, name) for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    patched = copy.deepcopy(model)
    try:
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, model=patched)
    finally:
        for name, value in saved.items():
            setattr(modeling_llama, name, value)
    return patched


def liger_rows(ctx: Context) -> None:
    rep, device, budget = ctx.report, ctx.device, ctx.budget
    section = "liger"
    rep.add(section, "", "## 6. LoRA on a model patched by liger-kernel", "",
            "liger's fused RMSNorm, SwiGLU, rotary and linear cross-entropy (no logits materialised) on a copy of the model; the "
            "loss from `labels=` (shifted, transformers' and liger's), lazy and merged, and peft's LoRA on the patched copy. "
            "Loss: |liger - plain| / |plain|; time: the liger step over the plain model's same step.", "",
            "| step | loss rel. diff | time liger / plain | memory liger / plain |", "|---|---|---|---|")
    reason = liger_reason(device, ctx.model)
    if reason is not None:
        rep.add(section, f"| all | cannot run: {reason} | | |")
        rep.write()
        return
    if not budget.fits(10.0):
        rep.add(section, "| all | skipped: the budget's time ran out | | |")
        rep.write()
        return
    s = ctx.gpu
    rank = ctx.z["rank"]
    try:
        with budget.row():
            patched = liger_model(ctx.model)
            ids = torch.randint(3, ctx.model.config.vocab_size, s.labels.view(s.embeds.shape[:2]).shape,
                                generator=torch.Generator().manual_seed(11)).to(device)
            adapter = c.our_adapter(s, "lora", rank, targets=ALL7)
            base_p = lf.base_params(patched)
            pm_plain = c.peft_model(s, "lora", rank, targets=ALL7)
            s_liger = c.Setup(patched, base_p, s.embeds, s.labels, s.calib_ids, s.dtype, s.device)
            pm_liger = c.peft_model(s_liger, "lora", rank, targets=ALL7)
            assert pm_plain is not None and pm_liger is not None
            with torch.no_grad():  # the same peft weights on both models
                for (_, a), (_, b) in zip(sorted(pm_plain.named_parameters()), sorted(pm_liger.named_parameters()), strict=True):
                    b.copy_(a)
            pm_liger.base_model.model.train()  # liger skips the logits in training mode only

            def ours(model: torch.nn.Module, base: dict[str, torch.Tensor], merged: bool, liger: bool) -> Callable[[], Any]:
                def loss() -> torch.Tensor:
                    with liger_rope() if liger else contextlib.nullcontext():
                        kw = {"skip_logits": True} if liger else {}
                        return lf.adapted_call(model, adapter, base=base, merged=merged, inputs_embeds=s.embeds, labels=ids, **kw).loss
                return loss

            def theirs(pm: torch.nn.Module, liger: bool) -> Callable[[], Any]:
                def loss() -> torch.Tensor:
                    with liger_rope() if liger else contextlib.nullcontext():
                        return pm(inputs_embeds=s.embeds, labels=ids).loss
                return loss

            def frozen(model: torch.nn.Module, liger: bool) -> Callable[[], Any]:
                def loss() -> torch.Tensor:
                    with liger_rope() if liger else contextlib.nullcontext():
                        kw = {"skip_logits": True} if liger else {}
                        return model(inputs_embeds=s.embeds, labels=ids, **kw).loss
                return loss

            pairs = {
                "frozen base": (frozen(ctx.model, False), frozen(patched, True), [s.embeds]),
                "lora lazy": (ours(ctx.model, s.base, False, False), ours(patched, base_p, False, True), [s.embeds, *adapter.params.values()]),
                "lora merged": (ours(ctx.model, s.base, True, False), ours(patched, base_p, True, True), [s.embeds, *adapter.params.values()]),
                "peft lora": (theirs(pm_plain, False), theirs(pm_liger, True), [s.embeds]),
            }
            for name, (plain, liger, inputs) in pairs.items():
                if name == "peft lora":
                    inputs = [s.embeds, *(p for p in pm_plain.parameters() if p.requires_grad)]
                    liger_inputs = [s.embeds, *(p for p in pm_liger.parameters() if p.requires_grad)]
                else:
                    liger_inputs = inputs
                try:
                    with torch.no_grad():
                        want, got = float(plain()), float(liger())
                    steps = {"plain": lambda f=plain, i=inputs: torch.autograd.grad(f(), i),
                             "liger": lambda f=liger, i=liger_inputs: torch.autograd.grad(f(), i)}
                    peaks = {n: peak(fn, device) for n, fn in steps.items()}
                    stats = timed_group(steps, "plain", ctx.args.rounds, device)
                    line = (f"| {name} | {abs(got - want) / abs(want):.1e} (loss {want:.4f}) | {cell(stats['liger'].samples)} | "
                            f"{peaks['liger'] / max(peaks['plain'], 1):.2f} |")
                except RowTimeout:
                    raise
                except Exception as error:
                    line = f"| {name} | error: {short_error(error)} | | |"
                rep.add(section, line)
    except Exception as error:
        rep.add(section, f"| all | error: {short_error(error)} | | |")
    finally:
        free(device)
    rep.write()


# ------------------------------------------------------------------------------ main


class Context:
    """What the sections share: options, sizes, the model, the GPU-bound setup, the budget."""

    def __init__(self, args: argparse.Namespace, z: dict[str, Any], device: torch.device, report: Report, budget: Budget) -> None:
        self.args, self.z, self.device, self.report, self.budget = args, z, device, report, budget
        self.dtype = torch.bfloat16
        self.model = build_llama(z, device, self.dtype)
        self.gpu = setup_for(self.model, *z["gpu"], device, self.dtype)
        self.base_memory = 0
        self.methods: list[str] | None = None
        self.skipped: list[str] = []  # section 1's methods the budget left out


# Seconds each part may take at most on the device, and what it keeps for the parts after it.
CAPS = {"train": 100.0, "launch": 110.0, "ensemble": 35.0, "private": 45.0, "serve": 35.0, "pretrained": 10.0, "rest": 10_000.0, "liger": 40.0}
RESERVE = {"liger": 25.0}  # kept from the parts before it (the "rest" rows would take it all)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="every section on the CPU at tiny size (CI: the script cannot rot)")
    parser.add_argument("--out", default=None, help="write the Markdown tables here (default gpu_table.md; none with --smoke)")
    parser.add_argument("--device", default=None, help="default cuda (cpu with --smoke)")
    parser.add_argument("--budget", type=float, default=None, help="seconds from start to the last line (default 450; 900 with --smoke)")
    parser.add_argument("--row-limit", type=float, default=None, help="seconds one row may take (default 75; 300 with --smoke)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per row (default 3; 1 with --smoke)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    parser.add_argument("--methods", default=None, help="section 1's methods: comma-separated or 'all' (default all; --smoke: a few)")
    parser.add_argument("--core", type=int, default=8, help="how many of section 1's methods run before the other sections")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; eager with --smoke)")
    parser.add_argument("--pretrained", default=str(REPO / "lora_func" / "demo" / "assets"))
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's; 1 with --smoke)")
    args = parser.parse_args(argv)
    smoke = args.smoke
    args.device = args.device or ("cpu" if smoke else "cuda")
    # --smoke checks that every part runs, not how fast: its limits only stop a hung run.
    args.budget = args.budget if args.budget is not None else (900.0 if smoke else 450.0)
    args.row_limit = args.row_limit if args.row_limit is not None else (300.0 if smoke else 75.0)
    args.rounds = args.rounds or (1 if smoke else 3)
    args.compile_backend = args.compile_backend or ("eager" if smoke else "inductor")
    if args.out is None and not smoke:
        args.out = "gpu_table.md"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on a CPU", file=sys.stderr)
        return 2
    if args.threads or args.smoke:
        torch.set_num_threads(args.threads or 1)
    z = sizes(args.smoke)
    registered = lf.list_variants()
    if args.methods in (None, "all"):
        methods = list(SMOKE_METHODS) if args.smoke and args.methods is None else [m for m in PRIORITY if m in registered]
        methods += [m for m in registered if m not in methods and not (args.smoke and args.methods is None)]
    else:
        methods = [m for m in args.methods.split(",") if m]
        unknown = sorted(set(methods) - set(registered))
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; registered: {', '.join(registered)}")
    sections = [x for x in args.sections.split(",") if x]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}; known: {', '.join(SECTIONS)}")
    report = Report(Path(args.out) if args.out else None, header_lines(args, z, device))
    budget = Budget(args.budget, args.row_limit)
    t0 = time.perf_counter()
    ctx = Context(args, z, device, report, budget)
    if args.methods not in (None, "all"):
        ctx.methods = methods
    params = sum(p.numel() for p in ctx.model.parameters())
    report.add("header", f"- model built in {time.perf_counter() - t0:.1f} s: {params / 1e9:.3f} B parameters", "")
    report.write()
    core, rest = methods[: args.core], methods[args.core :]
    if "train" not in sections:
        core = []
    if "rest" not in sections and "train" not in sections:
        rest = []
    parts: list[tuple[str, Callable[[], None]]] = [
        ("train", lambda: train_rows(ctx, core, "train")),
        ("launch", lambda: launch_rows(ctx)),
        ("ensemble", lambda: ensemble_rows(ctx)),
        ("private", lambda: private_rows(ctx)),
        ("serve", lambda: serve_rows(ctx)),
        ("pretrained", lambda: pretrained_rows(ctx)),
        ("rest", lambda: train_rows(ctx, rest, "train")),
        ("liger", lambda: liger_rows(ctx)),
    ]
    for i, (name, run) in enumerate(parts):
        if name == "rest":
            if not rest:
                continue
        elif name not in sections:
            continue
        reserve = sum(RESERVE.get(later, 0.0) for later, _ in parts[i + 1 :] if later in sections)
        has = budget.start_section(CAPS[name] if not args.smoke else args.budget, reserve)
        if has <= 1.0:
            report.add(name, "", f"## {name}: skipped, the budget's time ran out ({max(has, 0):.0f} s left for it)")
            report.write()
            continue
        began, cpu = time.perf_counter(), time.process_time()
        try:
            run()
        except Exception as error:  # a section's failure is printed, the run goes on
            report.add(name, f"\n{name}: error: {short_error(error)}", "```", traceback.format_exc()[-1500:], "```")
        report.add(name, "", f"({name}: {time.perf_counter() - began:.0f} s, {time.process_time() - cpu:.0f} s of CPU time)")
        report.write()
    report.add("footer", "", f"Finished in {time.perf_counter() - START:.0f} s.")
    if ctx.skipped:
        report.add("footer", f"Section 1 rows the budget left out: {', '.join(ctx.skipped)}. To measure them: "
                   f"`python bench/gpu.py --sections train --core 99 --methods {','.join(ctx.skipped)} --budget 240 --out gpu_table_rest.md`")
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
