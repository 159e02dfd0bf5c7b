"""The RDP accountant (lora_func.privacy.accounting) against Opacus's, and the Poisson sampler.

Opacus is a test dependency only (the oracle): lora_func's accountant is written on the
standard library. Opacus's ``get_epsilon`` warns when the best order is the first or the last
of the default list; the warning is silenced around the oracle only.
"""

from __future__ import annotations

import itertools
import math
import statistics
import warnings

import pytest
import torch

import lora_func as lf
from lora_func.privacy import (
    Accountant,
    PoissonBatchSampler,
    epsilon,
    noise_for_epsilon,
    rdp,
)

# The accounting oracle: a pinned test dependency, imported directly so its absence fails.
import opacus.accountants as opacus_rdp

DELTA = 1e-5
# sigma from heavy noise to almost none; q from tiny batches to full batch; steps from one to an epoch of 1e4.
GRID = list(itertools.product([0.4, 0.8, 1.1, 2.0, 6.0], [1e-4, 3e-3, 0.05, 0.4, 1.0], [1, 70, 5000]))


def _opacus_epsilon(history, delta=DELTA):
    accountant = opacus_rdp.RDPAccountant()
    accountant.history = list(history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return accountant.get_epsilon(delta)


@pytest.mark.parametrize(("sigma", "q", "steps"), GRID)
def test_epsilon_equals_opacus_rdp_accountant(sigma, q, steps):
    want = _opacus_epsilon([(sigma, q, steps)])
    got = epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA)
    assert math.isclose(got, want, rel_tol=1e-6), (got, want)


def test_rdp_per_order_equals_opacus_at_integer_and_fractional_orders():
    from opacus.accountants.analysis.rdp import compute_rdp

    orders = [1.25, 1.5, 2.0, 3.7, 8.0, 31.5, 63.0]
    for sigma, q in [(0.7, 0.01), (1.3, 0.2), (3.0, 0.999)]:
        want = compute_rdp(q=q, noise_multiplier=sigma, steps=3, orders=orders)
        got = rdp(noise_multiplier=sigma, sample_rate=q, steps=3, orders=orders)
        for a, g, w in zip(orders, got, want, strict=True):
            assert math.isclose(g, w, rel_tol=1e-9), (sigma, q, a, g, w)


def test_an_accountant_with_a_changing_schedule_equals_opacus():
    history = [(1.0, 0.01, 300), (0.8, 0.02, 100), (1.0, 0.01, 50)]
    accountant = Accountant()
    for sigma, q, steps in history:
        for _ in range(2):
            accountant.step(noise_multiplier=sigma, sample_rate=q, steps=steps // 2)
    assert accountant.history == [(s, q, n) for s, q, n in history]  # equal consecutive steps merged
    assert math.isclose(accountant.epsilon(DELTA), _opacus_epsilon(history), rel_tol=1e-6)
    assert accountant.epsilon(1e-3) < accountant.epsilon(DELTA)


def test_the_edges_no_noise_no_steps_full_batch():
    assert epsilon(noise_multiplier=0.0, sample_rate=0.1, steps=10, delta=DELTA) == math.inf
    assert epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=0, delta=DELTA) == 0.0
    assert Accountant().epsilon(DELTA) == 0.0
    # q = 1: the Gaussian mechanism, RDP alpha / (2 sigma^2) per step.
    assert rdp(noise_multiplier=2.0, sample_rate=1.0, steps=3, orders=[4.0]) == [3 * 4.0 / 8.0]


@pytest.mark.parametrize(("target", "q", "steps"), [(8.0, 0.01, 1000), (1.0, 0.004, 2500), (60.0, 0.1, 10)])
def test_noise_for_epsilon_is_the_smallest_sigma_within_budget(target, q, steps):
    from opacus.accountants.utils import get_noise_multiplier

    sigma = noise_for_epsilon(epsilon=target, sample_rate=q, steps=steps, delta=DELTA)
    assert epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA) <= target
    assert epsilon(noise_multiplier=sigma * (1 - 1e-6), sample_rate=q, steps=steps, delta=DELTA) > target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        theirs = get_noise_multiplier(target_epsilon=target, target_delta=DELTA, sample_rate=q, steps=steps)
    # Opacus stops its bisection within 0.01 of epsilon, on the safe side: a sigma at least ours.
    assert sigma <= theirs < sigma * 1.02
    assert math.isclose(_opacus_epsilon([(sigma, q, steps)]), target, rel_tol=1e-6)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: epsilon(noise_multiplier=1.0, sample_rate=0.0, steps=1, delta=DELTA), "sample_rate must be a real number in"),
        (lambda: epsilon(noise_multiplier=1.0, sample_rate=1.5, steps=1, delta=DELTA), "sample_rate"),
        (lambda: epsilon(noise_multiplier=-0.1, sample_rate=0.1, steps=1, delta=DELTA), "noise_multiplier"),
        (lambda: epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=1, delta=1.0), "delta must be a real number in"),
        (lambda: epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=2.0, delta=DELTA), "steps must be an integer"),
        (lambda: epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=True, delta=DELTA), "steps must be an integer"),
        (lambda: noise_for_epsilon(epsilon=0.0, sample_rate=0.1, steps=1, delta=DELTA), "epsilon must be a real number in"),
        (lambda: PoissonBatchSampler(10, 0.1, 3, generator=7), "generator must be a torch.Generator"),
    ],
)
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_poisson_batches_vary_and_include_each_example_at_the_sample_rate():
    n, q, steps = 200, 0.05, 400
    sampler = PoissonBatchSampler(n, q, steps, generator=torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert len(sampler) == len(batches) == steps and sampler.expected_batch_size == pytest.approx(10.0)
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    # Binomial(n, q) sizes: mean nq, variance nq(1-q); an empty batch is possible, not dropped.
    assert abs(float(sizes.mean()) - n * q) < 4 * math.sqrt(n * q * (1 - q) / steps)
    assert abs(float(sizes.var()) / (n * q * (1 - q)) - 1) < 0.2
    assert len(set(sizes.tolist())) > 5
    counts = torch.zeros(n)
    for b in batches:
        assert b == sorted(set(b)) and all(0 <= i < n for i in b)  # no repeats, in range
        counts[b] += 1
    rate = counts / steps  # each example's inclusion rate, independent of its index
    assert abs(float(rate.mean()) - q) < 0.003
    assert float(rate[: n // 2].mean() - rate[n // 2 :].mean()) == pytest.approx(0.0, abs=0.01)
    # Deterministic per generator seed; another seed differs.
    assert list(PoissonBatchSampler(n, q, steps, generator=torch.Generator().manual_seed(0))) == batches
    assert list(PoissonBatchSampler(n, q, steps, generator=torch.Generator().manual_seed(1))) != batches


def test_poisson_sampler_drives_a_dataloader_and_yields_empty_batches():
    data = torch.utils.data.TensorDataset(torch.arange(6))
    sampler = PoissonBatchSampler(6, 0.1, 30, generator=torch.Generator().manual_seed(0))
    batches = [b for b in sampler]
    assert any(len(b) == 0 for b in batches)  # P(empty) = 0.9^6 = 0.53
    loader = torch.utils.data.DataLoader(data, batch_sampler=PoissonBatchSampler(6, 0.9, 3, generator=torch.Generator().manual_seed(0)))
    for (values,) in loader:
        assert values.dim() == 1 and len(values) <= 6


def test_top_level_names():
    assert lf.private_grads is lf.privacy.private_grads and lf.epsilon is lf.privacy.epsilon


# ------------------------------------------------------------------------------------- PRV


def _opacus_prv(history, delta=DELTA):
    from opacus.accountants import PRVAccountant

    accountant = PRVAccountant()
    accountant.history = list(history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy's log(0) at q = 1, the extreme-order notice
        return accountant.get_epsilon(delta)


@pytest.mark.parametrize(("sigma", "q", "steps"), [(1.0, 0.01, 1000), (2.0, 0.25, 120), (3.0, 1.0, 10)])
def test_prv_epsilon_equals_opacus_prv_accountant_and_is_below_rdp(sigma, q, steps):
    from lora_func.privacy import prv_epsilon

    got = prv_epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA)
    assert math.isclose(got, _opacus_prv([(sigma, q, steps)]), rel_tol=1e-6)
    assert got < epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA)


def test_prv_on_a_coarse_mesh_keeps_the_mean_shift_of_every_step():
    # eps_error 0.5: a coarse mesh, each step's discretised mean is off by ~1e-4, 0.08 over 1000
    # steps; the shift (and the quadrature of the continuous mean) must be exact to match.
    from opacus.accountants import PRVAccountant

    from lora_func.privacy import prv_epsilon

    accountant = PRVAccountant()
    accountant.history = [(1.0, 0.01, 1000)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = accountant.get_epsilon(DELTA, eps_error=0.5)
    assert math.isclose(prv_epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=1000, delta=DELTA, eps_error=0.5), want, rel_tol=1e-6)


def test_prv_of_a_changing_schedule_equals_opacus():
    from lora_func.privacy import prv_epsilon_of_history

    accountant = Accountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.01, steps=300)
    accountant.step(noise_multiplier=0.8, sample_rate=0.02, steps=100)
    # Opacus convolves the two parts in another order: float64 rounding differs at 1e-7.
    assert math.isclose(prv_epsilon_of_history(accountant.history, DELTA), _opacus_prv(accountant.history), rel_tol=1e-6)
    assert prv_epsilon_of_history([], DELTA) == 0.0
    assert prv_epsilon_of_history([(0.0, 0.1, 3)], DELTA) == math.inf


def test_poisson_batch_indices_is_a_pure_function_of_the_step_at_the_sample_rate():
    from lora_func.privacy import poisson_batch_indices

    n, q = 100, 0.1
    batches = [poisson_batch_indices(n, q, seed=3, step=s) for s in range(300)]
    assert all(torch.equal(b, poisson_batch_indices(n, q, seed=3, step=s)) for s, b in enumerate(batches[:20]))  # a resume sees the same
    assert not torch.equal(batches[0], poisson_batch_indices(n, q, seed=4, step=0))
    assert all(b.dtype == torch.int64 and torch.equal(b, b.unique()) for b in batches)  # sorted, no repeats
    counts = torch.zeros(n)
    for b in batches:
        counts[b] += 1
    assert abs(float(counts.mean()) / 300 - q) < 0.006
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    assert abs(float(sizes.var()) / (n * q * (1 - q)) - 1) < 0.2  # binomial, not a fixed size
    # Consecutive steps are independent draws: the overlap of two batches is about q of each.
    overlap = statistics.mean(len(set(a.tolist()) & set(b.tolist())) / max(1, len(a)) for a, b in itertools.pairwise(batches))
    assert abs(overlap - q) < 0.03
    with pytest.raises(ValueError, match="num_examples must be an integer >= 1"):
        poisson_batch_indices(0, q, seed=0, step=0)
