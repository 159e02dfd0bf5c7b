# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "marimo>=0.9",
#     "lora-func",
#     "torch>=2.4",
#     "matplotlib>=3.7",
# ]
#
# [tool.uv.sources]
# lora-func = { path = "..", editable = true }
# ///
"""A marimo dashboard for the lora-func demo: look at the data, pick variants and
hyperparameters, watch them train, compare.

    marimo run --sandbox examples/dashboard.py            # sets up its own environment (uv)
    marimo run examples/dashboard.py                      # in an environment with lora_func
    marimo run examples/dashboard.py -- --steps 20        # other defaults (also --variants, --r)
    python examples/dashboard.py                          # script mode: a 15-step run, printed

The block above is PEP 723 inline script metadata: ``--sandbox`` builds an environment with
these dependencies and this checkout of lora_func (the path is relative to this file).
Without it: pip install -e ".[dashboard]".
"""

import marimo

__generated_with = "0.25.2"
app = marimo.App(width="medium", app_title="lora_func dashboard")


@app.cell
def _():
    import marimo as mo

    return (mo,)


@app.cell
def _(mo):
    mo.md(
        """
        # lora_func: fine-tune a small language model with every LoRA variant

        The model is a 1.2 M-parameter Llama that lora_func ships, pretrained on a generated
        corpus where every sum is written `3 + 4 = 7 .`. The task asks the same sums in words,
        `what is 3 plus 4 ?`, which the base model has never seen: it answers with a story.
        An adapter trained on 70 of the 100 questions has to learn the *format*; the 30
        held-out questions come out right only if it reuses the sums the base already knows.
        """
    )
    return


@app.cell
def _(mo):
    # The cold start (torch, transformers, the model) takes seconds: say so while it runs.
    with mo.status.spinner(title="Step 1/3: loading torch, lora_func and the demo model…"):
        import base64
        import io
        import tempfile
        import time
        from pathlib import Path

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import torch

        import lora_func as lf
        from lora_func.demo.corpus import task_split
        from lora_func.demo.model import load_model
        from lora_func.demo.run import DEFAULT_LR, DEFAULT_VARIANTS, DemoConfig, encode_examples, run_variant

        _model, tokenizer = load_model()
        train_examples, held_out_examples = task_split(0)
        train_data = encode_examples(tokenizer, train_examples)
        held_out_data = encode_examples(tokenizer, held_out_examples)

    # Script mode (python examples/dashboard.py) has no one to press buttons: it trains at once,
    # briefly, and prints. CLI args after `--` set the app's defaults.
    SCRIPT = mo.app_meta().mode == "script"
    args = mo.cli_args()
    defaults = {
        "variants": str(args.get("variants", "lora" if SCRIPT else ",".join(DEFAULT_VARIANTS))).split(","),
        "steps": int(args.get("steps", 15 if SCRIPT else 120)),
        "r": int(args.get("r", 8)),
        "lr": "",
        "dtype": "float32",
    }
    return (
        DEFAULT_LR, DemoConfig, Path, SCRIPT, base64, defaults, held_out_data, held_out_examples, io, lf, load_model, plt,
        run_variant, tempfile, time, tokenizer, torch, train_data, train_examples,
    )


@app.cell
def _(held_out_examples, mo, train_examples):
    rows = [
        {"#": i, "split": split, "prompt": e.prompt, "answer": e.answer}
        for i, (split, e) in enumerate(
            [("train", e) for e in train_examples] + [("held-out", e) for e in held_out_examples]
        )
    ]
    mo.ui.table(rows, page_size=10, selection=None, label="The task: 70 training and 30 held-out questions")
    return


@app.cell
def _(DEFAULT_LR, defaults, lf, mo):
    def _check_lr(value):
        text = (value or {}).get("lr", "").strip()
        if not text:
            return None
        try:
            ok = float(text) > 0
        except ValueError:
            ok = False
        return None if ok else f"learning rate {text!r} is not a positive number: type e.g. 3e-3, or leave it empty"

    # A form: the controls only take effect on "Train", so touching one after a run never
    # re-runs (and wipes) the training and its results.
    settings = (
        mo.md(
            """
            {variants} {rank} {steps}

            {lr} {dtype}
            """
        )
        .batch(
            variants=mo.ui.multiselect(options=lf.list_variants(), value=defaults["variants"], label="variants"),
            rank=mo.ui.slider(1, 32, value=defaults["r"], label="rank r", show_value=True),
            steps=mo.ui.number(start=1, stop=2000, value=defaults["steps"], label="steps per variant"),
            lr=mo.ui.text(value=defaults["lr"], label="learning rate (empty: per-variant default)"),
            dtype=mo.ui.dropdown(["float32", "bfloat16", "float16"], value=defaults["dtype"], label="base dtype"),
        )
        .form(submit_button_label="Train", validate=_check_lr, bordered=True)
    )
    lr_defaults = ", ".join(f"`{name}` {value:g}" for name, value in sorted(DEFAULT_LR.items()))
    mo.vstack(
        [
            mo.md("## Configuration"),
            settings,
            mo.accordion(
                {
                    "What do these mean?": mo.callout(
                        mo.md(
                            f"""
- **variants**: `lora` adds a low-rank update `B A`; `dora` also learns each output row's
  magnitude; `ia3` only rescales features (a few hundred numbers per layer); `pissa`
  starts from the top singular directions; `delora` normalises each rank-1 direction and
  learns its scale; `hra` multiplies by Householder reflections; `eva` initialises `A`
  from the SVD of layer inputs on training batches; `antipasto` rotates and rescales the
  weight's own singular basis. See docs/guide/variants.md.
- **rank r**: the size of the update (trainable parameters grow linearly in r).
- **learning rate**: the per-variant defaults were measured on this task: {lr_defaults}.
  Multiplicative and normalised variants (ia3, delora, antipasto) want larger steps.
- **base dtype**: the frozen model's dtype; adapters stay float32 either way. float16
  trains with a GradScaler (docs/guide/precision.md).
"""
                        ),
                        kind="info",
                    )
                }
            ),
        ]
    )
    return (settings,)


@app.cell
def _(
    DemoConfig, Path, SCRIPT, base64, defaults, held_out_data, io, load_model, mo, plt, run_variant, settings, tempfile,
    time, tokenizer, torch, train_data,
):
    chosen = settings.value if settings.value is not None else ({**defaults, "rank": defaults["r"]} if SCRIPT else None)
    mo.stop(chosen is None, mo.callout(mo.md("Press **Train** to fine-tune the selected variants."), kind="info"))
    mo.stop(not chosen["variants"], mo.callout(mo.md("Select at least one variant, then press **Train**."), kind="warn"))

    def loss_figure(curves, title):
        """The loss curves as a full-width image (matplotlib's own HTML has a fixed pixel width)."""
        fig, ax = plt.subplots(figsize=(11, 3.6), dpi=100)
        for name, values in curves.items():
            ax.plot(range(1, len(values) + 1), values, label=name, linewidth=1.2)
        ax.set(xlabel="step", ylabel="training loss", yscale="log", title=title)
        ax.grid(alpha=0.3)
        if curves:
            ax.legend()
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        data = base64.b64encode(buffer.getvalue()).decode()
        return mo.Html(f'<img src="data:image/png;base64,{data}" alt="{title}" style="width:100%;height:auto;display:block">')

    config = DemoConfig(
        variants=list(chosen["variants"]), r=int(chosen["rank"]), steps=int(chosen["steps"]),
        lr=float(chosen["lr"]) if chosen["lr"].strip() else None, dtype=getattr(torch, chosen["dtype"]), progress=False,
        samples=3,
    )
    started = time.perf_counter()
    curves, results = {}, []
    model = load_model(dtype=config.dtype)[0]
    mo.output.replace(loss_figure(curves, "training loss (live)"))  # output 0: the live plot; the progress bar follows
    with mo.status.progress_bar(total=len(config.variants) * config.steps, title="Step 2/3: fine-tuning") as bar:
        for index, name in enumerate(config.variants, start=1):
            curves[name] = []

            def on_step(stats, name=name, index=index):
                curves[name].append(stats.loss)
                bar.update(subtitle=f"variant {index}/{len(config.variants)}: {name}, step {stats.step + 1}/{config.steps}, loss {stats.loss:.3f}")
                if stats.step % 5 == 4 or stats.step + 1 == config.steps:
                    mo.output.replace_at_index(loss_figure(curves, "training loss (live)"), 0)

            with tempfile.TemporaryDirectory() as tmp:
                results.append(run_variant(model, tokenizer, name, config, train_data, held_out_data, Path(tmp), on_step=on_step))
    seconds = time.perf_counter() - started
    final_plot = loss_figure(curves, "training loss")
    # The live plot and the progress bar make way for the results cell below.
    mo.output.replace(mo.md("Step 3/3: evaluating and comparing: see the results below."))
    if SCRIPT:
        for row in results:
            print(f"{row['variant']}: held-out accuracy {row['acc_before']:.0%} -> {row['acc_after']:.0%}, final loss {row['final_loss']:.3f}")
    return config, final_plot, results, seconds


@app.cell
def _(config, final_plot, mo, results, seconds):
    summary = [
        {
            "variant": r["variant"],
            "trainable": f"{r['trainable']:,} ({r['trainable_pct']:.2f} %)",
            "lr": f"{r['lr']:g}",
            "acc. before": f"{r['acc_before']:.0%}",
            "acc. after": f"{r['acc_after']:.0%}",
            "final loss": round(r["final_loss"], 3),
            "ms/step": round(r["ms_per_step"], 1),
            "reload": "identical" if r["reload_identical"] else f"max diff {r['reload_max_abs_diff']:.1e}",
        }
        for r in results
    ]
    samples = [{"#": i, "variant": r["variant"], **s} for i, (r, s) in enumerate((r, s) for r in results for s in r["samples"])]
    done = mo.callout(
        mo.md(
            f"**Training complete**: {len(results)} variant(s) × {config.steps} steps in {seconds:.0f} s. "
            f"These results stay here until the next **Train**; changing the settings does not clear them."
        ),
        kind="success",
    )
    mo.vstack(
        [
            done,
            mo.md("## Results"),
            final_plot,
            mo.ui.table(summary, selection=None, label="results (acc.: held-out accuracy on the 30 questions never trained on)"),
            mo.md("## Generated answers, before and after"),
            mo.ui.table(samples, selection=None, page_size=10, label="samples"),
        ]
    )
    return


if __name__ == "__main__":
    app.run()
