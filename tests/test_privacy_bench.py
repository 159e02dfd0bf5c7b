"""bench/privacy.py runs (tiny sizes, one round) and reports the ratios it promises. The
numbers themselves are measured by hand (docs/benchmarks.md), not in CI."""

from __future__ import annotations

import random
import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_privacy_bench_prints_time_and_memory_ratios_for_every_batch(capsys):
    path, threads, state = list(sys.path), torch.get_num_threads(), random.getstate()
    sys.path.insert(0, str(BENCH))
    try:
        with torch.random.fork_rng():
            bench = runpy.run_path(str(BENCH / "privacy.py"), run_name="bench")
            results = bench["main"](["--quick", "--batches", "3"])
    finally:
        sys.path[:] = path
        torch.set_num_threads(threads)
        random.setstate(state)
    out = capsys.readouterr().out
    assert set(results) == {3} and all(v > 0 for v in results[3].values())
    assert "Batch 3 x 8 tokens" in out and "| lora_func private_grads, batched_loss (clip + noise)" in out and "private_grads, vmap" in out
    assert out.count("GradSampleModule hooks") >= 2 and out.count("GradSampleModule functorch") >= 2
