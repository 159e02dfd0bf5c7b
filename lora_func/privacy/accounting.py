"""Privacy accounting for DP-SGD: the RDP accountant of the sampled Gaussian mechanism.

One DP-SGD step on a Poisson-sampled batch (each example in with probability ``q``, the
``sample_rate``), with per-example gradients clipped to norm ``C`` and Gaussian noise of std
``sigma * C`` (``sigma`` the ``noise_multiplier``), is the sampled Gaussian mechanism. Its Rényi
DP at order ``alpha`` is computed exactly as in Mironov, Talwar and Zhang 2019, "Rényi
Differential Privacy of the Sampled Gaussian Mechanism" (section 3.3), steps compose by adding
RDP, and the conversion to ``(epsilon, delta)``-DP is Balle et al. 2020 (theorem 21), minimised
over the orders. This is the computation of Opacus's ``RDPAccountant`` (and TF Privacy's),
rewritten on the standard library only, so lora_func has no dependency for it;
tests/test_privacy_accounting.py checks it against Opacus over a grid of (sigma, q, steps).

Pure Python floats: no tensors, no global state. The RDP of one step is cached per
``(sigma, q)``, so the inverse (:func:`noise_for_epsilon`, a root search) is cheap.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from lora_func.privacy._checks import (
    check_delta,
    check_noise,
    check_orders,
    check_rate,
    check_real,
    check_steps,
)

__all__ = ["DEFAULT_ORDERS", "Accountant", "epsilon", "noise_for_epsilon", "rdp"]

# Opacus's RDPAccountant.DEFAULT_ALPHAS: the orders over which epsilon is minimised.
DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))

_MAX_SIGMA = 1e6  # the inverse gives up above this noise multiplier (Opacus's MAX_SIGMA)
# The inverse's evaluations after bracketing, at most: regula falsi with the Illinois step (and
# bisection where it stalls) reaches adjacent doubles in well under 200; the cap bounds any rtol.
_MAX_STEPS = 200


def _log_add(logx: float, logy: float) -> float:
    a, b = min(logx, logy), max(logx, logy)
    if a == -math.inf:
        return b
    return math.log1p(math.exp(a - b)) + b


def _log_sub(logx: float, logy: float) -> float:
    if logy == -math.inf:
        return logx
    if logx == logy:
        return -math.inf
    try:
        return math.log(math.expm1(logx - logy)) + logy
    except (OverflowError, ValueError):
        return logx


def _log_erfc(x: float) -> float:
    """``log(erfc(x))``, accurate where ``erfc(x)`` underflows (large ``x``)."""
    if x < 20.0:
        return math.log(math.erfc(x))
    # Asymptotic series: erfc(x) = exp(-x²)/(x√π) · (1 - 1/(2x²) + 3/(2x²)² - 15/(2x²)³ + ...);
    # at x >= 20 five terms are exact to double precision.
    u = 1.0 / (2.0 * x * x)
    series = 1.0 - u + 3.0 * u**2 - 15.0 * u**3 + 105.0 * u**4 - 945.0 * u**5
    return -x * x - math.log(x) - 0.5 * math.log(math.pi) + math.log(series)


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    log_a = -math.inf
    for i in range(alpha + 1):
        log_coef = math.log(math.comb(alpha, i)) + i * math.log(q) + (alpha - i) * math.log1p(-q)
        log_a = _log_add(log_a, log_coef + (i * i - i) / (2 * sigma**2))
    return log_a


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    # The two halves of A_alpha, integrals over (-inf, z0] and [z0, inf), as series in i.
    log_a0, log_a1 = -math.inf, -math.inf
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    coef = 1.0  # binom(alpha, i), generalised to real alpha, updated term by term
    i = 0
    while True:
        log_coef = math.log(abs(coef))
        j = alpha - i
        log_t0 = log_coef + i * math.log(q) + j * math.log1p(-q)
        log_t1 = log_coef + j * math.log(q) + i * math.log1p(-q)
        log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (i * i - i) / (2 * sigma**2) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * sigma**2) + log_e1
        if coef > 0:
            log_a0, log_a1 = _log_add(log_a0, log_s0), _log_add(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub(log_a0, log_s0), _log_sub(log_a1, log_s1)
        i += 1
        coef *= (alpha - i + 1) / i
        if max(log_s0, log_s1) < -30 or coef == 0:
            break
    return _log_add(log_a0, log_a1)


@functools.lru_cache(maxsize=4096)
def _rdp_one_step(q: float, sigma: float, alpha: float) -> float:
    if q == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if q == 1.0:
        return alpha / (2 * sigma**2)
    log_a = _log_a_int(q, sigma, int(alpha)) if float(alpha).is_integer() else _log_a_frac(q, sigma, alpha)
    return log_a / (alpha - 1)


def rdp(*, noise_multiplier: float, sample_rate: float, steps: int, orders: Sequence[float] = DEFAULT_ORDERS) -> list[float]:
    """The Rényi DP of ``steps`` DP-SGD steps at each of ``orders`` (``inf`` without noise)."""
    sigma, q, steps = check_noise(noise_multiplier), check_rate(sample_rate), check_steps(steps)
    return [_rdp_one_step(q, sigma, a) * steps if steps else 0.0 for a in check_orders(orders)]


def _epsilon_of_rdp(orders: Sequence[float], rdps: Sequence[float], delta: float) -> float:
    best = math.inf
    for a, r in zip(orders, rdps, strict=True):
        if math.isinf(r):
            continue
        eps = r - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
        best = min(best, eps)
    return best


class Accountant:
    """The privacy spent by a sequence of DP-SGD steps whose noise or sample rate may change.

    ``accountant.step(noise_multiplier=, sample_rate=, steps=1)`` after each step (or once for
    many steps); ``accountant.epsilon(delta)`` is the ``epsilon`` spent so far. Equal to
    Opacus's ``RDPAccountant`` given the same history.
    """

    def __init__(self, orders: Sequence[float] = DEFAULT_ORDERS) -> None:
        self.orders = check_orders(orders)
        self.history: list[tuple[float, float, int]] = []  # (noise_multiplier, sample_rate, steps)

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        sigma, q, steps = check_noise(noise_multiplier), check_rate(sample_rate), check_steps(steps)
        if self.history and self.history[-1][:2] == (sigma, q):
            self.history[-1] = (sigma, q, self.history[-1][2] + steps)
        else:
            self.history.append((sigma, q, steps))

    def epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        total = [0.0] * len(self.orders)
        for sigma, q, steps in self.history:
            total = [t + r for t, r in zip(total, rdp(noise_multiplier=sigma, sample_rate=q, steps=steps, orders=self.orders), strict=True)]
        if not self.history or all(steps == 0 for *_, steps in self.history):
            return 0.0
        return _epsilon_of_rdp(self.orders, total, delta)

    def __repr__(self) -> str:
        return f"Accountant(history={self.history!r})"


def epsilon(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            orders: Sequence[float] = DEFAULT_ORDERS) -> float:
    """The ``epsilon`` of ``steps`` DP-SGD steps with Poisson sample rate ``sample_rate`` and
    noise multiplier ``noise_multiplier``, at ``delta`` (RDP accountant; ``inf`` without
    noise, ``0`` for zero steps)."""
    accountant = Accountant(orders)
    accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)
    return accountant.epsilon(delta)


def noise_for_epsilon(*, epsilon: float, sample_rate: float, steps: int, delta: float,
                      orders: Sequence[float] = DEFAULT_ORDERS, rtol: float = 1e-9) -> float:
    """The smallest noise multiplier whose :func:`epsilon` after ``steps`` steps at
    ``sample_rate`` is at most ``epsilon`` (a bracketing root search to a relative ``rtol`` on sigma; the
    result always satisfies the budget). Opacus's ``get_noise_multiplier`` stops its bisection
    at an epsilon tolerance of 0.01, so it returns a slightly larger sigma.

    ``rtol`` in ``[0, 1)``: ``0`` searches to the last float (the bracket's two ends adjacent
    doubles); the search takes at most ``_MAX_STEPS`` evaluations whatever ``rtol``, and returns
    its safe end then. ``steps`` must be at least 1 (with none, every noise multiplier, 0
    included, spends nothing, so no smallest one protects anything).
    """
    target = check_real(epsilon, "epsilon", 0.0, math.inf, low_open=True, high_open=True,
                         hint="the privacy budget; common choices are 1 to 10")
    q, steps, delta = check_rate(sample_rate), check_steps(steps), check_delta(delta)
    orders = check_orders(orders)
    rtol = check_real(rtol, "rtol", 0.0, 1.0, low_open=False, high_open=True,
                      hint="the relative width of the final bracket on sigma (0: to the last float)")
    if steps == 0:
        raise ValueError(  # error: privacy-noise-no-steps
            "noise_for_epsilon: steps=0 spends no privacy, so every noise_multiplier (0 included) meets any epsilon and "
            "there is no smallest one to protect the training; pass steps=, the number of DP-SGD steps you will take"
        )

    def spent(sigma: float) -> float:
        return _epsilon_of_rdp(orders, [_rdp_one_step(q, sigma, a) * steps for a in orders], delta)

    # Bracket [low, high] with spent(low) > target >= spent(high), then regula falsi on
    # log(epsilon) with the Illinois modification (superlinear; ~10 evaluations instead of
    # bisection's ~35, each a sum over 150 orders): always keeps a bracket, returns its safe end.
    def gap(sigma: float) -> float:
        return math.log(spent(sigma)) - math.log(target)

    low, high = 0.5, 1.0
    g_high = gap(high)
    while g_high > 0:
        low, high = high, 2 * high
        if high > _MAX_SIGMA:
            raise ValueError(  # error: privacy-budget-too-small
                f"noise_for_epsilon: no noise multiplier up to {_MAX_SIGMA:g} reaches epsilon={target!r} at delta={delta!r} "
                f"after {steps} steps at sample_rate={q!r}; allow a larger epsilon or delta, or fewer steps"
            )
        g_high = gap(high)
    g_low = gap(low)
    while g_low <= 0:
        low, high, g_high = low / 2, low, g_low
        g_low = gap(low)
    side = 0
    for _ in range(_MAX_STEPS):
        if high - low <= rtol * high:
            break
        mid = high - g_high * (high - low) / (g_high - g_low)
        if not low < mid < high:
            mid = (low + high) / 2
            if not low < mid < high:  # adjacent floats: the bracket cannot shrink further
                break
        g_mid = gap(mid)
        if g_mid > 0:
            low, g_low = mid, g_mid
            if side == -1:
                g_high /= 2
            side = -1
        else:
            high, g_high = mid, g_mid
            if side == 1:
                g_low /= 2
            side = 1
    return high
