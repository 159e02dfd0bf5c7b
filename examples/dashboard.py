"""A marimo dashboard for the lora-func demo: look at the data, pick variants and
hyperparameters, watch them train, compare.

    marimo run examples/dashboard.py                      # the app, in the browser
    marimo run examples/dashboard.py -- --steps 20        # other defaults (also --variants, --r)
    python examples/dashboard.py                          # script mode: a 15-step run, printed

Needs the dashboard extra: pip install -e ".[dashboard]".
"""

import marimo

__generated_with = "0.25.2"
app = marimo.App(width="medium", app_title="lora_func dashboard")


@app.cell
def _():
    import tempfile
    from pathlib import Path

    import marimo as mo
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import lora_func as lf
    from lora_func.demo.corpus import task_split
    from lora_func.demo.model import load_model
    from lora_func.demo.run import (
        DEFAULT_LR,
        DEFAULT_VARIANTS,
        DemoConfig,
        encode_examples,
        run_variant,
    )

    # Script mode (python examples/dashboard.py) has no one to press buttons: it trains at once,
    # briefly, and prints. CLI args after `--` set the app's defaults.
    SCRIPT = mo.app_meta().mode == "script"
    args = mo.cli_args()
    defaults = {
        "variants": str(args.get("variants", "lora" if SCRIPT else ",".join(DEFAULT_VARIANTS))).split(","),
        "steps": int(args.get("steps", 15 if SCRIPT else 120)),
        "r": int(args.get("r", 8)),
    }
    return (
        DEFAULT_LR, DemoConfig, Path, SCRIPT, defaults, encode_examples, lf, load_model, mo, plt, run_variant, task_split,
        tempfile, torch,
    )


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
def _(encode_examples, load_model, mo, task_split):
    _model, tokenizer = load_model()
    train_examples, held_out_examples = task_split(0)
    rows = [
        {"split": split, "prompt": e.prompt, "answer": e.answer}
        for split, examples in (("train", train_examples), ("held-out", held_out_examples))
        for e in examples
    ]
    dataset_table = mo.ui.table(rows, page_size=10, selection=None, label="The task: 70 training and 30 held-out questions")
    train_data = encode_examples(tokenizer, train_examples)
    held_out_data = encode_examples(tokenizer, held_out_examples)
    dataset_table
    return held_out_data, tokenizer, train_data


@app.cell
def _(DEFAULT_LR, defaults, lf, mo):
    variants = mo.ui.multiselect(options=lf.list_variants(), value=defaults["variants"], label="variants")
    rank = mo.ui.slider(1, 32, value=defaults["r"], label="rank r", show_value=True)
    steps = mo.ui.number(start=1, stop=2000, value=defaults["steps"], label="steps per variant")
    lr = mo.ui.text(value="", label="learning rate (empty: per-variant default)")
    dtype = mo.ui.dropdown(["float32", "bfloat16", "float16"], value="float32", label="base dtype")
    train_button = mo.ui.run_button(label="Train", kind="success")
    mo.vstack(
        [
            mo.md("## Configuration"),
            mo.hstack([variants, rank, steps]),
            mo.hstack([lr, dtype, train_button]),
            mo.accordion(
                {
                    "What do these mean?": mo.md(
                        f"""
- **variants**: `lora` adds a low-rank update `B A`; `dora` also learns each output row's
  magnitude; `ia3` only rescales features (a few hundred numbers per layer); `pissa`
  starts from the top singular directions; `delora` normalises each rank-1 direction and
  learns its scale; `hra` multiplies by Householder reflections; `eva` initialises `A`
  from the SVD of layer inputs on training batches; `antipasto` rotates and rescales the
  weight's own singular basis. See docs/guide/variants.md.
- **rank r**: the size of the update (trainable parameters grow linearly in r).
- **learning rate**: per-variant defaults {DEFAULT_LR} were measured on this task;
  multiplicative and normalised variants (ia3, delora, antipasto) want larger steps.
- **base dtype**: the frozen model's dtype; adapters stay float32 either way. float16
  trains with a GradScaler (docs/guide/precision.md).
"""
                    )
                }
            ),
        ]
    )
    return dtype, lr, rank, steps, train_button, variants


@app.cell
def _(
    DemoConfig, Path, SCRIPT, dtype, held_out_data, load_model, lr, mo, plt, rank, run_variant, steps, tempfile, tokenizer,
    torch, train_button, train_data, variants,
):
    mo.stop(not (train_button.value or SCRIPT), mo.md("Press **Train** to fine-tune the selected variants."))

    def loss_figure(curves):
        fig, ax = plt.subplots(figsize=(7, 3.5), dpi=90)
        for name, values in curves.items():
            ax.plot(range(1, len(values) + 1), values, label=name, linewidth=1.2)
        ax.set(xlabel="step", ylabel="training loss", yscale="log", title="training loss (live)")
        ax.grid(alpha=0.3)
        if curves:
            ax.legend()
        fig.tight_layout()
        html = mo.as_html(fig)
        plt.close(fig)
        return html

    config = DemoConfig(
        variants=list(variants.value), r=rank.value, steps=int(steps.value), lr=float(lr.value) if lr.value.strip() else None,
        dtype=getattr(torch, dtype.value), progress=False, samples=3,
    )
    model = load_model(dtype=config.dtype)[0]
    curves, results = {}, []
    mo.output.replace(loss_figure(curves))  # output 0: the live plot; the progress bar comes after it
    with mo.status.progress_bar(total=len(config.variants) * config.steps, title="fine-tuning") as bar:
        for name in config.variants:
            curves[name] = []

            def on_step(stats, name=name):
                curves[name].append(stats.loss)
                bar.update(subtitle=f"{name}: step {stats.step + 1}, loss {stats.loss:.3f}")
                if stats.step % 5 == 4 or stats.step + 1 == config.steps:
                    mo.output.replace_at_index(loss_figure(curves), 0)

            with tempfile.TemporaryDirectory() as tmp:
                results.append(run_variant(model, tokenizer, name, config, train_data, held_out_data, Path(tmp), on_step=on_step))
    if SCRIPT:
        for row in results:
            print(f"{row['variant']}: held-out accuracy {row['acc_before']:.0%} -> {row['acc_after']:.0%}, final loss {row['final_loss']:.3f}")
    return (results,)


@app.cell
def _(mo, results):
    summary = [
        {
            "variant": r["variant"],
            "trainable": f"{r['trainable']:,} ({r['trainable_pct']:.2f} %)",
            "lr": r["lr"],
            "acc. before": f"{r['acc_before']:.0%}",
            "acc. after": f"{r['acc_after']:.0%}",
            "final loss": round(r["final_loss"], 3),
            "ms/step": round(r["ms_per_step"], 1),
            "reload": "identical" if r["reload_identical"] else f"max diff {r['reload_max_abs_diff']:.1e}",
        }
        for r in results
    ]
    samples = [{"variant": r["variant"], **s} for r in results for s in r["samples"]]
    mo.vstack(
        [
            mo.md("## Results"),
            mo.ui.table(summary, selection=None, label="results (acc.: held-out accuracy on the 30 questions never trained on)"),
            mo.md("## Generated answers, before and after"),
            mo.ui.table(samples, selection=None, page_size=10, label="samples"),
        ]
    )
    return


if __name__ == "__main__":
    app.run()
