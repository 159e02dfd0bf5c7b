"""The demo run: fine-tune each variant on the question task, measure, save, reload, report.

Everything here is what a user would write with the public API (``lora_func`` and
``lora_func.train``); the CLI (``lora-func demo``) and the dashboard (examples/dashboard.py)
only call :func:`run_demo` / :func:`run_variant`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor, nn

import lora_func as lf
from lora_func.demo.corpus import task_split
from lora_func.demo.defaults import DEFAULTS, NOT_TRAINED, method_defaults
from lora_func.demo.fitting import fit_and_init
from lora_func.demo.model import Quantize, default_targets, load_model
from lora_func.quantized import logical_shape
from lora_func.train import IGNORE_INDEX, StepStats, TrainState, fit, make_optimizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _Generates(Protocol):
    """What :func:`generate` uses of a transformers causal LM."""

    def generate(self, inputs: Tensor, **kwargs: Any) -> Tensor: ...

__all__ = [
    "DEFAULT_LR",
    "DEFAULT_VARIANTS",
    "DemoConfig",
    "TaskData",
    "batch_sampler",
    "correct_answers",
    "cpu_threads",
    "encode_examples",
    "generate",
    "held_out_accuracy",
    "results_markdown",
    "run_demo",
    "run_variant",
    "save_loss_plot",
    "settings_text",
]

# What `lora-func demo` runs without --variants: three adapters with different ideas
# (low-rank update, magnitude/direction split, per-feature scaling).
DEFAULT_VARIANTS = ("lora", "dora", "ia3")

# Each method's learning rate, from the one table of per-method defaults (lora_func.demo.defaults:
# rank and options too; docs/guide/hyperparameters.md has the sweep behind it).
DEFAULT_LR = MappingProxyType({name: row.lr for name, row in DEFAULTS.items()})


class _Example(Protocol):
    """What encoding uses of a task's question (``TaskExample``, ``WorkedSum``)."""

    @property
    def prompt(self) -> str: ...

    @property
    def answer(self) -> str: ...


@dataclasses.dataclass
class DemoConfig:
    """Everything ``lora-func demo`` can be told (the CLI flags, one to one)."""

    variants: Sequence[str] = DEFAULT_VARIANTS
    r: int | None = None  # None: per method (lora_func.demo.defaults)
    steps: int = 120
    lr: float | None = None  # None: per method (lora_func.demo.defaults)
    batch_size: int = 16
    dtype: torch.dtype = torch.float32  # the base model's dtype; adapters stay fp32
    device: str = "cpu"
    model_dir: str | None = None  # None: the shipped tiny model
    targets: Sequence[str] | None = None  # None: the model's attention projections
    out: Path | None = None  # where the plot, tables and adapters go; None: a temporary dir
    seed: int = 0
    progress: bool = True
    samples: int = 2  # generated examples shown before/after per variant
    threads: int | None = None  # torch CPU threads while training; None: see threads_for_run
    gradient_checkpointing: bool = False  # recompute each decoder layer in backward (HF's, non-reentrant)
    quantize: Quantize | None = None  # "nf4" or "int8": a bitsandbytes-quantized base (QLoRA)

    def lr_for(self, variant: str) -> float:
        return self.lr if self.lr is not None else method_defaults(variant).lr

    def spec_for(self, variant: str, targets: Sequence[str]) -> lf.AdapterSpec:
        """The spec the demo asks for: the method's row of the defaults table (rank, alpha,
        options), with ``r`` when set. Options that do not fit the model are lowered later
        (:func:`lora_func.demo.fitting.fit_and_init`). A row that names its own targets (trainable
        tokens: the embedding) trains those instead of ``targets``, unless ``targets`` was set."""
        row = method_defaults(variant)
        extra: dict[str, Any] = {"tied": row.tied} if row.tied is not None else {}
        if row.targets is not None and not self.targets:
            targets = row.targets
        return lf.AdapterSpec(
            variant, targets=list(targets), r=self.r if self.r is not None else row.rank(), alpha=row.alpha, **extra, **row.options,
        )

    def threads_for_run(self) -> int | None:
        """The CPU threads to train with: ``threads`` when set; else 1 for the shipped tiny
        model on the CPU, and torch's default (``None``: leave it) for any other model.

        The shipped model's matmuls (hidden size 128, a batch of 16 short questions) are too
        small to split: a second thread saves little on an idle machine, but when another
        process also wants the cores, torch's threads wait for each other and a step takes many
        times longer (docs/benchmarks.md, "Kernel choices", has the measurements).
        """
        if self.threads is not None:
            return self.threads
        return 1 if self.model_dir is None and torch.device(self.device).type == "cpu" else None


@contextlib.contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """``torch.set_num_threads(n)`` inside the block, the previous value restored after;
    ``None`` changes nothing."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclasses.dataclass(frozen=True)
class TaskData:
    """A task split tokenized for training and scoring.

    Attributes:
      examples: the questions, in row order.
      input_ids / attention_mask / labels: ``(n, seq)``, right-padded; ``labels`` is
        ``IGNORE_INDEX`` except on the answer tokens and the closing full stop.
      answer_mask: ``(n, seq)`` bool, True at positions whose *next* token is an answer token
        (where greedy decoding must pick the answer).
    """

    examples: tuple[_Example, ...]
    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    answer_mask: Tensor

    def batch(self, index: Tensor | slice = slice(None)) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index], "labels": self.labels[index]}

    def to(self, device: str | torch.device) -> TaskData:
        move = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if f.name != "examples"}
        return TaskData(self.examples, **move)


def encode_examples(tokenizer: Any, examples: Sequence[_Example]) -> TaskData:
    """Tokenize prompt, answer and the closing ``" ."`` separately (so the answer's tokens are
    the same wherever it is scored), right-pad. The full stop ends the answer as it ends every
    sum in the corpus; an end-of-sequence token would be a word the base never predicted, and
    learning it would dominate the loss curve."""
    rows, answer_spans = [], []
    for ex in examples:
        prompt = tokenizer(ex.prompt)["input_ids"]
        answer = tokenizer(" " + ex.answer, add_special_tokens=False)["input_ids"]
        stop = tokenizer(" .", add_special_tokens=False)["input_ids"]
        rows.append(prompt + answer + stop)
        answer_spans.append((len(prompt), len(prompt) + len(answer)))
    length = max(map(len, rows))
    n = len(rows)
    input_ids = torch.full((n, length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    labels = torch.full((n, length), IGNORE_INDEX, dtype=torch.long)
    answer_mask = torch.zeros((n, length), dtype=torch.bool)
    for i, (row, (start, stop)) in enumerate(zip(rows, answer_spans, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        labels[i, start : len(row)] = input_ids[i, start : len(row)]
        answer_mask[i, start - 1 : stop - 1] = True
    return TaskData(tuple(examples), input_ids, attention_mask, labels, answer_mask)


@torch.no_grad()
def held_out_accuracy(model: nn.Module, adapter: Any, data: TaskData, *, base: dict[str, Tensor] | None = None) -> tuple[float, Tensor]:
    """``(exact-match accuracy, logits)``: a question counts when greedy decoding gives every
    answer token (one teacher-forced pass: greedy picks the argmax at each answer position).
    ``adapter=None`` scores the base model."""
    if adapter is None:
        logits = model(data.input_ids, attention_mask=data.attention_mask).logits
    else:
        logits = lf.adapted_call(model, adapter, data.input_ids, base=base, attention_mask=data.attention_mask).logits
    return correct_answers(logits, data).float().mean().item(), logits


def correct_answers(logits: Tensor, data: TaskData) -> Tensor:
    """``(n,)`` bool: whether greedy decoding from ``logits`` (``(n, seq, vocab)``, teacher
    forced on ``data``) gives every answer token of each question."""
    hits = logits.argmax(-1) == data.input_ids.roll(-1, dims=1)
    return (hits | ~data.answer_mask).all(dim=1)


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Any, prompt: str, adapter: Any = None, *, max_new_tokens: int = 6) -> str:
    """Greedy continuation of ``prompt`` by ``model.generate``, with ``adapter`` applied through
    :func:`lora_func.adapted` when given: merged weights for the whole generation, or the lazy
    path where the adapter has no merged weight on these layers (BEFT's trained bias on a layer
    without a bias: its merge refuses, before any work)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(next(model.parameters()).device)
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    lm = cast("_Generates", model)  # a transformers causal LM (load_model's)
    if adapter is None:
        out = lm.generate(ids, **kwargs)
    else:
        with contextlib.ExitStack() as stack:
            try:  # the merge only: the generation itself is never retried
                stack.enter_context(lf.adapted(model, adapter))
            except ValueError:
                stack.enter_context(lf.adapted(model, adapter, merged=False))
            out = lm.generate(ids, **kwargs)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    return text.split(" .")[0] + " ." if " ." in text else text  # up to the first full stop


def batch_sampler(data: TaskData, batch_size: int, seed: int) -> Callable[[int], dict[str, Tensor]]:
    """``step -> batch``, a pure function of the step (a resumed run sees the same batches)."""

    def batch_at(step: int) -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        index = torch.randint(0, len(data.examples), (batch_size,), generator=g)
        return data.batch(index.to(data.input_ids.device))

    return batch_at


def _save_and_reload(model: nn.Module, adapter: Any, directory: Path) -> tuple[Any, str]:
    """Save in peft's format where peft can hold the adapter (``lora_func.io.peft_problems``;
    antipasto it cannot: lora_func's own format); return the reloaded adapter and a note on the
    format used."""
    variant = adapter.spec.variant
    problems = lf.io.peft_problems(adapter, model=model)
    if problems:
        path = lf.save(adapter, directory / f"{variant}.safetensors")
        reason = problems[0].removeprefix("save_peft: ").split(";")[0]  # the what, not the fix
        return lf.load(path, model=model), f"lora_func format ({path.name}; {reason})"
    path = lf.save_peft(adapter, directory / variant, model=model)
    note = f"peft format ({path.name}/adapter_model.safetensors"
    if variant == "pissa":  # peft's own convention: a LoRA of rank 2r on the original weights
        note += f"; as peft stores PiSSA, a rank-{2 * adapter.spec.r} LoRA on the untouched base: equal up to float rounding"
    return lf.load_peft(path, model), note + ")"


def model_size(model: nn.Module) -> int:
    """The model's parameter count, tied weights once, buffers not counted; a quantized weight
    counts the weights it stands for, not its packed bytes."""
    return sum(math.prod(logical_shape(p)) for p in model.parameters())


@contextlib.contextmanager
def training_mode(model: nn.Module, *, checkpointing: bool) -> Iterator[None]:
    """With ``checkpointing``: the model in training mode with HF gradient checkpointing on
    (HF checkpoints only in training mode) for the block, and as it was afterwards."""
    if not checkpointing:
        yield
        return
    hf = cast("PreTrainedModel", model)  # a transformers model (load_model's)
    was_training = hf.training
    hf.train()
    hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        hf.activation_checkpointing_disable()
        if getattr(hf, "_require_grads_hook", None) is not None:
            hf.disable_input_require_grads()
        hf.train(was_training)


def settings_text(spec: lf.AdapterSpec, fitted: Sequence[str] = ()) -> str:
    """``spec``'s rank and every alpha or option that differs from the variant's own default, as
    ``"r=8, scaling=300"``; an option named in ``fitted`` (lowered to fit the model) is marked
    ``*``."""
    variant = lf.get_variant(spec.variant)
    parts = [f"r={spec.r}" + ("*" if "r" in fitted else "")]
    if spec.alpha != variant.default_alpha:
        parts.append(f"alpha={spec.alpha:g}")
    for name, value in spec.options:
        schema = variant.options.get(name)
        if schema is None or value != schema.default:
            parts.append(f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}")
            parts[-1] += "*" if name in fitted else ""
    return ", ".join(parts)


def _init_for_demo(model: nn.Module, spec: lf.AdapterSpec, config: DemoConfig, train: TaskData) -> Any:
    calibration = None
    if lf.get_variant(spec.variant).calibration is not None:  # EVA: SVD of the layer inputs on training batches
        calibration = [
            {"input_ids": train.input_ids[i : i + 16], "attention_mask": train.attention_mask[i : i + 16]}
            for i in range(0, len(train.examples), 16)
        ]
    return lf.init_adapter(model, spec, generator=torch.Generator().manual_seed(config.seed), calibration=calibration)


def run_variant(
    model: nn.Module,
    tokenizer: Any,
    variant: str,
    config: DemoConfig,
    train: TaskData,
    held_out: TaskData,
    adapter_dir: Path,
    *,
    on_step: Callable[[StepStats], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune one variant and measure it. Returns one results row (JSON-able).

    Every row has ``variant``, ``status``, ``lr``, ``r``, ``settings`` (rank and non-default options,
    ``*`` on those lowered to fit the model), ``fitted`` (each lowered option: asked, used, why),
    ``reason`` and ``diverged``. ``status`` is ``"trained"`` (then the numbers too, and ``"losses"``: the
    per-step training loss), ``"skipped"`` (the method cannot start on this model: no value of
    an option fits, or an optional dependency is missing, or the demo does not train it:
    ``lora_func.demo.defaults.NOT_TRAINED``; ``reason`` says which) or
    ``"failed"`` (training diverged or raised; ``reason`` has the error). A failure never
    escapes: the caller's other methods still run.
    """
    lr = config.lr_for(variant)
    row: dict[str, Any] = {
        "variant": variant, "status": "skipped", "lr": lr, "r": None, "settings": "", "fitted": [], "reason": None, "diverged": False,
    }
    if variant in NOT_TRAINED:  # declared in lora_func.demo.defaults, with its reason
        row["reason"] = f"not trained by the demo: {NOT_TRAINED[variant]}"
        return row
    with cpu_threads(config.threads_for_run()):
        try:
            targets = list(config.targets) if config.targets else default_targets(model)
            try:
                spec = config.spec_for(variant, targets)
                row["settings"], row["r"] = settings_text(spec), spec.r
                fitted = fit_and_init(model, spec, lambda s: _init_for_demo(model, s, config, train))
            except (ValueError, TypeError, ImportError) as err:  # no value of an option fits, a missing optional package
                row["reason"] = f"cannot run on this model: {err}"
                return row
            row["settings"] = settings_text(fitted.spec, [c.option for c in fitted.changes])
            row["r"] = fitted.spec.r
            row["fitted"] = [{"option": c.option, "asked": c.asked, "used": c.used, "why": c.reason} for c in fitted.changes]
            row.update(_train_and_measure(model, tokenizer, fitted.adapter, config, lr, train, held_out, adapter_dir, on_step))
            row["status"] = "trained"
            if not math.isfinite(row["final_loss"]):  # a float16 run whose scaler skipped the non-finite steps
                row["status"], row["diverged"] = "failed", True
                row["reason"] = f"training {variant} at lr {lr:g} diverged: the last steps' mean loss is {row['final_loss']}"
        except FloatingPointError as err:  # fit names the step and the non-finite tensors
            row["status"], row["diverged"] = "failed", True
            row["reason"] = f"training {variant} at lr {lr:g} diverged: {err.args[0] if err.args else err}"
        except Exception as err:  # a method that breaks must not take the others' results with it
            row["status"], row["reason"] = "failed", f"{type(err).__name__}: {err}"
    return row


def _train_and_measure(
    model: nn.Module, tokenizer: Any, adapter: Any, config: DemoConfig, lr: float, train: TaskData, held_out: TaskData,
    adapter_dir: Path, on_step: Callable[[StepStats], None] | None,
) -> dict[str, Any]:
    base = lf.base_params(model)
    before, _ = held_out_accuracy(model, adapter, held_out, base=base)
    prompts = [ex.prompt for ex in held_out.examples[: config.samples]]
    samples_before = [generate(model, tokenizer, p) for p in prompts]

    half = config.dtype == torch.float16
    device_type = torch.device(config.device).type
    state = TrainState(adapter, make_optimizer(adapter, lr), torch.amp.GradScaler(device_type) if half else None)
    start = time.perf_counter()
    with training_mode(model, checkpointing=config.gradient_checkpointing):
        history = fit(
            model, state, batch_sampler(train, config.batch_size, config.seed), config.steps,
            progress=config.progress, desc=f"{adapter.spec.variant:>9}", on_step=on_step,
        )
    seconds = time.perf_counter() - start

    after, logits = held_out_accuracy(model, adapter, held_out, base=base)
    samples_after = [generate(model, tokenizer, p, adapter) for p in prompts]
    reloaded, saved_as = _save_and_reload(model, adapter, adapter_dir)
    _, reloaded_logits = held_out_accuracy(model, reloaded, held_out, base=base)
    trainable = adapter.num_parameters()
    losses = [s.loss for s in history]
    return {
        "trainable": trainable,
        "trainable_pct": 100 * trainable / model_size(model),
        "acc_before": before,
        "acc_after": after,
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "ms_per_step": 1e3 * seconds / max(1, len(history)),
        "skipped_steps": sum(s.skipped for s in history),
        "saved_as": saved_as,
        "reload_identical": bool(torch.equal(logits, reloaded_logits)),
        "reload_max_abs_diff": (logits - reloaded_logits).abs().max().item(),
        "samples": [{"prompt": p, "before": b, "after": a} for p, b, a in zip(prompts, samples_before, samples_after, strict=True)],
        "losses": losses,
    }


def results_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a Markdown table: one row per method, those that could not run or failed
    with their reason in the last column."""
    lines = [
        "| variant | lr | settings | trainable params | held-out acc before | after | final loss | ms/step | reload | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['variant']} | {row['lr']:g} | {row['settings']} |"
        if row["status"] != "trained":
            reason = " ".join(str(row["reason"]).split()).replace("|", "/")
            lines.append(f"{head} — | — | — | — | — | — | {row['status']}: {reason} |")
            continue
        reload = "identical" if row["reload_identical"] else f"max diff {row['reload_max_abs_diff']:.1e}"
        note = "; ".join(f"{f['option']} lowered from {f['asked']} to fit" for f in row["fitted"])
        lines.append(
            f"{head} {row['trainable']:,} ({row['trainable_pct']:.2f} %) | {row['acc_before']:.0%} | {row['acc_after']:.0%} | "
            f"{row['final_loss']:.3f} | {row['ms_per_step']:.0f} | {reload} | {note} |"
        )
    return "\n".join(lines) + "\n"


def save_loss_plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """The training loss of every variant against the step (log scale), as a PNG (matplotlib,
    Agg backend): each step's loss faint, its 10-step moving average bold, and the held-out
    accuracy before and after in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in rows if row["status"] == "trained"]
    fig, ax = plt.subplots(figsize=(8, 4.2 if len(rows) <= 12 else 4.2 + 0.16 * (len(rows) - 12)), dpi=100)
    for i, row in enumerate(rows):
        losses = torch.tensor(row["losses"], dtype=torch.float64)
        steps = range(1, len(losses) + 1)
        window = min(10, len(losses))
        smooth = losses.cumsum(0)
        smooth[window:] = smooth[window:] - smooth[:-window].clone()
        smooth = smooth / torch.arange(1, len(losses) + 1).clamp(max=window)
        colour = f"C{i % 10}"
        ax.plot(steps, losses.tolist(), color=colour, linewidth=0.6, alpha=0.3)
        label = f"{row['variant']}  (held-out {row['acc_before']:.0%} → {row['acc_after']:.0%})"
        ax.plot(steps, smooth.tolist(), color=colour, linewidth=1.8, label=label)
    ax.set(xlabel="step", ylabel="training loss", yscale="log",
           title="fine-tuning loss (bold: 10-step mean; faint: each step)")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8 if len(rows) <= 24 else 6, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run_demo(config: DemoConfig, *, emit: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every variant of ``config``; print (through ``emit``) the dataset preview, each
    variant's numbers and samples (or why it could not run), and the final table; write
    ``loss_curves.png``, ``results.md``, ``results.json`` and the adapters to ``config.out``,
    also when some methods could not run or failed. Returns the rows (:func:`run_variant`)."""
    torch.manual_seed(config.seed)
    model, tokenizer = load_model(config.model_dir, dtype=config.dtype, device=config.device, quantize=config.quantize)
    train_examples, held_out_examples = task_split(config.seed)
    train = encode_examples(tokenizer, train_examples).to(config.device)
    held_out = encode_examples(tokenizer, held_out_examples).to(config.device)
    n_params = model_size(model)
    source = config.model_dir or "the shipped tiny Llama (lora_func/demo/assets)"
    quantized = f", decoder linears quantized {config.quantize} (bitsandbytes)" if config.quantize else ""
    emit(f"model: {source}, {n_params:,} parameters, {config.dtype} on {config.device}{quantized}; adapters in fp32")
    emit(f"task: answer 'what is a plus b ?' ({len(train_examples)} training pairs, {len(held_out_examples)} held-out pairs never trained on)")
    for ex in train_examples[:3]:
        emit(f"  e.g.  {ex.prompt}  ->  {ex.answer}")

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(config.out) if config.out is not None else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for variant in config.variants:
            row = run_variant(model, tokenizer, variant, config, train, held_out, out / "adapters")
            rows.append(row)
            for change in row["fitted"]:
                emit(f"\n{variant}: {change['option']}={change['asked']} does not fit this model ({change['why'].split('; ')[0]}); "
                     f"using {change['option']}={change['used']}, the largest value below it that does")
            if row["status"] != "trained":
                emit(f"\n{variant} ({row['settings'] or 'as asked'}), lr {row['lr']:g}: {row['status']}: {row['reason']}")
                continue
            emit(
                f"\n{variant}: {row['trainable']:,} trainable parameters ({row['trainable_pct']:.2f} % of the model), lr {row['lr']:g}, "
                f"{row['settings']}\n"
                f"  held-out accuracy {row['acc_before']:.0%} -> {row['acc_after']:.0%}; final loss {row['final_loss']:.3f}; "
                f"{row['ms_per_step']:.0f} ms/step" + (f"; {row['skipped_steps']} step(s) skipped by the GradScaler" if row["skipped_steps"] else "")
            )
            for s in row["samples"]:
                emit(f"  {s['prompt']!r}: before {s['before']!r}, after {s['after']!r}")
            verdict = "identical outputs" if row["reload_identical"] else f"outputs differ by at most {row['reload_max_abs_diff']:.1e}"
            emit(f"  saved as {row['saved_as']}; reloaded: {verdict}")
        table = results_markdown(rows)
        emit("\n" + table)
        save_loss_plot(rows, out / "loss_curves.png")
        (out / "results.md").write_text(table)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
        if config.out is not None:
            emit(f"wrote {out / 'loss_curves.png'}, {out / 'results.md'}, {out / 'results.json'} and the adapters in {out / 'adapters'}")
    diverged = [r["variant"] for r in rows if r["diverged"]]
    if diverged:  # after the results of the others are written
        raise FloatingPointError(f"training diverged (non-finite loss) for {diverged}; lower the learning rate (--lr) or train in float32 (--dtype float32)")  # error: demo-diverged
    return rows
