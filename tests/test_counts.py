"""Regression bounds on the deterministic step counts of bench/counts.py (saved-for-backward
bytes, bytes written by every op, ops run; each over the frozen base), on a small Llama.

The counts do not depend on the machine, so these are exact: a change that keeps an extra
fp32 copy of the activations, adds a pass over them or a few ops per target shows here. The
bounds are the measured values plus 2 %; the targets of docs/benchmarks.md are checked as the
script states them (bf16 base, adapters fp32)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
ARGS = "--hidden 64 --layers 2 --vocab 128 --batch 4 --seq 64 --rank 4 --threads 1".split()
ROWS = ("lora", "dora", "delora", "hra", "ia3", "ia3_ff", "ia3_kv_down")
ROWS += ("oft", "boft", "road", "hira")  # issue 30 (b)

# (saved bytes, written bytes, ops) over the frozen base, lazy overlay, measured at ARGS.
PINNED = {
    "bfloat16": {
        "lora": (77824, 204800, 48),
        "dora": (546816, 2981888, 112),
        "delora": (78224, 251024, 192),
        "hra": (152192, 355632, 208),
        "ia3": (131072, 1311744, 28),
        "ia3_ff": (176128, 1762656, 14),
        "ia3_kv_down": (307200, 3074400, 42),
    },
    "float32": {
        "lora": (151552, 618496, 40),
        "dora": (415744, 1867776, 84),
        "delora": (172432, 677008, 184),
        "hra": (176768, 720176, 200),
        "ia3": (262144, 787456, 16),
        "ia3_ff": (352256, 1058144, 8),
        "ia3_kv_down": (614400, 1845600, 24),
    },
}

# Issue 30 (structured family, first part): the lazy counts measured at ARGS; the bf16 targets
# (at most peft's on every count) are checked for them too.
STRUCTURED_A = ("loha", "lokr", "gralora", "miss")
ROWS += STRUCTURED_A
PINNED["bfloat16"] |= {
    "loha": (327680, 2179072, 88),
    "lokr": (327680, 2297856, 80),
    "gralora": (294912, 2891776, 88),
    "miss": (16384, 2134016, 52),
}
PINNED["float32"] |= {
    "loha": (196608, 1261568, 68),
    "lokr": (196608, 1773568, 64),
    "gralora": (163840, 2367488, 72),
    "miss": (16384, 1609728, 36),
}


# issue 30 (b), measured at ARGS (peft's are 393216/3341824/164, 309760/2266112/172,
# 530432/4214784/156, 327680/2367488/64 on bf16; 262144/2555392/148, 539648/2299392/148,
# 530432/3428352/140, 196608/1581056/44 on fp32).
PINNED["bfloat16"] |= {"oft": (393216, 3276288, 156), "boft": (242688, 662016, 116), "road": (530432, 4214784, 156), "hira": (327680, 2367488, 64)}
PINNED["float32"] |= {"oft": (262144, 2489856, 140), "boft": (275456, 530944, 104), "road": (530432, 3428352, 140), "hira": (196608, 1581056, 44)}

# issue 30 (c): C3A's lazy FFT form, measured at ARGS (peft's are the same on both dtypes).
ROWS += ("c3a",)
PINNED["bfloat16"] |= {"c3a": (262144, 5373952, 76)}
PINNED["float32"] |= {"c3a": (131072, 4849664, 60)}


# issue 43: BEFT, GLoRA and PSOFT, measured at ARGS (peft's: 0/787456/20, 98304/1818624/100,
# 17728/2774832/184 on bf16; 0/263168/8, 196608/3096576/84, 17728/1988400/164 on fp32). OSF is not
# held to peft's ops on bf16 (bench/counts.py): 262144/1147392/96 there, peft 655360/3047936/88.
ROWS += ("beft", "glora", "psoft")
PINNED["bfloat16"] |= {"beft": (0, 787456, 20), "glora": (98304, 1130496, 68), "psoft": (17728, 1940272, 180)}
PINNED["float32"] |= {"beft": (0, 263168, 8), "glora": (196608, 1720320, 60), "psoft": (17728, 1415984, 164)}

# issue 43: DEFT, PEANuT, Super-Tuning, BD-LoRA and VeLoRA (eval mode: LoRA's forward), measured at
# ARGS (peft's: 565248/4071424/132, 397312/2187264/80, 99584/68096/24, 278528/2828288/80,
# 278544/3465268/100 on bf16; 434176/3022848/108, 200704/1597440/60, 197888/132992/16,
# 147456/2435072/68, 278544/2678836/80 on fp32: BD-LoRA's fp32 saved bytes are 1.06x peft's, 0.28x
# on bf16, where the targets are). QALoRA and aLoRA have no peft row (bench/_common.py); OSF is
# above peft's ops on bf16 (above).
ROWS += ("deft", "peanut", "supertuning", "bdlora", "velora")
PINNED["bfloat16"] |= {
    "deft": (147456, 299008, 80),
    "peanut": (147456, 286720, 68),
    "supertuning": (98304, 66816, 20),
    "bdlora": (77888, 215104, 64),
    "velora": (77824, 204800, 48),
}
PINNED["float32"] |= {
    "deft": (159744, 622592, 68),
    "peanut": (159744, 610304, 56),
    "supertuning": (196608, 131712, 12),
    "bdlora": (155712, 628800, 56),
    "velora": (151552, 618496, 40),
}

@pytest.fixture(scope="module")
def counts_script():
    path = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        yield runpy.run_path(str(BENCH / "counts.py"), run_name="bench")
    finally:
        sys.path[:] = path


@pytest.fixture(scope="module")
def measured(counts_script):
    import torch

    threads = torch.get_num_threads()
    args = counts_script["parse_args"](ARGS)
    try:
        with torch.random.fork_rng():
            counts_script["c"].setup(args)
            return {dtype: counts_script["measure"](args, dtype, ROWS) for dtype in PINNED}
    finally:
        torch.set_num_threads(threads)


# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` in get_peft_model.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


@pytest.mark.parametrize("dtype", list(PINNED))
@pytest.mark.parametrize("row", ROWS)
def test_lazy_counts_stay_within_their_pinned_bounds(measured, dtype, row):
    counts = measured[dtype]
    over = tuple(v - b for v, b in zip(counts[f"{row}/lazy"], counts["base"], strict=True))
    for what, got, pinned in zip(("saved", "written", "ops"), over, PINNED[dtype][row], strict=True):
        assert got <= pinned * 1.02 + 64, f"{dtype} {row} lazy {what}: {got} over the frozen base, pinned at {pinned}"


def test_bf16_targets_hold(counts_script, measured):
    results = counts_script["check_targets"](measured["bfloat16"], ROWS)
    assert {what.split(" lazy")[0] for what, *_ in results} == set(ROWS)
    failing = [(what, round(value, 3), limit) for what, value, limit, holds in results if not holds]
    assert not failing, failing


def test_the_lazy_lora_path_keeps_no_fp32_copy_of_its_inputs(measured):
    """The limit itself (one bf16 copy of each distinct target input, the (n, r) activations) is
    reached within 1.2x, while the fp32-path LoRA of peft keeps more than 3x it."""
    counts = measured["bfloat16"]
    saved_limit, written_limit = counts["limit"]["lora"]
    lazy = counts["lora/lazy"][0] - counts["base"][0]
    peft = counts["lora/peft"][0] - counts["base"][0]
    assert lazy <= 1.2 * saved_limit < peft / 2.5
    assert counts["lora/lazy"][1] - counts["base"][1] <= 2 * written_limit


# Issue 46: every other method peft has, on the bf16 base (the targets' dtype), measured at ARGS
# (peft's in the comment). OLoRA, CorDA, LoRA-GA and LoftQ run PiSSA's activation form (the same
# counts, checked by bench/counts.py's default run), so PiSSA stands for them here.
LATER_ROWS = ("pissa", "eva", "adalora", "adamss", "kasa", "ln_tuning", "mica", "pvera", "randlora", "tinylora", "unilora", "vblora", "vera", "lily")
LATER_PINNED = {
    "pissa": (110592, 237568, 52),  # peft (278528, 2678784, 68)
    "eva": (77824, 204800, 48),  # peft (73728, 946176, 48)
    "adalora": (286720, 1548352, 76),  # peft (544784, 3870816, 108)
    "adamss": (50176, 1981284, 136),  # peft (23200, 1305216, 296)
    "kasa": (331776, 1617984, 80),  # peft (294912, 2728000, 84)
    "ln_tuning": (131584, 134144, 20),  # peft (131072, 131584, 8)
    "mica": (77824, 194560, 36),  # peft (262144, 2674688, 64)
    "pvera": (69632, 1688960, 92),  # peft (327680, 3228800, 120)
    "randlora": (458752, 2704384, 76),  # peft (327680, 3752960, 88)
    "tinylora": (16640, 1548800, 71),  # peft (16640, 2196992, 76)
    "unilora": (286720, 1551360, 99),  # peft (286720, 2202624, 107)
    "vblora": (304640, 2472960, 171),  # peft (304640, 3125252, 191)
    "vera": (36864, 1557568, 76),  # peft (278528, 2982976, 84)
    "lily": (290848, 2506944, 114),  # peft (290848, 2506944, 114): the same ops as peft's forward
}
# issue 43 (FRoD): peft (164352, 1248192, 88); on fp32 lazy (262144, 2687616, 60), peft (262144, 2688000, 72).
LATER_ROWS += ("frod",)
LATER_PINNED["frod"] = (131072, 1478208, 100)
# The counts where lazy is above peft today, each diagnosed in docs/benchmarks.md ("Every method
# peft has"), with the fix proposed there. Asserted as they are: a fix makes this test fail,
# and the entry goes (the row then holds the target like the others).
KNOWN_ABOVE_PEFT = {
    ("eva", "saved"),  # the two (r, d) bf16 factor casts the bf16 product node keeps; peft's EVA adapter is bf16
    ("kasa", "saved"),  # as PiSSA was: its ΔΣ gradient loses precision on the bf16 node (docs/benchmarks.md)
    ("adamss", "saved"), ("adamss", "written"),  # fp32 activations and an fp32 copy of x; peft computes in bf16
    ("ln_tuning", "saved"), ("ln_tuning", "written"), ("ln_tuning", "ops"),  # fp32 copy of a bf16 norm weight, cast per step
    ("randlora", "saved"),  # λ ⊙ A kept for γ's gradient, contiguous copy of U_Bᵀ
    ("frod", "written"), ("frod", "ops"),  # fp32 U, V cast to bf16 in forward and again in backward; peft holds them in bf16
}


@pytest.fixture(scope="module")
def measured_later(counts_script):
    import torch

    threads = torch.get_num_threads()
    args = counts_script["parse_args"](ARGS)
    try:
        with torch.random.fork_rng():
            counts_script["c"].setup(args)
            return counts_script["measure"](args, "bfloat16", LATER_ROWS)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("row", LATER_ROWS)
def test_every_other_peft_method_stays_within_its_pinned_counts(measured_later, row):
    over = tuple(v - b for v, b in zip(measured_later[f"{row}/lazy"], measured_later["base"], strict=True))
    for what, got, pinned in zip(("saved", "written", "ops"), over, LATER_PINNED[row], strict=True):
        assert got <= pinned * 1.02 + 64, f"bfloat16 {row} lazy {what}: {got} over the frozen base, pinned at {pinned}"


def test_every_other_peft_method_is_at_most_peft_but_for_the_known_gaps(counts_script, measured_later):
    """bench/counts.py's target for every row peft has: lazy <= peft on saved bytes, written
    bytes and ops; the counts above peft today are exactly the diagnosed ones."""
    results = counts_script["check_targets"](measured_later, LATER_ROWS)
    assert {what.split(" lazy")[0] for what, *_ in results} == set(LATER_ROWS)
    above = {(what.split(" lazy ")[0], what.split(" lazy ")[1].split(" /")[0]) for what, _value, _limit, holds in results if not holds}
    assert above == KNOWN_ABOVE_PEFT
# issue 43: peft's BEFT warns that the benchmark model's q, v have no bias (no merged form there).
pytestmark = [pytestmark, pytest.mark.filterwarnings("ignore:Detected that the base layer has no bias term:UserWarning")]
