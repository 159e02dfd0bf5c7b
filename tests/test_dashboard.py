"""examples/dashboard.py: headless as a script (marimo's script mode), and served by
`marimo run` in a real headless Chromium driven by Playwright (the Debian `chromium` package;
never `playwright install`, which downloads a browser). The server is started by
scripts/dashboard_screenshot.py's ``serve_dashboard``, which also makes the docs' screenshot."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

from lora_func.demo.defaults import NOT_TRAINED, method_defaults
from tests.test_docs import readme_families

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "examples" / "dashboard.py"
_spec = importlib.util.spec_from_file_location("dashboard_screenshot", ROOT / "scripts" / "dashboard_screenshot.py")
screenshot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(screenshot)


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    """The dashboard run as a script (15 steps of lora): its definitions, and what it printed
    as ``defs["printed"]``."""
    import contextlib
    import io
    import runpy

    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.chdir(tmp_path_factory.mktemp("script"))
        monkeypatch.setattr(sys, "argv", [str(DASHBOARD)])
        app = runpy.run_path(str(DASHBOARD), run_name="dashboard")["app"]
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            _, defs = app.run()
    finally:
        monkeypatch.undo()
    return {**defs, "printed": printed.getvalue()}


def test_dashboard_runs_headless_as_a_script(script_run):
    (row,) = script_run["results"]
    assert row["variant"] == "lora" and len(row["losses"]) == 15 and all(math.isfinite(x) for x in row["losses"])
    assert row["losses"][-1] < row["losses"][0] and row["reload_identical"]
    assert f"lora: held-out accuracy {row['acc_before']:.0%} -> {row['acc_after']:.0%}" in script_run["printed"]


def _noisy_losses(n, start, seed):
    import random

    rng = random.Random(seed)
    return [start * 0.97**i * rng.uniform(0.6, 1.4) for i in range(n)]


def _visible_tick_labels(axis):
    low, high = sorted(axis.get_view_interval())
    return [t.label1.get_text() for t in axis.get_major_ticks() if low <= t.get_loc() <= high and t.label1.get_text()]


def test_loss_plot_is_smoothed_with_plain_log_ticks_whole_steps_and_the_legend_beside_the_curves(script_run):
    """Five steps, as the live plot's first frame (where matplotlib's default ticks are 1.5,
    2.5, ...), and losses within one decade (where its log labels read 4 × 10⁰); three noisy
    curves."""
    curves = {name: _noisy_losses(5, 4.0, seed) for seed, name in enumerate(["lora", "ia3", "pissa"])}
    fig = script_run["loss_figure"](curves, "t")
    try:
        fig.canvas.draw()
        (ax,) = fig.axes
        steps = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert steps and all(float(t).is_integer() for t in steps), steps
        labels = _visible_tick_labels(ax.yaxis)
        assert len(labels) >= 2 and all(re.fullmatch(r"\d+(\.\d+)?", text) for text in labels), labels
        assert len(labels) <= 10, labels
        legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.x0 >= axes.x1, (legend, axes)  # beside the plot, over no curve
        assert [t.get_text() for t in ax.get_legend().get_texts()] == list(curves)
        for name, values in curves.items():  # each variant: its raw curve faint, a smoothed one bold
            bold = next(line for line in ax.get_lines() if line.get_label() == name)
            smooth = list(bold.get_ydata())
            assert len(smooth) == len(values) and smooth[0] == values[0]
            assert smooth[-1] == pytest.approx(sum(values) / len(values))  # a 10-step mean over 5 steps: all of them
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    # A run that spans three decades of loss: plain numbers still, and not a crowd of them.
    fig = script_run["loss_figure"]({"lora": [5.0 * 0.9**i for i in range(60)]}, "t")
    try:
        fig.canvas.draw()
        labels = _visible_tick_labels(fig.axes[0].yaxis)
        assert 3 <= len(labels) <= 10 and all(re.fullmatch(r"\d+(\.\d+)?", text) for text in labels), labels
    finally:
        plt.close(fig)


def _row(variant, acc_after, trainable, *, diff=0.0, final_loss=0.5, ms=30.0, skipped=0, fitted=()):
    return {"variant": variant, "status": "trained", "r": 8, "settings": "r=8", "fitted": list(fitted), "reason": None,
            "lr": 3e-3, "trainable": trainable, "trainable_pct": 100 * trainable / 1_194_368,
            "acc_before": 0.0, "acc_after": acc_after, "final_loss": final_loss, "ms_per_step": ms,
            "skipped_steps": skipped, "reload_identical": diff == 0.0, "reload_max_abs_diff": diff}


def test_interpretation_draws_the_conclusion_from_the_numbers_and_explains_the_reload(script_run):
    import torch

    config = script_run["DemoConfig"](variants=["lora", "ia3", "pissa"], steps=120, dtype=torch.float32)
    rows = [_row("lora", 2 / 3, 28_672), _row("ia3", 1.0, 1_536, ms=25.0), _row("pissa", 0.9, 28_672, diff=2.5e-5, ms=41.0)]
    text = script_run["interpretation"](rows, config)
    assert "best is **ia3** (1,536 trainable parameters, 0.13 % of the model) with 100% held-out accuracy" in text, text
    assert "**Parameter count is not quality.**" in text and "19× more, reaches 67%" in text
    assert "**ia3** takes 25 ms per step, **pissa** 41 ms" in text
    assert "lora, ia3 reloaded bit for bit identical" in text
    assert "pissa's reloaded logits differ by at most 2.5e-05, within float32 round-off" in text
    assert "rank-16 LoRA" in text and "report" not in text
    # The same table where the largest adapter wins, too few steps, and a reload that is off.
    rows = [_row("lora", 0.4, 28_672, diff=3e-2), _row("ia3", 0.1, 1_536)]
    text = script_run["interpretation"](rows, config)
    assert "capacity helped" in text and "not quality" not in text
    assert "No variant got past 40% in 120 steps" in text
    assert "lora's reloaded logits differ by 3.0e-02, more than float32 round-off" in text and "please report it" in text
    # A float16 run: the scaler's skipped steps, and a round-off that is float16's.
    config16 = script_run["DemoConfig"](variants=["pissa"], steps=120, dtype=torch.float16)
    text = script_run["interpretation"]([_row("pissa", 0.9, 28_672, diff=0.2, skipped=3)], config16)
    assert "pissa 3 of 120" in text and "within float16 round-off" in text
    # An option lowered to fit the model, a method that could not run and one that failed: each named with its reason.
    fitted = {"option": "vector_length", "asked": 256, "used": 64, "why": "vector_length=256 must divide ..."}
    skipped = {"variant": "adamss", "status": "skipped", "r": 8, "settings": "r=8", "fitted": [], "lr": 0.01,
               "reason": "cannot run on this model: adamss needs scikit-learn"}
    failed = {**skipped, "variant": "oft", "status": "failed", "reason": "RuntimeError: boom"}
    text = script_run["interpretation"]([_row("vblora", 0.7, 20_000, fitted=[fitted]), _row("ia3", 1.0, 1_536), skipped, failed], config)
    assert "**vblora**: vector_length=256 does not fit this model's layers; it trained with vector_length=64" in text, text
    assert "**adamss** could not run: cannot run on this model: adamss needs scikit-learn" in text
    assert "**oft** failed: RuntimeError: boom" in text and "the worst, **vblora**, 70%" in text
    assert script_run["interpretation"]([skipped], config).startswith("No method trained.")


# One method of each family of the README's list (tests/test_docs.py checks the list is every
# variant): the browser runs each through Train. vblora also has an option lowered to fit the
# model (vector_length 256 -> 64), pissa a reload that differs by round-off.
TRAINED = {
    "the LoRA family": "pissa", "scaling vectors": "ia3", "trained copies and biases": "ln_tuning",
    "structured and multiplicative": "loha", "a few numbers over a basis or bank shared by every layer": "vblora",
    "subspaces of the weight's SVD": "adamss",
}


def test_the_browser_test_trains_one_method_of_each_family():
    families = readme_families()
    assert set(TRAINED) == set(families) and all(TRAINED[f] in families[f] for f in families), families


@pytest.fixture
def served_dashboard(tmp_path):
    """``marimo run`` on a free localhost port, 6 training steps of one method per family."""
    with screenshot.serve_dashboard(["--steps", "6", "--variants", ",".join(TRAINED.values())], tmp_path) as url:
        yield url


def _table_with_column(page, name):
    """The rendered table with a column headed exactly ``name``."""
    return page.locator("table").filter(has=page.locator("thead th").filter(has_text=re.compile(rf"^\s*{re.escape(name)}\s*$")))


def _table_rows(table):
    """A rendered marimo table as a list of ``{column: cell text}``."""
    headers = [h.strip() for h in table.locator("thead th").all_inner_texts()]
    rows = []
    for tr in table.locator("tbody tr").all():
        cells = [c.strip() for c in tr.locator("td").all_inner_texts()]
        rows.append(dict(zip(headers[-len(cells):], cells, strict=True)))
    return rows


def test_dashboard_in_a_headless_browser_trains_explains_its_results_and_keeps_them_when_settings_change(served_dashboard):
    if not screenshot.CHROMIUM.is_file():
        message = f"{screenshot.CHROMIUM} is missing: apt-get install -y chromium (.ci/run does this)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the browser test, never skip it
        pytest.skip(message)
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(screenshot.CHROMIUM), args=screenshot.CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=screenshot.VIEWPORT)
            page.set_default_timeout(90_000)
            expect.set_options(timeout=90_000)  # the kernel imports torch and loads the model first
            page.goto(served_dashboard)
            expect(page.get_by_text("what is", exact=False).first).to_be_visible()  # the dataset preview
            expect(page.get_by_role("columnheader", name="#").first).to_be_visible()  # with a row index
            expect(page.get_by_text("Press Train to fine-tune", exact=False)).to_be_visible()

            # The help is open without a click, and has a row for every variant the form offers, with
            # its demo defaults from the one table (lora_func/demo/defaults.py), readable.
            assert "{'lora'" not in page.locator("body").inner_text() and "mappingproxy" not in page.locator("body").inner_text()
            options = json.loads(page.locator("marimo-multiselect").last.get_attribute("data-options"))  # the UI element itself
            assert "lora" in options and "ia3_ff" in options, options
            help_table = _table_with_column(page, "pick it when")
            expect(help_table).to_be_visible()
            described = {row["variant"]: row for row in _table_rows(help_table)}
            for name in options:
                assert name in described, f"the help has no row for the selectable variant {name!r}"
                row = described[name]
                assert len(row["the idea"]) > 20 and len(row["pick it when"]) > 15, row
                assert re.fullmatch(r"docs/variants/\w+\.md", row["details"]), row
                if name in NOT_TRAINED:  # declared, with its reason, in lora_func/demo/defaults.py
                    assert row["demo default"] == "not trained by the demo", row
                    continue
                defaults = method_defaults(name)
                assert row["demo default"].startswith(f"lr {defaults.lr:g}, r {defaults.rank()}"), row
                assert all(f"{k} {v:g}" in row["demo default"] for k, v in defaults.options.items() if isinstance(v, float)), row
            # Its links open the guide's pages: each names a file of this checkout, and one
            # click shows that page, rendered, in a new tab.
            links = page.locator("a[href^='?guide=']")
            hrefs = {links.nth(i).get_attribute("href") for i in range(links.count())}
            assert {"?guide=docs/guide/variants.md", "?guide=docs/variants/ia3.md"} <= hrefs, hrefs
            for href in hrefs:
                assert (ROOT / href.removeprefix("?guide=")).is_file(), href
            with page.context.expect_page() as opened:
                page.locator("a[href='?guide=docs/guide/variants.md']").first.click()
            guide = opened.value
            expect(guide.get_by_role("heading", name="The variants: ideas, trade-offs, when to pick each")).to_be_visible()
            with page.context.expect_page() as opened:  # its own links to other pages too
                guide.locator("a[href='?guide=docs/guide/hyperparameters.md']").first.click()
            expect(opened.value.get_by_role("heading", name="Choosing r, alpha and the learning rate")).to_be_visible()
            opened.value.close()
            guide.close()
            refused = browser.new_page()  # only pages under docs/: no other file of the machine
            refused.goto(served_dashboard + "?guide=README.md")
            expect(refused.get_by_text("No guide page README.md in this checkout", exact=False)).to_be_visible()
            refused.close()

            page.get_by_role("button", name="Train").click()
            expect(page.get_by_text("Training complete", exact=False)).to_be_visible()
            expect(page.get_by_role("heading", name="Generated answers, before and after")).to_be_visible()
            expect.set_options(timeout=15_000)  # all there now: a failing check need not wait long
            # Nothing of the progress stays behind (the bar's "Step 2/2" title, a "Step 3/3" line).
            expect(page.get_by_text(re.compile(r"Step \d/\d"))).to_have_count(0)
            plot = page.locator("img[src^='data:image/png'][alt='training loss']")
            expect(plot).to_be_visible()
            assert plot.evaluate("img => img.naturalWidth") > 300  # a rendered figure, not an icon
            # Full width: as wide as the results heading above it (the column), not ~65 % of it.
            column = page.get_by_role("heading", name="Results").evaluate("h => h.getBoundingClientRect().width")
            width = plot.evaluate("img => img.getBoundingClientRect().width")
            assert width >= 0.97 * column, (width, column)

            # The interpretation quotes this run's own numbers, as the results table shows them.
            results_table = _table_with_column(page, "acc. after")
            results = {row["variant"]: row for row in _table_rows(results_table)}
            assert set(results) == set(TRAINED.values()), results
            assert results["vblora"]["settings"] == "r=8, vector_length=64*", results["vblora"]  # lowered to fit
            shows_text = page.get_by_role("heading", name="What this run shows").locator("xpath=..").inner_text()
            assert "vblora: vector_length=256 does not fit this model's layers; it trained with vector_length=64" in shows_text
            accuracy = {name: int(row["acc. after"].rstrip("%")) for name, row in results.items()}
            count = {name: int(row["trainable"].split()[0].replace(",", "")) for name, row in results.items()}
            best = max(results, key=lambda name: (accuracy[name], -count[name]))
            worst = min(results, key=lambda name: accuracy[name])
            shows = page.get_by_role("heading", name="What this run shows").locator("xpath=..").inner_text()
            trainable, share = results[best]["trainable"].split(" ", 1)
            assert f"the best is {best} ({trainable} trainable parameters, {share.strip('()')} of the model) " \
                   f"with {accuracy[best]}% held-out accuracy" in shows, shows
            assert f"the worst, {worst}, {accuracy[worst]}%" in shows, shows
            assert "After 6 steps per variant" in shows, shows
            # The reload column, explained from its own numbers: PiSSA's difference is round-off.
            identical = [name for name, row in results.items() if row["reload"] == "identical"]
            assert {"ia3", "loha", "vblora"} <= set(identical) and f"{', '.join(identical)} reloaded bit for bit identical" in shows, shows
            for name in results.keys() - identical:  # pissa, as a rule (peft's form of it rounds differently)
                diff = results[name]["reload"].removeprefix("max diff ")
                assert f"{name}'s reloaded logits differ by at most {diff}, within float32 round-off" in shows, shows
            columns_help = page.get_by_role("region", name="The columns")  # open, under the interpretation
            for column_name in ("final loss", "ms/step", "reload"):
                expect(columns_help).to_contain_text(re.compile(rf"{re.escape(column_name)}: \S+ \S+"))

            # The samples: expected answers, and a ✓/✗ that agrees with them.
            samples_table = _table_with_column(page, "expected")
            samples = _table_rows(samples_table)
            assert len(samples) == 10, samples  # the first page of 3 held-out questions per variant
            for row in samples:
                right = row["after"].removesuffix(".").strip() == row["expected"]
                assert row["✓/✗"] == ("✓" if right else "✗"), row
            assert "#" not in samples[0]

            # The settings behind these results are printed with them ...
            settings_line = page.get_by_text("Settings of these results").locator("xpath=..")  # its paragraph
            expect(settings_line).to_contain_text("rank r per method")
            expect(settings_line).to_contain_text("base dtype float32")
            expect(settings_line).to_contain_text("6 steps per variant")
            for name, row in results.items():
                expect(settings_line).to_contain_text(f"{name} {row['lr']}")

            # ... and stay those of the run after a control changes: nothing re-runs, the
            # results stay until the next Train.
            rank = page.locator("select").filter(has_text="per method")
            rank.select_option(label="16")
            dtype = page.locator("select").filter(has_text="bfloat16")
            dtype.select_option(label="float16")
            assert rank.evaluate("s => s.options[s.selectedIndex].text") == "16"  # the controls did change
            assert dtype.evaluate("s => s.options[s.selectedIndex].text") == "float16"
            page.wait_for_timeout(3000)
            expect(page.get_by_text("Training complete", exact=False)).to_be_visible()
            expect(plot).to_be_visible()
            expect(results_table).to_be_visible()
            expect(page.get_by_text("Press Train to fine-tune", exact=False)).to_have_count(0)
            expect(settings_line).to_contain_text("rank r per method")
            expect(settings_line).to_contain_text("base dtype float32")
        finally:
            browser.close()


def test_dashboard_declares_pep_723_dependencies_for_marimo_sandbox():
    """`marimo run --sandbox` reads the PEP 723 block; its lora-func source must be this checkout."""
    import tomllib

    block = re.search(r"^# /// script\n((?:^#(?: .*)?\n)+)^# ///$", DASHBOARD.read_text(), re.MULTILINE)
    assert block, "no PEP 723 `# /// script` block"
    meta = tomllib.loads("".join(line[2:] + "\n" for line in block[1].splitlines()))
    names = {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in meta["dependencies"]}
    assert {"marimo", "lora-func", "torch", "matplotlib"} <= names, names
    source = meta["tool"]["uv"]["sources"]["lora-func"]
    root = (DASHBOARD.parent / source["path"]).resolve()
    assert root == ROOT and 'name = "lora_func"' in (root / "pyproject.toml").read_text()
