"""docs/io.md's count of peft's configurations (method x layer kind) against the registry and,
for a sample of cells (every layer kind and method family, each measured in full: outputs both
ways, every gradient, the init), against the probe itself (tests/peft_coverage.py; the whole
table is regenerated with ``python -m tests.peft_coverage``, about 5 minutes)."""

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
        # a kind lora_func adapts is written and measured (outputs, gradients, init); another is
        # refused, absent from peft, or n/a
        assert adapted == (value not in ("refused", "·", "n/a")), (variant, kind, value)


# One cell per layer kind and per method family at least, measured again in full (outputs both
# ways, every gradient, the init): LoRA on an attention (gradients by finite differences where
# peft's autograd halves the out_proj's, its init apart), on a bare parameter, on MoE experts
# (float32); DoRA on an embedding (peft's embedding init, seeded at its reset); HiRA on a conv
# (peft's placeholder draws before its init); LoKr on a grouped conv (LyCORIS); LN tuning on a
# norm (selective); VB-LoRA on GPT-2 Conv1D (a vector bank shared by every layer); C3A (spectral:
# peft's backward differs, finite differences agree); HRA (orthogonal); Poly (routed); and cells
# that are not measured: refused, absent from peft, refused by peft, DeFT's float32 casts.
SAMPLED = [
    ("lora", "mha"), ("lora", "parameter"), ("lora", "experts"), ("dora", "embedding"), ("hira", "conv"), ("lokr", "grouped_conv"),
    ("ln_tuning", "norm"), ("vblora", "conv1d"), ("c3a", "linear"), ("hra", "linear"), ("poly", "linear"),
    ("dora", "grouped_conv"), ("vera", "mha"), ("deft", "linear"), ("trainable_tokens", "conv1d"),
]


def test_the_sample_covers_every_kind_and_family():
    families = [{"lora", "dora", "hira"}, {"lokr", "loha"}, {"ln_tuning", "ia3", "trainable_tokens"}, {"vblora", "vera", "randlora"},
                {"c3a", "fourierft", "waveft"}, {"hra", "oft", "boft"}, {"poly", "lily"}]
    measured = [(v, k) for v, k in SAMPLED if k in lf.get_variant(v).kinds]
    assert {k for _, k in measured} == set(KINDS)
    assert all(family & {v for v, _ in measured} for family in families)


@pytest.mark.parametrize(("variant", "kind"), SAMPLED)
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


# outputs, gradients and init: a trained bias (composed), layer replication, LoRA's seeded inits
# (orthogonal; the debugging init_lora_weights=False lora_func does not draw), LyCORIS's lycoris
# init, a modules_to_save copy whose bias peft writes twice
@pytest.mark.parametrize(
    "option",
    ["lora bias='lora_only'", "lora layer_replication", "oft bias='oft_only'", "lora init_lora_weights='orthogonal'",
     "lora init_lora_weights=False", "lokr init_weights='lycoris'", "lora bias='all', modules_to_save"],
)
def test_sampled_options_are_what_the_probe_measures(option):
    from tests.peft_options import cell as option_cell
    from tests.peft_options import label as option_label

    _, cells = _documented_options()
    with tempfile.TemporaryDirectory() as tmp:
        assert option_label(option_cell(option, Path(tmp))) == cells[option]
