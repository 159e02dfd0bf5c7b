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
    # The guide's pages (docs/) open in a new tab of this app: a browser does not follow a
    # file:// link from a served page, and marimo serves no files outside public/. A link is
    # `?guide=docs/...md`; in that tab this cell renders the page and stops every other cell
    # (they all depend on it), so the tab opens in a second without loading torch.
    import re
    from pathlib import Path

    REPO = Path(mo.notebook_dir() or Path.cwd()).resolve().parent  # examples/..
    MD_LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|#)([^)\s#]+\.md)(#[^)\s]*)?\)")

    def doc_link(path, text=None):
        """HTML for a link to the guide page ``path`` (relative to the repository, e.g.
        ``docs/guide/variants.md``), opened in a new tab; the text is the path unless given."""
        return f'<a href="?guide={path}" target="_blank" rel="noopener">{text or path}</a>'

    def guide_page(path):
        """The guide page ``path`` as markdown, its links to other pages made clickable."""
        file = (REPO / path).resolve()
        if file.suffix != ".md" or not file.is_file() or not file.is_relative_to(REPO / "docs"):
            pages = ", ".join(doc_link(p.relative_to(REPO).as_posix()) for p in sorted((REPO / "docs").rglob("*.md")))
            return mo.callout(mo.md(f"No guide page `{path}` in this checkout. The pages: {pages}"), kind="danger")

        def relink(match):  # a new tab again: a tab's session serves one page
            target = (file.parent / match[2]).resolve()
            if not (target.is_file() and target.is_relative_to(REPO / "docs")):
                return match[0]  # left as it was: this app shows pages under docs/ only
            return doc_link(target.relative_to(REPO).as_posix(), match[1])

        text = MD_LINK.sub(relink, file.read_text())
        return mo.vstack([mo.md(f"`{path}`, opened from the lora_func dashboard: close this tab to go back."), mo.md(text)])

    requested_page = mo.query_params().get("guide")
    if requested_page is not None:
        mo.stop(True, guide_page(requested_page))
    return Path, doc_link


@app.cell
def _(doc_link, mo):
    mo.md(
        f"""
        # lora_func: fine-tune a small language model with every LoRA variant

        The model is a 1.2 M-parameter Llama that lora_func ships, pretrained on a generated
        corpus where every sum is written `3 + 4 = 7 .`. The task asks the same sums in words,
        `what is 3 plus 4 ?`, which the base model has never seen: it answers with a story.
        An adapter trained on 70 of the 100 questions has to learn the *format*; the 30
        held-out questions come out right only if it reuses the sums the base already knows.
        More in {doc_link("docs/guide/demo.md")} and {doc_link("docs/guide/why-adapters.md")}.
        """
    )
    return


@app.cell
def _(Path, mo):
    # The cold start (torch, transformers, the model) takes seconds: say so while it runs.
    with mo.status.spinner(title="Step 1/2: loading torch, lora_func and the demo model…"):
        import base64
        import io
        import tempfile
        import time

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import torch
        from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

        import lora_func as lf
        from lora_func.demo.corpus import task_split
        from lora_func.demo.model import default_targets, load_model
        from lora_func.demo.defaults import NOT_TRAINED, method_defaults
        from lora_func.demo.run import DEFAULT_VARIANTS, DemoConfig, encode_examples, run_variant

        _model, tokenizer = load_model()
        train_examples, held_out_examples = task_split(0)
        train_data = encode_examples(tokenizer, train_examples)
        held_out_data = encode_examples(tokenizer, held_out_examples)

    # Script mode (python examples/dashboard.py) has no one to press buttons: it trains at once,
    # briefly, and prints. CLI args after `--` set the app's defaults (`--variants all`: every one).
    SCRIPT = mo.app_meta().mode == "script"
    RANK_PER_METHOD = "per method"  # the rank control's default: each method's own (lora_func/demo/defaults.py)
    args = mo.cli_args()
    _variants = str(args.get("variants", "lora" if SCRIPT else ",".join(DEFAULT_VARIANTS)))
    defaults = {
        "variants": lf.list_variants() if _variants == "all" else _variants.split(","),
        "steps": int(args.get("steps", 15 if SCRIPT else 120)),
        "r": str(args.get("r", RANK_PER_METHOD)),
        "lr": "",
        "dtype": "float32",
    }
    return (
        DemoConfig, FuncFormatter, LogLocator, MaxNLocator, NOT_TRAINED, NullFormatter, RANK_PER_METHOD, SCRIPT, base64,
        default_targets, defaults, held_out_data, held_out_examples, io, lf, load_model, method_defaults, plt, run_variant, tempfile, time,
        tokenizer, torch, train_data, train_examples,
    )


@app.cell
def _(held_out_examples, mo, train_examples):
    # The last column shows what the base model knows: the same sum in its pretraining notation.
    rows = [
        {"#": i, "split": split, "question (prompt)": e.prompt, "expected answer": e.answer,
         "what the base model saw in pretraining": f"{e.a} + {e.b} = {e.a + e.b} ."}
        for i, (split, e) in enumerate(
            [("train", e) for e in train_examples] + [("held-out", e) for e in held_out_examples]
        )
    ]
    mo.ui.table(
        rows, page_size=10, selection=None, column_widths={"#": 60, "split": 100},
        label="The task: 70 training and 30 held-out questions (the held-out ones are never trained on)",
    )
    return


@app.cell
def _():
    # One entry per variant the dashboard offers (tests/test_dashboard.py checks that every
    # option has one): the idea, when to pick it, and its reference page.
    VARIANT_HELP = {
        "lora": ("adds a low-rank update `s·B A` to each weight, B = 0 at start",
                 "the default: every tool supports it (peft, vLLM, merging)", "docs/variants/lora.md"),
        "pissa": ("LoRA started on the top singular directions of W; trains on the residual",
                  "LoRA's format with faster, steadier convergence", "docs/variants/pissa.md"),
        "eva": ("LoRA with A started from the SVD of the layer *inputs* on training batches",
                "you have a few batches of task data when you create the adapter", "docs/variants/eva.md"),
        "dora": ("splits W into per-row magnitude and direction; LoRA on the direction",
                 "LoRA underfits at small r (each step costs a row norm more)", "docs/variants/dora.md"),
        "delora": ("LoRA with each rank-1 direction normalised and a learnt scale: a bounded update",
                   "long runs: the update's norm cannot run away", "docs/variants/delora.md"),
        "hra": ("multiplies W by r Householder reflections (orthogonal: keeps W's spectrum)",
                "you want to keep the base's geometry; robust to the learning rate", "docs/variants/hra.md"),
        "ia3": ("rescales each output feature by a learnt gain (a few hundred numbers per layer)",
                "the smallest adapters, many tasks per base; needs a ~30× larger learning rate", "docs/variants/ia3.md"),
        "ia3_ff": ("rescales each *input* feature (peft's IA3 on feed-forward layers)",
                   "as ia3, on the inputs (what peft does for `down_proj`)", "docs/variants/ia3.md"),
        "antipasto": ("rotates and rescales W's own top singular vectors; a `steer` knob scales it at inference",
                      "steering: dial an adapter's effect up, down or negative without retraining",
                      "docs/variants/antipasto.md"),
        "loha": ("the Hadamard product of two low-rank updates (LyCORIS): rank up to r² from LoRA-like factors",
                 "LoRA's rank is the bottleneck; diffusion users' LyCORIS checkpoints", "docs/variants/loha.md"),
        "lokr": ("a Kronecker product W1 ⊗ W2 of small factors (LyCORIS): a full-rank update from few numbers",
                 "the fewest parameters with a high-rank update", "docs/variants/lokr.md"),
        "gralora": ("a k×k grid of small LoRA blocks (+ an optional plain LoRA): k·r rank at LoRA's cost",
                    "LoRA at larger r stops improving; the same parameters, finer blocks", "docs/variants/gralora.md"),
        "miss": ("one small block shared, tiled over the whole weight (or W's r×r blocks made affine)",
                 "the fewest parameters per layer and the cheapest step", "docs/variants/miss.md"),
        "ln_tuning": ("trains a copy of each targeted layer (peft's LN tuning: meant for norm layers)",
                      "norm targets (`input_layernorm`, `norm`); on the demo's attention projections it is their full fine-tuning",
                      "docs/variants/ln_tuning.md"),
        "adalora": ("LoRA in SVD form P Λ Q whose rank budget moves to the layers that matter (lora_func.rank_budget)",
                 "you do not know which layers need rank; a fixed total budget", "docs/variants/adalora.md"),
        "olora": ("LoRA started from the QR factors of each weight, the residual kept aside (base untouched)",
                 "faster early convergence than LoRA's zero start", "docs/variants/olora.md"),
        "corda": ("LoRA started from the weight's directions that matter for your data (a calibration covariance)",
                 "you have calibration data and want task-aware init (ipm) or knowledge kept (kpm)", "docs/variants/corda.md"),
        "mica": ("B fixed to the weight's minor singular directions, only A trains",
                 "half LoRA's trainable tensors with a principled frozen half", "docs/variants/mica.md"),
        "lora_ga": ("LoRA started from the SVD of the loss gradient on your data (the residual kept aside)",
                    "you have labelled data at init and want full fine-tuning's first steps", "docs/variants/lora_ga.md"),
        "loftq": ("the weight quantized (NF4 / int8) in the adapter, LoRA started on the quantization error",
                  "you will train on a 4- or 8-bit base", "docs/variants/loftq.md"),
        "kasa": ("LoRA in SVD form B diag(ΔΣ) A on the weight without its r smallest singular directions",
                 "an SVD-form update with KaSA's regulariser (lora_func.kasa_penalty)", "docs/variants/kasa.md"),
        "oft": ("rotates each weight by a block-diagonal orthogonal matrix (Cayley map of skew blocks)",
                 "keep the pretrained features' angles (subject-driven generation, small shifts)", "docs/variants/oft.md"),
        "boft": ("a product of butterfly-permuted block-diagonal rotations: dense orthogonal from few numbers",
                 "OFT's blocks are too local; a full rotation at O(d log d) parameters", "docs/variants/boft.md"),
        "road": ("2×2 rotations and scalings of output pairs",
                 "the fewest parameters; many adapters batched cheaply", "docs/variants/road.md"),
        "hira": ("W ⊙ (1 + B A): a Hadamard low-rank update, high rank at LoRA's cost",
                 "LoRA's rank limits the task", "docs/variants/hira.md"),
        "c3a": ("a block-circulant update applied by FFT circular convolution",
                 "high rank from d parameters per block", "docs/variants/c3a.md"),
        "fourierft": ("learned coefficients at fixed random 2-D frequencies, ΔW = their inverse DFT",
                 "the fewest parameters for a dense update", "docs/variants/fourierft.md"),
        "waveft": ("learned wavelet coefficients at fixed random positions, ΔW = their inverse 2-D DWT",
                 "few parameters for a locally structured dense update", "docs/variants/waveft.md"),
        "shira": ("sparse trainable values at fixed positions (r·(d_in + d_out) of them)",
                 "switch many adapters fast; sparse updates", "docs/variants/shira.md"),
        "vera": ("two scaling vectors per layer over one random basis shared by every layer",
                 "thousands of adapters or ensemble members: a few numbers each", "docs/variants/vera.md"),
        "pvera": ("VeRA with a probabilistic (sampled) down-projection",
                 "VeRA with regularisation from sampling", "docs/variants/pvera.md"),
        "vblora": ("A and B assembled from a global bank of sub-vectors by learned top-k mixtures",
                 "the fewest stored bytes per adapter", "docs/variants/vblora.md"),
        "randlora": ("a sum of random full-rank bases, each with a learned diagonal",
                 "full-rank updates with few trainable numbers", "docs/variants/randlora.md"),
        "adamss": ("small updates in subspaces of each weight's own SVD, output rows clustered by k-means (ASA prunes subspaces)",
                   "very few numbers along the base's dominant directions; needs scikit-learn", "docs/variants/adamss.md"),
        "tinylora": ("frozen SVD factors of W around a core projected from one tiny vector (shared by layer groups)",
                 "the fewest trainable numbers: a whole model in tens", "docs/variants/tinylora.md"),
        "unilora": ("every entry of every A and B is a scaled entry of one shared vector θ",
                 "a fixed trainable budget whatever the model; layers share what they learn", "docs/variants/unilora.md"),
        "beft": ("a trained bias added to each target's output (BitFit-style), also where the layer has none",
                 "the smallest adapter of all: one vector per layer", "docs/variants/beft.md"),
        "glora": ("W + W ⊙ A + B and b + b ⊙ D + E + W C, each path LoRA, a vector, a constant or off",
                  "the most configurable update: choose each path's form", "docs/variants/glora.md"),
        "osf": ("the top singular directions of W frozen, the rest of its SVD trained, gradients kept off the top",
                "continual learning: keep what the base knows best", "docs/variants/osf.md"),
        "psoft": ("an r×r orthogonal map (Cayley) between W's top-r singular factors, with magnitude vectors",
                  "rotate the principal subspace at a LoRA-like cost", "docs/variants/psoft.md"),
        "deft": ("a learned direction P projected out of W and a new part Q R injected (PaRa: projection only)",
                 "replace a subspace of the weight rather than add to it", "docs/variants/deft.md"),
        "peanut": ("a small network of W itself (with skips) gives the update's low-rank factor",
                   "a weight-aware update: the adapter reads the weight it changes", "docs/variants/peanut.md"),
        "supertuning": ("trains the largest-magnitude entries of W only (a sparse support), optionally plus a LoRA",
                        "sparse updates chosen by weight magnitude; Supra adds a LoRA", "docs/variants/supertuning.md"),
        "lora_bias": ("LoRA plus a trained bias on lora_B (peft's lora_bias=True)",
                      "LoRA where the targets have a bias to adapt too", "docs/variants/lora_bias.md"),
        "bdlora": ("LoRA with one factor block-diagonal, in blocks that match a tensor-parallel split",
                   "you will serve many adapters on tensor-parallel GPUs", "docs/variants/bdlora.md"),
        "qalora": ("LoRA whose A reads the input pooled over groups (the quantization groups of the base)",
                   "a quantized base whose merged weight must stay quantized", "docs/variants/qalora.md"),
        "velora": ("LoRA's forward; A's gradient from activations compressed into groups during training",
                   "activation memory limits the training batch", "docs/variants/velora.md"),
        "monteclora": ("LoRA whose A is sampled from a learned Gaussian mixture in training, with its KL penalty",
                       "noisy or small data: a more robust, variational LoRA", "docs/variants/monteclora.md"),
        "alora": ("LoRA that acts only from an invocation sequence on, so the base's KV cache stays valid",
                  "intrinsics switched on mid-conversation without a new prefill", "docs/variants/alora.md"),
        "trainable_tokens": ("only the listed rows of an embedding trained (new or retrained tokens)",
                             "add or retrain a few tokens; embedding targets only", "docs/variants/trainable_tokens.md"),
        "poly": ("per layer, a few LoRA skills mixed by a learned router per task (Poly; MHR with n_splits)",
                 "multi-task training: one adapter, a task id per example", "docs/variants/poly.md"),
        "arrow": ("training-free per-token routing over trained task LoRAs by their top singular directions",
                  "you already have a library of task LoRAs to combine (built with lf.routed.arrow)", "docs/variants/arrow.md"),
        "xlora": ("a trained classifier on a first pass's hidden states mixes LoRA experts per token and layer (X-LoRA)",
                  "trained LoRA experts to mix within a sequence, and data to train the mixture (built with lf.routed.xlora)",
                  "docs/variants/xlora.md"),
        "lily": ("A per few layers, B's tied over each target name mixed by a per-layer router (its softmax averaged over the call's tokens)",
                 "fewer, larger adapters than LoRA at a similar count; no merged weight", "docs/variants/lily.md"),
        "frod": ("W replaced by U (S + diag λ) Vᵀ: V shared by the layers of one role, λ and a sparse S trained (FRoD)",
                 "a full-rank update at a sparse budget; U costs a copy of each target's weight", "docs/variants/frod.md"),
    }
    return (VARIANT_HELP,)


@app.cell
def _(NOT_TRAINED, RANK_PER_METHOD, VARIANT_HELP, defaults, doc_link, lf, method_defaults, mo):
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
            rank=mo.ui.dropdown([RANK_PER_METHOD, "1", "2", "4", "8", "16", "32", "64"], value=defaults["r"], label="rank r"),
            steps=mo.ui.number(start=1, stop=2000, value=defaults["steps"], label="steps per variant"),
            lr=mo.ui.text(value=defaults["lr"], label="learning rate (empty: per-variant default)"),
            dtype=mo.ui.dropdown(["float32", "bfloat16", "float16"], value=defaults["dtype"], label="base dtype"),
        )
        .form(submit_button_label="Train", validate=_check_lr, bordered=True)
    )
    def default_text(name):
        """The method's demo defaults, as the help table shows them: ``lr 0.003, r 8``."""
        if name in NOT_TRAINED:
            return "not trained by the demo"
        row = method_defaults(name)
        extra = [f"alpha {row.alpha:g}"] if row.alpha is not None else []
        extra += [f"{k} {v:g}" if isinstance(v, float) else f"{len(v)} {k}" if isinstance(v, tuple) else f"{k} {v}"
                  for k, v in row.options.items()]
        extra += [f"on {', '.join(row.targets)}"] if row.targets is not None else []
        return ", ".join([f"lr {row.lr:g}", f"r {row.rank()}", *extra])

    variant_rows = "\n".join(
        f"| `{name}` | {idea} | {when} | {default_text(name)} | {doc_link(page)} |"
        for name, (idea, when, page) in VARIANT_HELP.items()
        if name in lf.list_variants()
    )
    help_text = mo.md(
        f"""
**Which variant?** Start with `lora`. Pick `ia3` for the smallest adapter, `pissa` or `eva`
when LoRA converges slowly, `dora` when LoRA underfits at small r, `hra` to keep the base's
geometry, `antipasto` to steer. The trade-offs, measured: {doc_link("docs/guide/variants.md")}.

| variant | the idea | pick it when | demo default | details |
|:--|:--|:--|:--|:--|
{variant_rows}

- **rank r**: the size of the update; trainable parameters grow linearly in r (not for ia3,
  ia3_ff: one gain per feature). *per method* takes each method's own (the *demo default*
  column: for most r 8; FourierFT's r is its number of frequencies, C3A's its block size).
  An r that does not fit a model's layers is lowered to the largest that does, and the results
  say so. {doc_link("docs/guide/hyperparameters.md")}
- **steps per variant**: training steps of 16 questions each; 120 learns the task, a few
  dozen show the trend.
- **learning rate**: empty uses each method's default (the *demo default* column), chosen by a
  sweep on this task and a second one ({doc_link("docs/guide/hyperparameters.md")}): they differ by
  a factor of a thousand between methods. One value typed here applies to every variant.
- **base dtype**: the frozen model's dtype; adapters stay float32 either way. bfloat16 and
  float16 halve the base's memory; float16 trains with a GradScaler, which skips a step whose
  gradients overflow. {doc_link("docs/guide/precision.md")}
"""
    )
    mo.vstack(
        [
            mo.md("## Configuration"),
            settings,
            mo.accordion({"What do these mean?": mo.callout(help_text, kind="info")}, expanded=True),
        ]
    )
    return (settings,)


@app.cell
def _(FuncFormatter, LogLocator, MaxNLocator, NullFormatter, base64, io, mo, plt):
    SMOOTHING = 10  # steps in the moving mean drawn bold (the table's final loss is the same mean at the end)

    def moving_mean(values, window=SMOOTHING):
        """The mean of each value and the up to ``window - 1`` values before it."""
        out, total = [], 0.0
        for i, value in enumerate(values):
            total += value - (values[i - window] if i >= window else 0.0)
            out.append(total / min(i + 1, window))
        return out

    def loss_figure(curves, title, labels=None):
        """The training loss of each variant against the step: each step faint, the moving mean
        bold; a log loss axis with plain-number ticks, whole-number steps, the legend beside the
        plot (never over a curve). ``labels``: legend text per variant (default: its name)."""
        fig, ax = plt.subplots(figsize=(11, 3.8), dpi=100)
        for i, (name, values) in enumerate(curves.items()):
            steps = range(1, len(values) + 1)
            ax.plot(steps, values, color=f"C{i % 10}", linewidth=0.7, alpha=0.35)
            ax.plot(steps, moving_mean(values), color=f"C{i % 10}", linewidth=2, label=(labels or {}).get(name, name))
        ax.set(xlabel="step", ylabel="training loss (log scale)", yscale="log",
               title=f"{title}   (bold: mean of the last {SMOOTHING} steps; faint: each step)")
        # Ticks at 1-9 × 10^k within one decade, 1, 2, 5 × 10^k up to three, powers of ten beyond:
        # at least two labelled ticks, never a crowd.
        low, high = ax.get_ylim()
        subs = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0) if high < 10 * low else (1.0, 2.0, 5.0) if high < 1000 * low else (1.0,)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3, which="major")
        if curves:
            ax.set_xlim(left=1)
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        fig.tight_layout()
        return fig

    def figure_html(fig, alt):
        """``fig`` as a full-width image (matplotlib's own HTML has a fixed pixel width)."""
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        data = base64.b64encode(buffer.getvalue()).decode()
        return mo.Html(f'<img src="data:image/png;base64,{data}" alt="{alt}" style="width:100%;height:auto;display:block">')

    return figure_html, loss_figure


@app.cell
def _(
    DemoConfig, Path, RANK_PER_METHOD, SCRIPT, default_targets, defaults, figure_html, held_out_data, load_model, loss_figure, mo,
    run_variant, settings, tempfile, time, tokenizer, torch, train_data,
):
    chosen = settings.value if settings.value is not None else ({**defaults, "rank": defaults["r"]} if SCRIPT else None)
    mo.stop(chosen is None, mo.callout(mo.md("Press **Train** to fine-tune the selected variants."), kind="info"))
    mo.stop(not chosen["variants"], mo.callout(mo.md("Select at least one variant, then press **Train**."), kind="warn"))

    config = DemoConfig(
        variants=list(chosen["variants"]), r=None if chosen["rank"] == RANK_PER_METHOD else int(chosen["rank"]), steps=int(chosen["steps"]),
        lr=float(chosen["lr"]) if chosen["lr"].strip() else None, dtype=getattr(torch, chosen["dtype"]), progress=False,
        samples=3,
    )
    started = time.perf_counter()
    curves, results = {}, []
    model = load_model(dtype=config.dtype)[0]
    targets = default_targets(model)
    mo.output.replace(figure_html(loss_figure(curves, "training loss (live)"), "training loss (live)"))  # output 0: the live plot; the bar follows
    with mo.status.progress_bar(total=len(config.variants) * config.steps, title="Step 2/2: fine-tuning and evaluating") as bar:
        for index, name in enumerate(config.variants, start=1):
            curves[name] = []

            def on_step(stats, name=name, index=index):
                curves[name].append(stats.loss)
                last = stats.step + 1 == config.steps
                doing = "evaluating on the held-out questions, saving and reloading" if last else f"loss {stats.loss:.3f}"
                bar.update(subtitle=f"variant {index}/{len(config.variants)}: {name}, step {stats.step + 1}/{config.steps}, {doing}")
                if stats.step % 5 == 4 or last:
                    mo.output.replace_at_index(figure_html(loss_figure(curves, "training loss (live)"), "training loss (live)"), 0)

            with tempfile.TemporaryDirectory() as tmp:  # a method that cannot run comes back as a row with its reason
                results.append(run_variant(model, tokenizer, name, config, train_data, held_out_data, Path(tmp), on_step=on_step))
            if not curves[name]:
                del curves[name]  # it never trained: no curve
    seconds = time.perf_counter() - started
    # The live plot and the progress bar make way for the results cell below: nothing of the
    # run's progress stays behind to read as if work were still going on.
    mo.output.clear()
    if SCRIPT:
        for row in results:
            if row["status"] != "trained":
                print(f"{row['variant']}: {row['status']}: {row['reason']}")
                continue
            print(f"{row['variant']}: held-out accuracy {row['acc_before']:.0%} -> {row['acc_after']:.0%}, final loss {row['final_loss']:.3f}")
    return config, curves, results, seconds, targets


@app.cell
def _(torch):
    def run_settings(config, targets, lrs):
        """The settings that produced a run, as one line of markdown."""
        lr = (f"{config.lr:g} for every variant" if config.lr is not None
              else "per-variant default (" + ", ".join(f"{name} {value:g}" for name, value in lrs.items()) + ")")
        dtype = str(config.dtype).removeprefix("torch.")
        rank = f"rank r = {config.r} for every variant" if config.r is not None else "rank r per method (the table's settings column)"
        return (
            f"variants {', '.join(config.variants)} · {rank} · base dtype {dtype} (adapters float32) · "
            f"learning rate {lr} · {config.steps} steps per variant · batch {config.batch_size} · seed {config.seed} · "
            f"adapters on {', '.join(targets)}"
        )

    def interpretation(rows, config):
        """What a run's numbers say, as markdown paragraphs, every figure taken from ``rows``: the
        trained methods' numbers, then the methods whose options were lowered to fit the model and
        those that could not run or failed, with the reason."""
        results = [r for r in rows if r["status"] == "trained"]
        not_run = [r for r in rows if r["status"] != "trained"]
        fitted = [(r["variant"], f) for r in rows for f in r["fitted"]]
        tail = [
            f"**{name}**: {f['option']}={f['asked']} does not fit this model's layers; it trained with {f['option']}={f['used']}, "
            "the largest value below that does." for name, f in fitted
        ] + [f"**{r['variant']}** {'could not run' if r['status'] == 'skipped' else 'failed'}: {r['reason']}" for r in not_run]
        if not results:
            return "\n\n".join(["No method trained.", *tail])

        def who(r):
            return f"**{r['variant']}** ({r['trainable']:,} trainable parameters, {r['trainable_pct']:.2f} % of the model)"

        paragraphs = []
        before = max(r["acc_before"] for r in results)
        best = max(results, key=lambda r: (r["acc_after"], -r["trainable"]))
        start = (
            "Before training no adapter answers any of the 30 held-out questions: the base model has never seen the "
            "question form." if before == 0 else
            f"Before training the adapters already answer up to {before:.0%} of the held-out questions."
        )
        if len(results) == 1:
            paragraphs.append(
                f"{start} After {config.steps} steps {who(best)} answers {best['acc_after']:.0%} of them: "
                + ("it learnt the format and reuses the sums the model already knew, since it never trained on these questions."
                   if best["acc_after"] >= 0.5 else "it has not learnt the format yet.")
            )
        else:
            paragraphs.append(
                f"{start} After {config.steps} steps per variant the best is {who(best)} with {best['acc_after']:.0%} "
                f"held-out accuracy; the worst, **{min(results, key=lambda r: r['acc_after'])['variant']}**, "
                f"{min(r['acc_after'] for r in results):.0%}."
            )
            smallest = min(results, key=lambda r: r["trainable"])
            largest = max(results, key=lambda r: r["trainable"])
            ratio = largest["trainable"] / smallest["trainable"]
            if smallest["acc_after"] >= largest["acc_after"] and ratio > 1.5:
                paragraphs.append(
                    f"**Parameter count is not quality.** {who(smallest)} reaches {smallest['acc_after']:.0%}; "
                    f"{who(largest)}, {ratio:.0f}× more, reaches {largest['acc_after']:.0%}. This task needs a new *format*, "
                    "not new knowledge: an adapter with few degrees of freedom has to reuse the sums the model already "
                    "computes, while a large one can also fit the 70 training questions one by one."
                )
            elif ratio > 1.5:
                paragraphs.append(
                    f"Here capacity helped: {who(largest)} reaches {largest['acc_after']:.0%}, {who(smallest)} "
                    f"{smallest['acc_after']:.0%}."
                )
        if best["acc_after"] < 0.5:
            paragraphs.append(
                f"No variant got past {best['acc_after']:.0%} in {config.steps} steps: too few to learn the task "
                "(the default is 120). Press **Train** with more steps, or a larger learning rate."
            )
        low = [r for r in results if r["final_loss"] < 0.1 and r["acc_after"] < 0.8]
        if low:
            paragraphs.append(
                "Low training loss with a lower held-out accuracy means fitting the training questions more than the "
                "format: " + "; ".join(f"**{r['variant']}** final loss {r['final_loss']:.3f}, held-out {r['acc_after']:.0%}" for r in low) + "."
            )
        if len(results) > 1:
            fast = min(results, key=lambda r: r["ms_per_step"])
            slow = max(results, key=lambda r: r["ms_per_step"])
            paragraphs.append(
                f"Cost: **{fast['variant']}** takes {fast['ms_per_step']:.0f} ms per step, **{slow['variant']}** "
                f"{slow['ms_per_step']:.0f} ms ({slow['ms_per_step'] / fast['ms_per_step']:.1f}×) on this machine."
            )
        skipped = [r for r in results if r["skipped_steps"]]
        if skipped:
            paragraphs.append(
                "The float16 GradScaler skipped steps whose gradients overflowed (it then lowers its scale): "
                + ", ".join(f"{r['variant']} {r['skipped_steps']} of {config.steps}" for r in skipped) + "."
            )
        # Reload: the saved and reloaded adapter must give the trained one's held-out logits.
        dtype = str(config.dtype).removeprefix("torch.")
        tolerance = 1024 * torch.finfo(config.dtype).eps  # a few hundred roundings of logits of size ~10-30
        identical = [r["variant"] for r in results if r["reload_identical"]]
        differ = [r for r in results if not r["reload_identical"]]
        notes = []
        if identical:
            notes.append(f"{', '.join(identical)} reloaded bit for bit identical")
        for r in differ:
            diff = r["reload_max_abs_diff"]
            if diff <= tolerance and r["variant"] == "pissa":
                notes.append(
                    f"pissa's reloaded logits differ by at most {diff:.1e}, within {dtype} round-off ({tolerance:.1e}, "
                    f"1024 × its machine epsilon): peft stores PiSSA as a rank-{2 * r['r']} LoRA on the untouched base "
                    "instead of the trained residual form, so the same sum is rounded in another order. That is expected, "
                    "not a defect"
                )
            elif diff <= tolerance:
                notes.append(f"{r['variant']}'s reloaded logits differ by at most {diff:.1e}, within {dtype} round-off ({tolerance:.1e})")
            else:
                notes.append(
                    f"⚠ {r['variant']}'s reloaded logits differ by {diff:.1e}, more than {dtype} round-off ({tolerance:.1e}): "
                    "the saved adapter is not the trained one; please report it"
                )
        paragraphs.append("Save and reload: " + "; ".join(notes) + ".")
        return "\n\n".join(paragraphs + tail)

    COLUMN_HELP = {
        "settings": "the rank and every option that differs from the method's own default (its row of lora_func/demo/defaults.py); "
                    "* marks one lowered to fit this model's layers",
        "trainable": "numbers the adapter trains, and their share of the model's parameters",
        "acc. before": "held-out accuracy with the adapter at its initial values",
        "acc. after": "held-out accuracy after training: exact greedy answers to the 30 questions never trained on",
        "final loss": "mean training loss (cross-entropy per answer token) over the last 10 steps, on training questions",
        "ms/step": "wall-clock milliseconds per training step (forward, backward, optimizer) on this machine, one CPU thread",
        "reload": "the adapter saved (peft's format; antipasto lora_func's) and loaded back: its held-out logits against the trained one's",
    }
    return COLUMN_HELP, interpretation, run_settings



@app.cell
def _(
    COLUMN_HELP, config, curves, figure_html, held_out_examples, interpretation, loss_figure, mo, results, run_settings,
    seconds, targets,
):
    def summary_row(r):
        if r["status"] != "trained":  # the reason is in "What this run shows"
            return {"variant": r["variant"], "settings": r["settings"], "trainable": "", "lr": f"{r['lr']:g}", "acc. before": "",
                    "acc. after": "", "final loss": None, "ms/step": None,
                    "reload": "could not run" if r["status"] == "skipped" else "failed"}
        return {
            "variant": r["variant"],
            "settings": r["settings"],
            "trainable": f"{r['trainable']:,} ({r['trainable_pct']:.2f} %)",
            "lr": f"{r['lr']:g}",
            "acc. before": f"{r['acc_before']:.0%}",
            "acc. after": f"{r['acc_after']:.0%}",
            "final loss": round(r["final_loss"], 3),
            "ms/step": round(r["ms_per_step"], 1),
            "reload": "identical" if r["reload_identical"] else f"max diff {r['reload_max_abs_diff']:.1e}",
        }

    summary = [summary_row(r) for r in results]
    trained = [r for r in results if r["status"] == "trained"]
    expected = {e.prompt: e.answer for e in held_out_examples}

    def answered(text, prompt):
        return text.removesuffix(".").strip() == expected[prompt]

    samples = [
        {"variant": r["variant"], "held-out question": s["prompt"], "expected": expected[s["prompt"]],
         "before": s["before"], "after": s["after"], "✓/✗": "✓" if answered(s["after"], s["prompt"]) else "✗"}
        for r in trained for s in r["samples"]
    ]
    lrs = {r["variant"]: r["lr"] for r in results}
    accuracy = {r["variant"]: f"{r['variant']}  held-out {r['acc_before']:.0%} → {r['acc_after']:.0%}" for r in trained}
    not_run = f" ({len(results) - len(trained)} could not run: see below)" if len(trained) < len(results) else ""
    done = mo.callout(
        mo.md(
            f"**Training complete**: {len(trained)} variant(s) × {config.steps} steps in {seconds:.0f} s{not_run}. "
            f"These results stay here until the next **Train**; changing the settings does not clear them.\n\n"
            f"**Settings of these results**: {run_settings(config, targets, lrs)}."
        ),
        kind="success",
    )
    columns = "\n".join(f"- **{name}**: {text}." for name, text in COLUMN_HELP.items())
    mo.vstack(
        [
            done,
            mo.md("## Results"),
            figure_html(loss_figure(curves, "training loss", labels=accuracy), "training loss"),
            mo.ui.table(summary, selection=None, header_tooltip=COLUMN_HELP,
                        label="results (acc.: held-out accuracy on the 30 questions never trained on)"),
            mo.md("### What this run shows\n\n" + interpretation(results, config)),
            mo.accordion({"The columns": mo.md(columns)}, expanded=True),
            mo.md("## Generated answers, before and after"),
            mo.ui.table(
                samples, selection=None, page_size=10,
                label=f"{len(samples) // max(1, len(trained))} of the held-out questions (never trained on) per variant, "
                      "answered by greedy decoding; ✓: the answer after training is the expected one",
                style_cell=lambda _row, column, value: (
                    {"color": "#15803d" if value == "✓" else "#b91c1c", "fontWeight": "bold"} if column == "✓/✗" else {}
                ),
            ),
        ]
    )
    return


if __name__ == "__main__":
    app.run()
