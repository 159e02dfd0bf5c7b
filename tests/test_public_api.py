"""The public surface: ``lora_func.__all__`` grouped as docs/api.md groups it; no rename shims
(nothing has been released: a renamed function is gone under its old name)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lora_func as lf
import lora_func.distributed
import lora_func.export

API = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()

# Each group of lora_func/__init__.py and the docs/api.md section that documents it.
SECTIONS = {
    "BUILDING": "Describing and building an adapter",
    "APPLYING": "Applying an adapter",
    "COMBINING": "Combining adapters",
    "MANY_ADAPTERS": ("Many adapters at once", "Many adapters in one batch"),
    "FILES": "Saving, loading, exporting",
    "PROMPTS": "Input-level adapters: prompt learning",
    "CHECKS": "Checks and data-parallel training",
    "PRIVACY": "Private training (DP-SGD)",
    "TRAINING_METHODS": "Optimiser methods and AdaLoRA's rank budget",
    "ECOSYSTEM": "Ecosystem",
}


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## |\Z)", API, re.MULTILINE | re.DOTALL)
    assert match, f"docs/api.md has no section '## {title}'"
    return match[1]


@pytest.mark.parametrize("group", sorted(SECTIONS))
def test_each_group_is_documented_in_its_api_section(group):
    titles = SECTIONS[group]
    text = "".join(_section(t) for t in ((titles,) if isinstance(titles, str) else titles))
    missing = [name for name in getattr(lf, group) if not re.search(rf"`{re.escape(name)}[(`]", text)]
    assert not missing, f"{group} names {missing} are not documented in docs/api.md section {titles!r}"


def test_all_is_exactly_the_groups_without_repeats():
    grouped = [name for group in SECTIONS for name in getattr(lf, group)]
    assert len(grouped) == len(set(grouped))
    assert lf.__all__ == grouped
    for name in lf.__all__:
        assert getattr(lf, name) is not None


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'merge_state'"):
        lf.merge_state  # noqa: B018


@pytest.mark.parametrize("old", ["merge", "all_reduce_mean", "all_reduce_mean_grads_", "broadcast_adapter", "check_params", "overlay_calls"])
def test_old_names_are_gone(old):
    assert not hasattr(lf, old) and old not in lf.__all__
