"""Suite-wide settings.

One intra-op thread per test process. The tests run tiny models, where a second OpenMP
thread buys nothing, and on a machine whose other core is busy the two threads spin
against the other load: the suite went from 2.5 to 18 minutes with one competing process
on 2 cores. The environment variables reach the processes the tests start (torchrun,
spawned ranks, the demo, the dashboard's marimo server); tests that measure threading set
their own count and restore it.

No cyclic garbage collection while the tests are collected, then everything alive at the end
of collection (torch, transformers, peft, the test modules and their parameters: millions of
objects that live as long as the process) moved out of the collector's reach with
``gc.freeze()``: every full collection used to walk all of them, a third of a worker's
collection time and a part of every test's (docs/testing.md, "How long the suite takes"). Objects
the tests create are collected as before (``gc.collect()`` still frees them).
"""

from __future__ import annotations

import gc
import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import pytest
import torch  # noqa: E402  (after the environment, which torch reads at import)

torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
