"""Argument checks of lora_func.privacy, shared by its modules: each names the argument, the
value and what it means."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Literal, cast

import torch


def check_real(value: object, name: str, low: float, high: float, *, low_open: bool, high_open: bool, hint: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and isinstance(value, (int, float)):
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok or not isinstance(value, (int, float)):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a real number in {interval}, got {value!r}; {hint}")  # error: privacy-argument-range
    return float(value)


def check_noise(noise_multiplier: object) -> float:
    return check_real(noise_multiplier, "noise_multiplier", 0.0, math.inf, low_open=False, high_open=True,
                      hint="it is sigma, the noise std divided by max_grad_norm (0 means no noise: no privacy)")


def check_rate(sample_rate: object) -> float:
    return check_real(sample_rate, "sample_rate", 0.0, 1.0, low_open=True, high_open=False,
                      hint="it is q, the probability that one example is in a batch: expected batch size / dataset size")


def check_delta(delta: object) -> float:
    return check_real(delta, "delta", 0.0, 1.0, low_open=True, high_open=True,
                      hint="pick delta well below 1/dataset size, e.g. 1e-5")


def check_steps(steps: object) -> int:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0 (the number of noisy steps taken), got {steps!r}")  # error: privacy-steps
    return steps


def check_orders(orders: object) -> tuple[float, ...]:
    """``orders`` as a tuple of floats after checking it is a non-empty sequence of finite real
    numbers > 1 (not a string, a mapping or a single number)."""
    values: tuple[object, ...] | None = None
    if isinstance(orders, Iterable) and not isinstance(orders, (str, bytes, Mapping)):
        values = tuple(orders)
    if not values or not all(isinstance(a, numbers.Real) and not isinstance(a, bool) and math.isfinite(float(a)) and float(a) > 1 for a in values):
        raise ValueError(  # error: privacy-orders
            f"orders must be a non-empty sequence of finite RDP orders > 1, got {orders!r}; the default "
            f"(lora_func.privacy.DEFAULT_ORDERS, Opacus's) suits every use"
        )
    return tuple(float(cast(numbers.Real, a)) for a in values)


def check_norm(max_grad_norm: object) -> float:
    return check_real(max_grad_norm, "max_grad_norm", 0.0, math.inf, low_open=True, high_open=True,
                      hint="it is C, the bound on each example's gradient norm over all adapter tensors (docs/guide/privacy.md: choosing C)")


def check_generator(generator: object, where: str) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{where}: generator must be a torch.Generator or None, got {type(generator).__name__}")  # error: privacy-generator


def check_expected_batch_size(expected_batch_size: object) -> float | None:
    if expected_batch_size is None:
        return None
    return check_real(expected_batch_size, "expected_batch_size", 0.0, math.inf, low_open=True, high_open=True,
                      hint="with Poisson sampling it is sample_rate * dataset size (PoissonBatchSampler.expected_batch_size)")


def check_num_examples(num_examples: object, where: str) -> int:
    if not isinstance(num_examples, int) or isinstance(num_examples, bool) or num_examples < 1:
        raise ValueError(f"{where}: num_examples must be an integer >= 1, got {num_examples!r}; pass the dataset size, len(dataset)")  # error: privacy-sampler-size
    return num_examples


def check_clipping(clipping: object) -> Literal["auto", "ghost", "per_example"]:
    if clipping != "auto" and clipping != "ghost" and clipping != "per_example":  # (narrows for mypy)
        raise ValueError(  # error: privacy-clipping
            f"clipping={clipping!r} is not one of 'auto', 'ghost', 'per_example' (how the per-example norms are found; "
            f"all three give the same result, 'auto' the cheapest)"
        )
    return clipping
