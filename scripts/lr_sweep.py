"""Sweep every method's learning rate (and its own scale or size option where it has one) on the
demo task and on the worked-sums task; the per-method defaults of the demo
(lora_func/demo/defaults.py) and docs/guide/hyperparameters.md come from it.

    nice -n 19 python scripts/lr_sweep.py --grid coarse --out coarse.jsonl   # seed 0, demo task, 9 learning rates
    nice -n 19 python scripts/lr_sweep.py --grid fine --coarse coarse.jsonl --out fine.jsonl   # 3 seeds x 2 tasks
    python scripts/lr_sweep.py --report sweep.jsonl --plot docs/guide/lr_sweep.png   # tables (stdout) and curves

Every run: the shipped tiny model in fp32, one CPU thread, the method on the attention
projections, 120 steps of batch 16 (the demo's), AdamW, gradient clipping at 1.0. A seed sets
the adapter's init and the batch order; the train/held-out split is the demo's (seed 0) for
every seed. Each run appends one JSON line to ``--out`` (a rerun skips the runs already there,
so an interrupted sweep resumes); ``--report`` prints per task and method the mean held-out
accuracy over the seeds at every grid point, and the choice :func:`choose` makes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's lora_func, wherever the script is started from

from lora_func.demo.defaults import DEMO_TASK_TOKENS, NOT_TRAINED, method_defaults  # noqa: E402

TASKS = ("sums", "worked_sums")  # lora_func.demo.corpus: task_split, worked_sum_split
COARSE_LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)

# The coarse grid's settings beyond the learning rate: {} is the method's own defaults at r = 8.
# The scale options where a method has one (FourierFT's and WaveFT's `scaling`, VeRA's and
# PVeRA's initial `d_initial`, RandLoRA's `randlora_alpha`, DeLoRA's `lambda0`, LoRA's alpha as
# the example of the LoRA family), and the size the paper uses where r means something else
# (FourierFT's and WaveFT's number of coefficients, VeRA's shared rank, UniLoRA's shared vector),
# and FourierFT's zero init (peft's init_weights=True; its default draws the coefficients at random).
COARSE_SETTINGS: dict[str, list[dict[str, Any]]] = {
    "lora": [{}, {"alpha": 16.0}],
    "fourierft": [{}, {"scaling": 300.0}, {"r": 1000}, {"r": 1000, "scaling": 300.0}, {"init_weights": True},
                  {"r": 1000, "init_weights": True}],
    "waveft": [{}, {"scaling": 100.0}, {"r": 1000}, {"r": 1000, "scaling": 100.0}],
    "vera": [{}, {"r": 64}, {"r": 64, "d_initial": 1.0}],
    "pvera": [{}, {"r": 64}, {"r": 64, "d_initial": 1.0}],
    "randlora": [{}, {"randlora_alpha": 64.0}],
    "delora": [{}, {"lambda0": 5.0}],
    "unilora": [{}, {"theta_d_length": 4096}],
    # issue 48's second round: LoRA's own variants as LoRA (alpha 16 beside their default 8), and
    # trainable tokens given the demo tasks' words to re-train (it has no default tokens).
    **{name: [{}, {"alpha": 16.0}] for name in ("alora", "bdlora", "monteclora", "qalora", "velora")},
    "trainable_tokens": [{"token_indices": list(DEMO_TASK_TOKENS)}],
}

SEEDS = (0, 1, 2)

# The published recipe's learning rate where there is one: peft's method comparison
# (method_comparison/MetaMathQA/experiments/ at peft commit 5d602fd: Llama-3.2-3B, 5000 steps of
# batch 4, AdamW, cosine; 1e-4 where the experiment sets none). The plot marks it beside ours.
PEFT_LR = {
    "adalora": 1e-4, "adamss": 1e-4, "boft": 1e-4, "c3a": 0.3, "delora": 1e-3, "dora": 1e-4, "fourierft": 1e-4,
    "gralora": 2e-4, "hira": 4.5e-3, "ia3": 1e-4, "kasa": 1e-4, "ln_tuning": 1e-4, "loha": 1e-4, "lokr": 3e-3, "lora": 1e-4,
    "mica": 1e-4, "miss": 1e-4, "oft": 1e-4, "pvera": 3e-3, "randlora": 1e-4, "road": 1e-3, "shira": 3e-4, "tinylora": 1e-3,
    "unilora": 1e-4, "vblora": 1e-4, "vera": 1e-3, "waveft": 1e-4,
}


FineGrid = dict[str, list[tuple[dict[str, Any], tuple[float, ...]]]]


def fine_grid(coarse: Iterable[dict[str, Any]]) -> FineGrid:
    """The fine grid from the coarse sweep's records: per method, the settings of its best coarse
    run (held-out accuracy on the demo task, ties to the lower held-out loss) and, when those are
    not the method's own defaults and the defaults reached 50 % somewhere, the defaults too (the
    coarse table shows those that did not); for each, three learning rates: its best coarse
    run's and that rate's neighbours on the coarse grid. Run on both tasks, three seeds."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in coarse:
        key = (r["variant"], json.dumps(r["settings"], sort_keys=True))
        if key not in best or (r["acc"], -r["held_out_loss"]) > (best[key]["acc"], -best[key]["held_out_loss"]):
            best[key] = r
    grid: FineGrid = {}
    for variant in sorted({v for v, _ in best}):
        runs = [r for (v, _), r in best.items() if v == variant]
        top = max(runs, key=lambda r: (r["acc"], -r["held_out_loss"]))
        for r in [top, *[r for r in runs if not r["settings"] and r is not top and r["acc"] >= 0.5]]:
            i = min(range(len(COARSE_LRS)), key=lambda k: abs(math.log(COARSE_LRS[k] / r["lr"])))
            grid.setdefault(variant, []).append((r["settings"], tuple(COARSE_LRS[max(0, i - 1) : i + 2])))
    return grid


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of the sweep."""

    variant: str
    task: str
    seed: int
    lr: float
    settings: tuple[tuple[str, Any], ...]  # r, alpha and options, sorted

    def key(self) -> str:
        return json.dumps([self.variant, self.task, self.seed, self.lr, dict(self.settings)], sort_keys=True)


def _settings(d: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(d.items()))


def grid_points(
    grid: str, variants: Sequence[str], lrs: Sequence[float] | None, tasks: Sequence[str], seeds: Sequence[int],
    fine: FineGrid | None = None, settings: dict[str, Any] | None = None,
) -> list[Point]:
    """The runs of ``grid`` (``"coarse"``, ``"fine"``: ``fine``'s settings and rates, or
    ``"lrs"``: ``lrs`` with ``settings``, default each method's own) for ``variants``."""
    points = []
    for variant in variants:
        if grid == "fine":
            pairs = (fine or {})[variant]
        else:
            chosen = COARSE_SETTINGS.get(variant, [{}]) if grid == "coarse" else [settings or {}]
            pairs = [(s, tuple(lrs if lrs is not None else COARSE_LRS)) for s in chosen]
        for task in tasks:
            for settings, chosen_lrs in pairs:
                for lr in chosen_lrs:
                    points.extend(Point(variant, task, seed, lr, _settings(settings)) for seed in seeds)
    return points


class Runner:
    """The model, tokenizer and encoded tasks, loaded once; :meth:`run` trains one point."""

    def __init__(self, steps: int) -> None:
        import lora_func as lf
        from lora_func.demo.corpus import task_split, worked_sum_split
        from lora_func.demo.model import default_targets, load_model
        from lora_func.demo.run import encode_examples

        self.steps = steps
        self.model, tokenizer = load_model()
        self.targets = default_targets(self.model)
        self.base = lf.base_params(self.model)
        self.data = {}
        for task, (train, held_out) in {"sums": task_split(0), "worked_sums": worked_sum_split(0)}.items():
            self.data[task] = (encode_examples(tokenizer, train), encode_examples(tokenizer, held_out))

    def run(self, point: Point) -> dict[str, Any]:
        import torch

        import lora_func as lf
        from lora_func.demo.fitting import fit_and_init
        from lora_func.demo.run import batch_sampler, held_out_accuracy
        from lora_func.train import IGNORE_INDEX, TrainState, fit, make_optimizer

        train, held_out = self.data[point.task]
        settings = dict(point.settings)
        options = {k: v for k, v in settings.items() if k not in ("r", "alpha")}
        row = method_defaults(point.variant)  # a method that trains other modules than the demo's (trainable tokens)
        targets, tied = (row.targets or self.targets), ({"tied": row.tied} if row.tied is not None else {})
        spec = lf.AdapterSpec(point.variant, targets=list(targets), r=settings.get("r", 8), alpha=settings.get("alpha"), **tied, **options)
        calibration = None
        if lf.get_variant(point.variant).calibration is not None:
            calibration = [
                {"input_ids": train.input_ids[i : i + 16], "attention_mask": train.attention_mask[i : i + 16]}
                for i in range(0, min(len(train.examples), 80), 16)
            ]

        def init(s):
            return lf.init_adapter(self.model, s, generator=torch.Generator().manual_seed(point.seed), calibration=calibration)

        record: dict[str, Any] = {"variant": point.variant, "task": point.task, "seed": point.seed, "lr": point.lr,
                                  "settings": settings, "steps": self.steps}
        start = time.perf_counter()
        try:
            fitted = fit_and_init(self.model, spec, init)
        except (ValueError, TypeError, ImportError) as err:  # recorded: the report shows the method without it
            record.update(acc=0.0, loss=math.inf, held_out_loss=math.inf, diverged=None, error=str(err)[:300], seconds=0.0)
            return record
        record["fitted"] = {c.option: c.used for c in fitted.changes}
        adapter = fitted.adapter
        record["trainable"] = adapter.num_parameters()
        try:
            history = fit(self.model, TrainState(adapter, make_optimizer(adapter, point.lr)), batch_sampler(train, 16, point.seed),
                          self.steps, progress=False)
        except FloatingPointError as err:
            record.update(acc=0.0, loss=math.inf, held_out_loss=math.inf, diverged=str(err).split("\n")[0][:200])
        else:
            accuracy, logits = held_out_accuracy(self.model, adapter, held_out, base=self.base)
            labels = held_out.labels.roll(-1, dims=1)
            labels[:, -1] = IGNORE_INDEX
            held_out_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).item()
            loss = sum(s.loss for s in history[-10:]) / len(history[-10:])
            record.update(acc=accuracy, loss=loss, held_out_loss=held_out_loss, diverged=None)
        record["seconds"] = round(time.perf_counter() - start, 2)
        return record


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record_key(r: dict[str, Any]) -> str:
    return json.dumps([r["variant"], r["task"], r["seed"], r["lr"], r["settings"]], sort_keys=True)


# ------------------------------------------------------------------------------- the report


def settings_label(settings: dict[str, Any]) -> str:
    def text(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:g}"
        return "[" + ",".join(map(str, v)) + "]" if isinstance(v, (list, tuple)) else str(v)  # a record's list, a row's tuple

    return ", ".join(f"{k}={text(v)}" for k, v in sorted(settings.items())) or "defaults"


def summarise(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str, float], list[float]]:
    """``(variant, task, settings label, lr) -> held-out accuracies over the seeds``."""
    cells: dict[tuple[str, str, str, float], list[float]] = defaultdict(list)
    for r in records:
        cells[r["variant"], r["task"], settings_label(r["settings"]), r["lr"]].append(r["acc"])
    return cells


def choose(cells: dict[tuple[str, str, str, float], list[float]], variant: str) -> tuple[str, float] | None:
    """The default for ``variant``: among the settings and learning rates whose mean held-out
    accuracy on the demo task is within 10 points of the best (and at least 60 % when the best
    is), the one with the best mean on the worked sums (a rate that only suits one task is not a
    default); ties go to the better demo mean, then to the smaller learning rate. ``None`` when
    ``variant`` has no runs on both tasks."""
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    demo = {(s, lr): mean(v) for (m, t, s, lr), v in cells.items() if m == variant and t == "sums"}
    other = {(s, lr): mean(v) for (m, t, s, lr), v in cells.items() if m == variant and t == "worked_sums"}
    both = [k for k in demo if k in other]
    if not both:
        return None
    best = max(demo[k] for k in both)
    floor = max(best - 0.1, min(best, 0.6))  # the demo's acceptance: 60 % where any setting reaches it
    near = [k for k in both if demo[k] >= floor - 1e-9]
    return max(near, key=lambda k: (other[k], demo[k], -k[1]))


def chosen_defaults(coarse: Iterable[dict[str, Any]], fine: Iterable[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], float]]:
    """Per method, its default (settings, learning rate): :func:`choose` on the fine runs where
    the method has fine runs on both tasks at one point; else its best coarse run (held-out
    accuracy on the demo task, seed 0, ties to the lower held-out loss). ``--grid confirm`` then
    runs that default on both tasks over three seeds, after which :func:`choose` returns it."""
    fine = list(fine)
    cells = summarise(fine)
    settings_of = {(r["variant"], settings_label(r["settings"])): r["settings"] for r in [*coarse, *fine]}
    best: dict[str, dict[str, Any]] = {}
    for r in coarse:
        if r["variant"] not in best or (r["acc"], -r["held_out_loss"]) > (best[r["variant"]]["acc"], -best[r["variant"]]["held_out_loss"]):
            best[r["variant"]] = r
    out = {}
    for variant, top in sorted(best.items()):
        choice = choose(cells, variant)
        out[variant] = (settings_of[variant, choice[0]], choice[1]) if choice is not None else (top["settings"], top["lr"])
    return out


def _cell(values: list[float]) -> str:
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.0%}"
    return f"{mean:.0%} ({min(values):.0%}–{max(values):.0%})"


def report(records: list[dict[str, Any]]) -> str:
    """Markdown: per task, one row per method and settings, one column per learning rate (the
    mean held-out accuracy over the seeds, the seeds' range in brackets); bold where
    :func:`choose` picks; then the choices."""
    cells = summarise(records)
    lines = []
    variants = sorted({r["variant"] for r in records})
    choices = {v: choose(cells, v) for v in variants}
    for task in TASKS:
        keys = [k for k in cells if k[1] == task]
        if not keys:
            continue
        lrs = sorted({k[3] for k in keys})
        lines += [f"### {task}", "", "| method | settings | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
                  "|---|---|" + "---|" * len(lrs)]
        for variant in variants:
            for label in sorted({k[2] for k in keys if k[0] == variant}):
                row = []
                for lr in lrs:
                    values = cells.get((variant, task, label, lr))
                    text = _cell(values) if values else ""
                    row.append(f"**{text}**" if values and choices[variant] == (label, lr) else text)
                lines.append(f"| {variant} | {label} | " + " | ".join(row) + " |")
        lines.append("")
    chosen = [(v, c) for v, c in choices.items() if c is not None]
    if chosen:
        lines += ["### chosen", "", "| method | settings | lr | demo task | worked sums |", "|---|---|---|---|---|"]
        for variant, (label, lr) in chosen:
            lines.append(f"| {variant} | {label} | {lr:g} | {_cell(cells[variant, 'sums', label, lr])} | "
                         f"{_cell(cells[variant, 'worked_sums', label, lr])} |")
    seconds = sum(r["seconds"] for r in records)
    lines += ["", f"{len(records)} runs, {seconds / 3600:.2f} h wall-clock in all (one thread each, on a shared machine)."]
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], path: Path, coarse: Sequence[dict[str, Any]] = ()) -> Path:
    """Small multiples, one panel per method: mean held-out accuracy against the learning rate
    (log axis), per task and settings, the seeds' range shaded; a ring on the chosen default;
    the coarse sweep's runs of the chosen settings (seed 0, demo task) in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = summarise(records)
    variants = sorted({r["variant"] for r in records})
    cols = 6
    rows = math.ceil(len(variants) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.1 * rows), dpi=90, sharey=True, squeeze=False)
    styles = {"sums": "-", "worked_sums": "--"}
    for ax, variant in zip(axes.flat, variants, strict=False):
        choice = choose(cells, variant)
        labels = sorted({k[2] for k in cells if k[0] == variant})
        for i, label in enumerate(labels):
            for task in TASKS:
                points = sorted((lr, v) for (m, t, s, lr), v in cells.items() if m == variant and t == task and s == label)
                if not points:
                    continue
                xs = [lr for lr, _ in points]
                means = [sum(v) / len(v) for _, v in points]
                ax.plot(xs, means, styles[task], color=f"C{i}", linewidth=1.3, marker=".", markersize=3)
                ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points], color=f"C{i}", alpha=0.12)
                if choice is not None and choice[0] == label:
                    for lr, v in points:
                        if lr == choice[1]:
                            ax.plot([lr], [sum(v) / len(v)], "o", markersize=7, markerfacecolor="none", color="k")
        if choice is not None:
            wide = sorted((r["lr"], r["acc"]) for r in coarse if r["variant"] == variant and settings_label(r["settings"]) == choice[0])
            ax.plot([x for x, _ in wide], [y for _, y in wide], color="0.6", linewidth=0.8, zorder=0)
        if variant in PEFT_LR:
            ax.axvline(PEFT_LR[variant], color="C3", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_title(variant, fontsize=9)
        ax.axhline(0.6, color="grey", linewidth=0.5, linestyle=":")
        ax.tick_params(labelsize=7)
        if len(labels) > 1:
            ax.legend([plt.Line2D([], [], color=f"C{i}") for i in range(len(labels))], labels, fontsize=5, loc="upper left", frameon=False)
    for ax in list(axes.flat)[len(variants):]:
        ax.axis("off")
    fig.supxlabel("learning rate (log)", fontsize=9)
    fig.supylabel("held-out accuracy (mean over seeds)", fontsize=9)
    fig.suptitle("solid: demo task (sums), dashed: worked sums, 3 seeds (shaded: their range); grey: the coarse sweep (demo task, "
                 "seed 0); ring: the default; dotted: 60 %;\nred dashed: the learning rate of peft's method comparison (Llama-3.2-3B, 5000 steps)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", choices=("coarse", "fine", "confirm", "lrs"), default="lrs",
                        help="coarse: seed 0, the demo task, COARSE_LRS x COARSE_SETTINGS; fine: fine_grid(--coarse) on both "
                        "tasks, three seeds; confirm: each method's chosen_defaults(--coarse, --out) on both tasks, three seeds; "
                        "lrs: --lrs with each method's own defaults")
    parser.add_argument("--coarse", type=Path, default=None,
                        help="the coarse sweep's JSON-lines file: --grid fine's grid comes from it; with --report, its table is printed "
                        "and its curves drawn in grey")
    parser.add_argument("--variants", default="all", help="comma-separated, or 'all'")
    parser.add_argument("--lrs", default=None, help="comma-separated learning rates (--grid lrs, coarse)")
    parser.add_argument("--tasks", default=None, help=f"comma-separated from {TASKS} (default: sums for coarse, both otherwise)")
    parser.add_argument("--seeds", default=None, help="comma-separated (default: 0 for coarse, 0,1,2 otherwise)")
    parser.add_argument("--settings", type=json.loads, default=None,
                        help='--grid lrs: r, alpha and options for every run, as JSON (e.g. \'{"r": 1000, "scaling": 300.0}\')')
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", type=Path, default=None, help="the JSON-lines file to append to (and resume from)")
    parser.add_argument("--report", type=Path, default=None, help="print the tables of this JSON-lines file and exit")
    parser.add_argument("--plot", type=Path, default=None, help="with --report: also write the curves to this PNG")
    args = parser.parse_args(argv)

    if args.report is not None:
        records = read_records(args.report)
        coarse = read_records(args.coarse) if args.coarse is not None else []
        if coarse:
            print("## coarse sweep (seed 0)\n\n" + report(coarse).split("### chosen")[0], end="")
            print("## fine sweep\n")
        print(report(records), end="")
        if args.plot is not None:
            plot(records, args.plot, coarse)
        return 0

    import torch

    import lora_func as lf

    torch.set_num_threads(1)
    variants = [v for v in lf.list_variants() if v not in NOT_TRAINED] if args.variants == "all" else args.variants.split(",")
    tasks = args.tasks.split(",") if args.tasks else (["sums"] if args.grid == "coarse" else list(TASKS))
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else ([0] if args.grid == "coarse" else list(SEEDS))
    lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else None
    if args.grid == "fine" and args.coarse is None:
        parser.error("--grid fine needs --coarse FILE (the coarse sweep's records)")
    if args.grid == "confirm" and (args.coarse is None or args.out is None):
        parser.error("--grid confirm needs --coarse FILE and --out FILE (the fine runs so far)")
    fine = fine_grid(read_records(args.coarse)) if args.grid == "fine" else None
    if args.grid == "confirm":
        chosen = chosen_defaults(read_records(args.coarse), read_records(args.out))
        fine, args.grid = {v: [(chosen[v][0], (chosen[v][1],))] for v in variants if v in chosen}, "fine"
        variants = [v for v in variants if v in chosen]
    points = grid_points(args.grid, variants, lrs, tasks, seeds, fine, args.settings)
    done = {record_key(r) for r in read_records(args.out)} if args.out is not None else set()
    if args.coarse is not None and args.out is not None:  # a coarse run is a fine point's seed 0 on the demo task: the same run
        same = [r for r in read_records(args.coarse) if record_key(r) in {p.key() for p in points} - done]
        with args.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in same)
        done |= {record_key(r) for r in same}
    todo = [p for p in points if p.key() not in done]
    print(f"{len(points)} runs, {len(points) - len(todo)} already in {args.out}", file=sys.stderr)
    runner = Runner(args.steps)
    records = []
    started = time.perf_counter()
    for i, point in enumerate(todo, start=1):
        record = runner.run(point)
        records.append(record)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
        print(f"[{i}/{len(todo)} {time.perf_counter() - started:.0f}s] {point.variant} {point.task} seed {point.seed} "
              f"lr {point.lr:g} {settings_label(dict(point.settings))}: {record['acc']:.0%}", file=sys.stderr, flush=True)
    print(report(records if args.out is None else read_records(args.out)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
