"""docs/io.md's count of peft's configurations (method x layer kind) against the registry and,
for a sample of cells, against the probe itself (tests/peft_coverage.py; the whole table is
regenerated with ``python -m tests.peft_coverage``, about a minute)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

import lora_func as lf
from tests.peft_coverage import KINDS, cell, count_line, label

DOC = Path(__file__).resolve().parents[1] / "docs" / "io.md"


def _documented() -> tuple[str, dict[tuple[str, str], str]]:
    text = DOC.read_text()
    section = text[text.index("## How much of peft loads: the count"):]
    lines = section.splitlines()
    start = lines.index("| variant | " + " | ".join(KINDS) + " |")
    cells = {}
    for line in lines[start + 2:]:
        if not line.startswith("| `"):
            break
        name, *row = (c.strip() for c in line.strip("|").split("|"))
        cells.update({(name.strip("`"), kind): value for kind, value in zip(KINDS, row, strict=True)})
    counts = next(line for line in lines if line.endswith(".") and " cells: " in line)
    return counts, cells


def test_the_count_covers_every_method_and_agrees_with_the_registry():
    counts, cells = _documented()
    read = sorted(v for v in lf.list_variants() if (fmt := lf.variants.peft_format(v)) is not None and fmt.reads is not None)
    assert sorted({v for v, _ in cells}) == read
    assert counts == count_line(list(cells.values()))
    for (variant, kind), value in cells.items():
        adapted = kind in lf.get_variant(variant).kinds
        # a kind lora_func adapts is written and measured; another is refused, absent from peft, or n/a
        assert adapted == (value.split(" ")[0] in ("exact", "≈", "peft", "error")), (variant, kind, value)


@pytest.mark.parametrize(
    ("variant", "kind"), [("lora", "mha"), ("lora", "parameter"), ("dora", "grouped_conv"), ("ln_tuning", "embedding"), ("hira", "conv"), ("vera", "mha"),
     ("deft", "linear"), ("trainable_tokens", "conv1d")]
)
def test_sampled_cells_are_what_the_probe_measures(variant, kind):
    _, cells = _documented()
    with tempfile.TemporaryDirectory() as tmp:
        assert label(cell(variant, kind, Path(tmp))) == cells[variant, kind]


def _documented_options() -> tuple[str, dict[str, str]]:
    text = DOC.read_text()
    lines = text[text.index("### Options"):].splitlines()
    start = lines.index("| peft option | load_peft |")
    cells = {}
    for line in lines[start + 2:]:
        if not line.startswith("| `"):
            break
        option, value = (c.strip() for c in line.strip("|").split("|"))
        cells[option.strip("`")] = value
    counts = next(line for line in lines if " options: " in line and line.endswith("."))
    return counts, cells


def test_the_options_count_lists_every_probed_option():
    from tests.peft_options import OPTIONS
    from tests.peft_options import count_line as options_count

    counts, cells = _documented_options()
    assert list(cells) == list(OPTIONS)
    assert counts == options_count(list(cells.values()))


@pytest.mark.parametrize("option", ["lora bias='lora_only'", "lora layer_replication", "oft bias='oft_only'"])
def test_sampled_options_are_what_the_probe_measures(option):
    from tests.peft_options import cell as option_cell
    from tests.peft_options import label as option_label

    _, cells = _documented_options()
    with tempfile.TemporaryDirectory() as tmp:
        assert option_label(option_cell(option, Path(tmp))) == cells[option]
