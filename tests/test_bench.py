"""The benchmark scripts run (tiny sizes, one round) and their process setup does what
docs/benchmarks.md says. The numbers themselves are measured by hand, not in CI."""

from __future__ import annotations

import math
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
# issue 43: peft's BEFT warns that the benchmark model's q, v have no bias (no merged form there).
@pytest.mark.filterwarnings("ignore:Detected that the base layer has no bias term:UserWarning")
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
        assert lazy != "—" and (merged == "—") == (name in common.NO_MERGED_ROWS), line
        assert (peft == "—") == (name in common.NO_PEFT_ROWS), line
    assert "# targets:" in out
    # One round cannot bound a median: every target (each variant peft has, against peft) is
    # reported unresolved, none passes on it.
    targeted = {name: line for name, line in rows.items() if "lazy/peft" in line}
    assert set(targeted) == set(common.ALL_VARIANTS) - set(common.NO_PEFT_ROWS)
    assert all(line.rstrip(" |").endswith("UNRESOLVED") for line in targeted.values()), targeted
    assert f"upper bound <= {ratios['VS_PEFT_LIMIT']:.2f}" in rows["lora"]
    null = [line for line in out.splitlines() if line.startswith("# null check:")]
    assert len(null) == 1 and "true ratio 1.000" in null[0]


def test_median_ci_uses_the_binomial_order_statistics_and_covers_the_median(bench_module):
    common = bench_module("_common.py")
    median_ci = common["median_ci"]
    # Textbook indices (1-based): n = 6 -> (x1, x6) (coverage 96.9 %), n = 40 -> (x14, x27).
    assert median_ci([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)
    assert median_ci([float(i) for i in range(40, 0, -1)]) == (14.0, 27.0)
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) == (float("-inf"), float("inf"))  # 93.8 % at best
    rng = random.Random(0)
    true_median = math.log(2)  # of the unit exponential: skewed, like step times
    trials = 2000
    hits = sum(lo <= true_median <= hi for lo, hi in (median_ci([rng.expovariate(1.0) for _ in range(40)]) for _ in range(trials)))
    assert 0.94 <= hits / trials <= 0.985


def test_a_target_holds_or_fails_only_when_the_whole_interval_says_so(bench_module):
    common, ratios = bench_module("_common.py"), bench_module("ratios.py")
    verdict = common["verdict"]
    assert verdict(1.01, 1.03, 1.03) == "holds"
    assert verdict(1.031, 1.06, 1.03) == "fails"
    assert verdict(1.02, 1.04, 1.03) == "unresolved"
    assert ratios["VS_PEFT_LIMIT"] == 1.02


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


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` in get_peft_model.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_checkpointing_counts_what_autograd_keeps_and_the_target_holds(bench_module, capsys):
    """Deterministic counts, pinned: with checkpointing a LoRA step keeps exactly what the frozen
    base keeps (the layer inputs), far less than without; the script's verdict says so."""
    script = bench_module("checkpointing.py")
    args = ["--hidden", "64", "--layers", "3", "--vocab", "128", "--batch", "2", "--seq", "64", "--threads", "1"]
    assert script["main"](args) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in out.splitlines() if line.startswith("| ") and "configuration" not in line}
    assert set(rows) == {"frozen base", "lora lazy (overlay)", "lora merged (overlay)", "lora lazy (module-call route)", "peft lora"}
    counts = script["measure"](script["parse_args"]([*args, "--no-peft"]))
    base_off, base_on = counts["frozen base"]
    assert base_on < base_off / 3
    for name, (off, on) in counts.items():
        assert on <= 1.2 * base_on, name
        if name != "frozen base":
            assert off > base_off, f"{name}: the adapter's own saved tensors are missing without checkpointing"
    assert "-> HOLDS" in out



@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_qlora_prints_base_memory_saved_bytes_and_the_peft_ratio(bench_module, capsys):
    script = bench_module("qlora.py")
    tiny = ["--hidden", "64", "--layers", "1", "--vocab", "128", "--batch", "2", "--seq", "16", "--rank", "2", "--rounds", "2", "--warmup", "0", "--threads", "1", "--no-peak"]
    assert script["main"](tiny) == 0
    out = capsys.readouterr().out
    held = next(line for line in out.splitlines() if line.startswith("# base held:"))
    assert "nf4" in held and float(held.split("(")[1].split(" ")[0]) < 1.0  # the 4-bit base holds less
    rows = [line for line in out.splitlines() if line.startswith("| nf4") or line.startswith("| bf16")]
    assert len(rows) == 4 and all("MiB" in row for row in rows)
    assert "lora_func / peft:" in out


def test_fsdp_bench_counts_the_sharded_base_at_half_per_rank_and_trains_the_same_adapter(bench_module, capsys):
    """Pinned deterministic count: with 2 ranks each holds half of the base (every weight is
    sharded, targets included; the rotary buffers are tiny), and the sharded run trains exactly
    the adapter the replicated one does."""
    script = bench_module("fsdp.py")
    tiny = ["--hidden", "64", "--layers", "2", "--vocab", "128", "--batch", "1", "--seq", "16", "--rank", "2", "--no-peak"]
    assert script["main"](tiny) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| replicated") or line.startswith("| fsdp2")]
    ratios = {(r[0].strip(), r[1].strip()): float(r[3]) for r in rows}
    assert sorted(ratios) == [("fsdp2", "0"), ("fsdp2", "1"), ("replicated", "0"), ("replicated", "1")]
    assert all(0.49 <= ratios[("fsdp2", rank)] <= 0.51 for rank in "01"), ratios
    assert "fsdp2 vs replicated: 0.00e+00" in out


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` in get_peft_model.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_mixed_prints_every_row_and_lora_func_matches_peft_on_what_it_times(bench_module, capsys):
    script = bench_module("mixed.py")
    results = script["main"](["--quick", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "method" not in line]
    assert len(rows) == 11, out
    assert {"forward_mixed_over_one", "train_mixed_over_one", "generate_mixed_over_one_lazy", "generate_mixed_over_peft_mixed"} <= set(results)
    # The timed mixed forward and peft's adapter_names forward compute the same logits.
    difference = float(next(line for line in out.splitlines() if line.startswith("max |lora_func mixed - peft")).rsplit(" ", 1)[1])
    assert difference < 1e-5


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` in get_peft_model.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_counts_prints_both_dtypes_and_its_targets(bench_module, capsys):
    """The counts are deterministic: the tiny run prints a table per base dtype, a row per
    variant, and a verdict per bf16 target (the bounds themselves: tests/test_counts.py)."""
    script = bench_module("counts.py")
    tiny = ["--hidden", "32", "--layers", "1", "--vocab", "64", "--batch", "2", "--seq", "32", "--rank", "2", "--threads", "1",
            "--variants", "lora,ia3_kv_down,antipasto"]
    script["main"](tiny)
    out = capsys.readouterr().out
    assert "## float32 base" in out and "## bfloat16 base" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    assert [line.split("|")[1].strip() for line in rows] == ["lora", "ia3_kv_down", "antipasto"] * 2
    assert all(line.split("|")[5].strip() == "—" for line in rows if "antipasto" in line)  # peft has no AntiPaSTO
    targets = [line for line in out.splitlines() if line.startswith("# target:")]
    assert any("lora lazy saved / limit" in line for line in targets)
    assert sum("ia3_kv_down lazy" in line for line in targets) == 3
    assert all(line.endswith(("HOLDS", "FAILS")) for line in targets)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_overhead_adapted_call_section_compares_with_peft(bench_module, capsys):
    script = bench_module("overhead.py")
    tiny = ["--hidden", "32", "--vocab", "64", "--rank", "2", "--threads", "1", "--rounds", "2", "--sections", "adapted_call", "--overhead-layers", "2"]
    assert script["main"](tiny) == 0
    out = capsys.readouterr().out
    assert "2 layers x 7 targets = 14 targets" in out
    assert "adapted_call overhead <= peft's forward overhead" in out
    assert "UNRESOLVED" in out  # two rounds bound no median


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_attribution_prints_both_sizes_with_the_floor_target_and_the_oracles_rows(bench_module, capsys):
    """bench/attribution.py at tiny sizes: both sections, the FLOP-floor verdict, traker's row
    (traker is a test dependency) and kronfluence's float64 agreement where it is installed (it
    cannot be a test dependency: docs/attribution.md; its timing rows are left out at --quick)."""
    script = bench_module("attribution.py")
    results = script["main"](["--quick"])
    out = capsys.readouterr().out
    assert set(results) >= {"32x1", "64x1"}
    for size in ("32x1", "64x1"):
        assert results[size]["features"] > 0 and results[size]["projected_over_floor"] > 0 and results[size]["traker_over_ours"] > 0
    assert out.count("the FLOP floor)") >= 4 and out.count("-> HOLDS") + out.count("-> FAILS") == 2
    assert out.count("| traker 0.3.2 featurize") == 4
    try:
        import kronfluence  # noqa: F401
    except ImportError:
        assert "kronfluence not installed: no agreement check" in out
    else:
        assert results["kronfluence_float64_difference"] < 1e-10


def _table(text: str, heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the Markdown table under the heading that starts with
    ``heading``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows, seen_header = [], False
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|---"):
            seen_header = True
            continue
        if seen_header and line.startswith("| "):
            rows.append([cell.strip() for cell in line.split("|")[1:-1]])
    return rows


def _ratio(text: str) -> float:
    """The median of a ``median [lowest, highest]`` cell."""
    median, rest = text.split(" [", 1)
    low, high = (float(x) for x in rest.rstrip("]").split(", "))
    assert low <= float(median) <= high, text
    return float(median)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
def test_gpu_smoke_runs_every_section_on_the_cpu_and_writes_its_tables(bench_module, capsys, tmp_path, monkeypatch):
    """bench/gpu.py --smoke: every section of the GPU table on the CPU at tiny size, each row
    measured (nothing skipped), the same Markdown printed and written to --out. One row fails on
    its own: peft's VeRA raises, and its error prints in that cell while the row's other cells
    and the next rows are still measured (in the same run: a run of its own cost a model build
    and two more rows; VeRA's peft row is built by bench/ratios.py's test above)."""
    script = bench_module("gpu.py")
    peft_model = script["c"].peft_model

    def broken_for_vera(s, row, *args, **kwargs):
        if row == "vera":
            raise RuntimeError("peft broke here")
        return peft_model(s, row, *args, **kwargs)

    monkeypatch.setattr(script["c"], "peft_model", broken_for_vera)
    out = tmp_path / "table.md"
    assert script["main"](["--smoke", "--out", str(out)]) == 0
    printed, text = capsys.readouterr().out, out.read_text()
    for line in text.splitlines():
        assert line in printed, line  # every written line was printed
    assert "- device: cpu" in text and f"torch {torch.__version__}" in text
    assert "skipped" not in text and text.count("error:") == 1, text
    train = _table(text, "## 1. Every method")
    assert [row[0].split(" (")[0] for row in train] == list(script["SMOKE_METHODS"])
    assert script["SMOKE_METHODS"].index("vera") < len(train) - 1  # rows after the failing one
    for row in train:  # lazy, merged, peft: each a measured ratio to the frozen base
        assert _ratio(row[2]) > 0 and _ratio(row[3]) > 0, row
        if row[0].startswith("vera"):
            assert row[4] == "error: RuntimeError: peft broke here", row
            continue
        assert all(_ratio(cell) > 0 for cell in row[4:6]), row
        assert row[7].startswith("time "), row
    launch = {row[0]: row for row in _table(text, "## 1b. Launch-bound")}
    assert set(launch) == {"(frozen base)", *script["REPRESENTATIVE"][:2]}
    assert _ratio(launch["lora"][5]) > 0 and _ratio(launch["lora"][6]) > 0  # compiled merged and peft
    ensemble = _table(text, "## 2. K = 8")
    assert len(ensemble) == 2 and all(_ratio(row[3]) > 0 for row in ensemble)
    private = _table(text, "## 3. The private step")
    assert len(private) == 2 and all(_ratio(cell) > 0 for row in private for cell in row[1:5])
    serve = {row[0]: row for row in _table(text, "## 4. Serving")}
    check = serve.pop("(check) lora_func per-row vs peft adapter_names, prompt logits")
    assert float(check[1].rsplit(" ", 1)[1]) < 1e-2  # both sides serve each row with its own adapter
    assert set(serve) == {"one adapter, lazy", "one adapter, merged", "per-row (mixed_adapted)", "peft one adapter", "peft per-row (adapter_names)"}
    assert all(float(row[1]) > 0 for row in serve.values())
    (pretrained,) = _table(text, "## 5. The project's pretrained model")
    assert all(_ratio(cell) > 0 for cell in pretrained[2:6])
    (liger,) = _table(text, "## 6. LoRA on a model patched by liger-kernel")
    assert liger[1].startswith("cannot run: ") and "liger" in liger[1]  # the precise reason, on a CPU
    assert text.rstrip().splitlines()[-1].startswith("Finished in ")


def test_gpu_budget_skips_what_no_longer_fits_with_a_line_each(bench_module, capsys):
    script = bench_module("gpu.py")
    assert script["main"](["--smoke", "--budget", "0", "--sections", "train,ensemble,liger"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "ensemble", "liger"):
        assert f"## {name}: skipped, the budget's time ran out" in out
    assert "| lora |" not in out
