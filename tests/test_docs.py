"""README and docs code blocks, the examples and the demo command all run."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest

# docs/guide/ecosystem.md builds a transformers Trainer. transformers.trainer decides at import
# whether it runs in a notebook and counts a process that imported marimo as one (then it needs
# IPython); the dashboard example runs marimo in this process: import it first, at collection.
import transformers.trainer  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _blocks(path: Path, lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(path.read_text()) if tag == lang]


def readme_families() -> dict[str, list[str]]:
    """The README's list of variants by family (``- the LoRA family: `lora`, ...``; a bullet may
    hold two families, ``scaling vectors: ...; norm and layer copies: ...``): family -> names.
    The list ends at its first blank line (the prompt-learning paragraph after it is no variant)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("authors' formulas otherwise):")
    section = text[start : text.index("\n\n", text.index("\n- ", start))]
    label = r"[a-z][a-zA-Z' ]*?"
    return {
        family: re.findall(r"`(\w+)`", body)
        for family, body in re.findall(rf"(?:^- |; )({label}): (.*?)(?=; {label}: |\n- |\Z)", section, re.S | re.M)
    }


DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PY_BLOCKS = [
    pytest.param(block, id=f"{path.relative_to(ROOT)}#{i}")
    for path in DOC_FILES
    for i, block in enumerate(_blocks(path, "python"))
    if not block.startswith("# illustrative")  # a fragment with undefined names, marked in the doc
]


def test_the_ecosystem_guide_blocks_are_all_collected():
    """docs/guide/ecosystem.md is the acceptance of the Trainer and torchopt routes: every block runs."""
    ids = [p.id for p in PY_BLOCKS if p.id.startswith("docs/guide/ecosystem.md#")]
    assert len(ids) == len(_blocks(ROOT / "docs" / "guide" / "ecosystem.md", "python")) == 4, ids


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = _blocks(ROOT / "README.md", "bash")
    assert len(commands) == 2, commands
    demo, tests = (c.strip() for c in commands)
    assert demo.endswith("lora-func demo") and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), ".ci/run must call the README's test command verbatim"


def test_api_page_documents_every_public_name():
    """docs/api.md has a row (or a heading) for every name in lora_func.__all__ and
    lora_func.train.__all__: a new public function without documentation fails here."""
    import lora_func
    import lora_func.train

    text = (ROOT / "docs" / "api.md").read_text()
    names = [*lora_func.__all__, *lora_func.train.__all__]
    missing = [name for name in names if not re.search(rf"`{re.escape(name)}[(`]", text)]
    assert not missing, f"docs/api.md does not document {missing}"


@pytest.mark.parametrize("block", PY_BLOCKS)
def test_python_blocks_in_docs_run(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "<doc block>", "exec"), {"__name__": "__doc_block__"})


# Examples another test already runs whole, as their own __main__ block does (and checks more
# of what they print): run here too, they would run twice.
RUN_BY = {"dashboard.py": "tests/test_dashboard.py (its script_run fixture: app.run() as a script, 15 steps of lora)"}


def test_every_example_is_run_here_or_by_the_test_named():
    examples = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert set(RUN_BY) <= examples, sorted(set(RUN_BY) - examples)
    for name, test in RUN_BY.items():
        assert (ROOT / test.split(" ", 1)[0]).read_text().count(f'"examples" / "{name}"') == 1, (name, test)


@pytest.mark.parametrize("script", sorted(p for p in (ROOT / "examples").glob("*.py") if p.name not in RUN_BY), ids=lambda p: p.name)
def test_examples_run(script, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script)])
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.strip()


def test_readme_demo_command_learns_every_variant_and_writes_its_report(tmp_path, monkeypatch, capsys):
    """`lora-func demo` as the README runs it (default variants, learning rates and output dir),
    with half the default steps to keep the suite fast."""
    from lora_func.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--no-progress", "--steps", "60"]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "lora-func-demo"
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) >= 3 and "| variant | lr | settings | trainable params |" in printed
    for row in rows:
        assert row["acc_after"] >= row["acc_before"] + 0.3, (row["variant"], row["acc_before"], row["acc_after"])
        assert row["reload_identical"] and "peft format" in row["saved_as"], row["variant"]
        assert f"{row['variant']}: {row['trainable']:,} trainable parameters" in printed
        assert all(s["before"] != s["after"] for s in row["samples"]), row["samples"]
    (lora,) = [row for row in rows if row["variant"] == "lora"]  # r = 8 on the attention projections
    assert 2.0 < lora["trainable_pct"] < 3.0 and f"28,672 trainable parameters ({lora['trainable_pct']:.2f} % of the model)" in printed
    assert (out / "loss_curves.png").stat().st_size > 10_000


def test_cli_entry_point_rejects_unknown_variants(capsys):
    """In this process: a new interpreter (torch, transformers and the demo imported again) is
    started once, by tests/test_ecosystem_peft_habits.py's ``python -m lora_func`` refusal."""
    from lora_func.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--variants", "lora,nope"])
    assert exit_.value.code == 2 and "unknown variant(s) ['nope']" in capsys.readouterr().err


def test_cli_reports_a_diverged_run_with_the_variant_and_step_and_exits_1(tmp_path, capsys):
    """The diverged method's line names its step and tensors; the run goes on, the results of the
    others are written, and the exit status says something failed."""
    from lora_func.cli import main

    # HRA's update is a product of reflections: at any learning rate it stays finite (and trains on).
    code = main(["demo", "--variants", "lora,hra", "--lr", "1e8", "--steps", "20", "--no-progress", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert re.search(r"^lora .*: failed: training lora at lr 1e\+08 diverged: .*at step \d+: non-finite values in", captured.out, re.M), captured.out[-2000:]
    assert re.search(r"^lora-func demo: training diverged \(non-finite loss\) for \['lora'\]", captured.err, re.M), captured.err
    assert "Traceback" not in captured.err and "Try a lower --lr" in captured.err
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(r["variant"], r["status"]) for r in rows] == [("lora", "failed"), ("hra", "trained")]
    assert "| failed: training lora" in (tmp_path / "results.md").read_text() and (tmp_path / "loss_curves.png").is_file()


def test_readme_counts_are_the_registry_s():
    """The README states the number of variants once, in words, and lists them by family: both
    are the registry's (a new variant fails here until the README names it). Its suite size and
    duration are docs/testing.md's latest measurement, which must be of the registered variants
    (a new variant fails here until the suite is measured again and both pages say so)."""
    import lora_func as lf

    readme = (ROOT / "README.md").read_text()
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    tens = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50}
    (count,) = re.findall(r"\b((?:Twenty|Thirty|Forty|Fifty)-\w+) variants", readme)
    tens_word, unit = count.lower().split("-")
    assert tens[tens_word] + words.index(unit) == len(lf.list_variants()), count
    assert not re.search(r"\b\d+ variants\b", readme), "state the variant count once, in words, at the top"
    families = readme_families()
    names = [name for members in families.values() for name in members]
    assert sorted(names) == lf.list_variants() and len(families) == 6, families
    testing = (ROOT / "docs" / "testing.md").read_text()
    section = testing[testing.index("## How long the suite takes") :]
    latest = re.search(r"^- ([\d,]+) tests \((\d+) variants\) passed in \d+ s \((\d+ min \d+ s)\)", section, re.M)
    assert latest and int(latest[2]) == len(lf.list_variants()), "measure the suite again (docs/testing.md) after adding a variant"
    setup = readme[readme.index("## Set-up") : readme.index("## Quickstart")]
    assert re.findall(r"([\d,]+) tests\b", setup) == [latest[1]] and re.findall(r"\d+ min \d+ s", setup) == [latest[3]], (
        "the README's suite size and duration are docs/testing.md's latest measurement"
    )


def test_readme_says_what_the_demo_numbers_and_the_suite_duration_depend_on():
    """The demo's accuracies differ between CPUs' floating-point kernels (seen: ia3 80 % with
    AVX-512, 100 % with AVX2), and the suite's duration is stated with where it is measured."""
    readme = (ROOT / "README.md").read_text()
    demo = readme[readme.index("## The demo") : readme.index("## Layout")]
    assert "floating-point kernels" in demo and "not these digits" in demo
    assert "docs/testing.md#how-long-the-suite-takes" in readme
    testing = (ROOT / "docs" / "testing.md").read_text()
    section = testing[testing.index("## How long the suite takes") :]
    assert section.count("\n| ") >= 20, "docs/testing.md lists the slowest 20 tests"


def test_the_suite_runs_torch_on_one_thread_and_so_do_the_processes_it_starts():
    """A second OpenMP thread per test process made the suite 7x slower on 2 cores when another
    process kept one of them busy (tests/conftest.py)."""
    import os
    import subprocess
    import sys

    import torch

    assert torch.get_num_threads() == 1
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "1" and os.environ["OMP_NUM_THREADS"] == "1"


def test_the_suite_keeps_what_collection_imported_out_of_the_garbage_collector():
    """tests/conftest.py freezes what is alive after collection (torch, transformers, peft, the
    test modules), so that no full collection walks it again, and leaves the collector on."""
    import gc

    assert gc.isenabled() and gc.get_freeze_count() > 100_000, gc.get_freeze_count()


def _lr_sweep_module(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("lr_sweep", ROOT / "scripts" / "lr_sweep.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lr_sweep", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SWEEP = ROOT / "docs" / "guide" / "lr_sweep"


def test_hyperparameters_guide_shows_the_demo_defaults_table_and_the_sweep_that_chose_it(monkeypatch):
    """docs/guide/hyperparameters.md's defaults table is lora_func/demo/defaults.py row for row,
    each default is what the sweep's rule picks from the committed runs (docs/guide/lr_sweep/),
    its numbers are those runs', the full tables are the script's report of them, every method
    below 60 % on the demo task is explained in the section that says why, and the longer runs
    quoted there are those of docs/guide/lr_sweep/steps240.jsonl."""
    import lora_func as lf
    from lora_func.demo.defaults import DEFAULTS, NOT_TRAINED

    sweep = _lr_sweep_module(monkeypatch)
    fine, coarse = sweep.read_records(SWEEP / "fine.jsonl"), sweep.read_records(SWEEP / "coarse.jsonl")
    cells = sweep.summarise(fine)
    guide = (ROOT / "docs" / "guide" / "hyperparameters.md").read_text()
    section = guide[guide.index("## The demo's defaults") :]
    section = section[: section.index("\n## ", 4)]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| `")]
    assert [row[0].strip("`") for row in rows] == sorted(DEFAULTS) == sorted(set(lf.list_variants()) - set(NOT_TRAINED))
    # the methods the demo does not train: each named with its declared reason, and no sweep record
    not_trained = section[section.index("### Not trained by the demo") :]
    not_trained = not_trained[: not_trained.index("\n### ", 4)]
    for name, reason in NOT_TRAINED.items():
        assert f"- `{name}`: {reason}" in " ".join(not_trained.split()), name
    assert not {r["variant"] for r in [*fine, *coarse]} & set(NOT_TRAINED)
    # every row's note (what the demo gives the method, how it runs there) is shown
    flat = " ".join(section.split())
    assert all(f"- `{name}`: {row.note}." in flat for name, row in DEFAULTS.items() if row.note)
    below = section[section.index("### Below 60 %") :]
    for name, lr, label, demo, worked, *_ in ([row[0].strip("`"), *row[1:]] for row in rows):
        row = DEFAULTS[name]
        settings = {**({"r": row.r} if row.r is not None else {}), **({"alpha": row.alpha} if row.alpha is not None else {}), **row.options}
        assert (lr, label) == (f"{row.lr:g}", sweep.settings_label(settings)), name
        assert sweep.choose(cells, name) == (label, row.lr), name  # the default is the sweep's choice
        assert demo == sweep._cell(cells[name, "sums", label, row.lr]) and worked == sweep._cell(cells[name, "worked_sums", label, row.lr])
        values = cells[name, "sums", label, row.lr]
        if sum(values) / len(values) < 0.6:
            assert f"`{name}`" in below, f"{name} is below 60 % on the demo task with its default: say why in '### Below 60 %'"
    # The longer runs the section quotes ("240 steps give 62 % (43–80 %"): those of steps240.jsonl, at each default.
    longer = sweep.summarise(sweep.read_records(SWEEP / "steps240.jsonl"))
    quoted = {}
    for bullet in below.split("\n- ")[1:]:
        name = re.match(r"`(\w+)`:", bullet)
        found = re.search(r"240 steps\s+give\s+(\d+) %\s+\((\d+)–(\d+) %", bullet)
        if name and found:
            quoted[name[1]] = tuple(int(x) for x in found.groups())
    assert sorted(quoted) == ["fourierft", "miss", "unilora"], quoted
    for name, (mean, low, high) in quoted.items():
        row = DEFAULTS[name]
        settings = {**({"r": row.r} if row.r is not None else {}), **row.options}
        values = longer[name, "sums", sweep.settings_label(settings), row.lr]
        assert len(values) == 3 and (mean, low, high) == (round(100 * sum(values) / 3), round(100 * min(values)), round(100 * max(values))), name
    report = sweep.report(fine)
    assert report.split("\n### chosen")[0] in guide and sweep.report(coarse).split("### chosen")[0] in guide
    assert (ROOT / "docs" / "guide" / "lr_sweep.png").stat().st_size > 50_000
