"""Run a function in ``world`` spawned processes (one per rank), bounded in time.

The multi-process tests (gloo on the CPU) all start their ranks the same way: spawned (not
forked: torch's thread pools do not survive a fork), one OpenMP thread each (inherited from
the environment at start-up, so two ranks do not fight over the machine's cores), joined
with a time limit, and killed if they hang, so that a deadlocked collective fails the test
instead of the whole CI run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(target: Callable[..., Any], world: int, args: tuple, timeout_s: float, what: str = "worker processes") -> None:
    """``target(rank, *args)`` in ``world`` spawned processes; asserts that every one exits with 0
    within ``timeout_s`` (the hung ones are killed first)."""
    ctx = mp.get_context("spawn")
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the children at start-up
    try:
        procs = [ctx.Process(target=target, args=(rank, *args)) for rank in range(world)]
        for p in procs:
            p.start()
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    for p in procs:
        p.join(timeout=timeout_s)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"{what} {hung} did not finish within {timeout_s} s"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"{what}: exit codes {codes}"
