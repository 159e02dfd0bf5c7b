"""The repository's scripts outside the package (tools/, scripts/, bench/, examples/) are not
imported by the suite's other tests as a whole; a merge that breaks one's syntax (tools/mutate.py's
TARGETS table, 2026-11-29) must fail here, not at its next use."""

from __future__ import annotations

import ast
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for folder in ("tools", "scripts", "bench", "examples") for p in (ROOT / folder).glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_parses(path):
    ast.parse(path.read_text(), filename=str(path))


def test_mutation_targets_name_files_that_exist():
    targets = runpy.run_path(str(ROOT / "tools" / "mutate.py"), run_name="mutate_table")["TARGETS"]
    missing = sorted(name for name in targets if not (ROOT / name).is_file())
    assert not missing, missing
