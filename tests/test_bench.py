"""The benchmark scripts run (tiny sizes, one round) and their process setup does what
docs/benchmarks.md says. The numbers themselves are measured by hand, not in CI."""

from __future__ import annotations

import os
import random
import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_module():
    """Runs a script's module code (not its ``__main__`` block); the scripts set threads,
    seeds and ``sys.path``, all put back afterwards."""
    path, threads, state = list(sys.path), torch.get_num_threads(), random.getstate()
    sys.path.insert(0, str(BENCH))
    try:
        with torch.random.fork_rng():
            yield lambda name: runpy.run_path(str(BENCH / name), run_name="bench")
    finally:
        sys.path[:] = path
        torch.set_num_threads(threads)
        random.setstate(state)


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` in get_peft_model.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_ratios_prints_a_row_for_every_variant_with_peft_where_peft_has_it(bench_module, capsys):
    ratios = bench_module("ratios.py")
    tiny = ["--hidden", "32", "--layers", "1", "--vocab", "64", "--batch", "2", "--seq", "8", "--rank", "2", "--rounds", "1", "--warmup", "0", "--threads", "1"]
    assert ratios["main"](tiny) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    common = ratios["c"]
    assert set(rows) == set(common.ALL_VARIANTS)
    for name, line in rows.items():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        lazy, merged, peft = cells[2], cells[3], cells[4]
        assert lazy != "—" and merged != "—", line
        assert (peft == "—") == (name == "antipasto"), line
    assert "# targets:" in out


def test_reexec_sets_the_allocator_tunables_once_and_keeps_the_callers_own(bench_module, monkeypatch):
    common = bench_module("_common.py")
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append((path, argv)))
    monkeypatch.setattr(sys, "argv", ["bench/ratios.py", "--rounds", "3"])
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    common["reexec_with_steady_allocator"]()
    if sys.platform.startswith("linux"):
        assert calls == [(sys.executable, [sys.executable, "bench/ratios.py", "--rounds", "3"])]
        assert os.environ["GLIBC_TUNABLES"] == common["MALLOC_TUNABLES"]
        assert "mmap_threshold" in common["MALLOC_TUNABLES"] and "trim_threshold" in common["MALLOC_TUNABLES"]
    calls.clear()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=1")
    common["reexec_with_steady_allocator"]()
    assert calls == [] and os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1"
