"""Suite-wide settings.

One intra-op thread per test process. The tests run tiny models, where a second OpenMP
thread buys nothing, and on a machine whose other core is busy the two threads spin
against the other load: the suite went from 2.5 to 18 minutes with one competing process
on 2 cores. The environment variables reach the processes the tests start (torchrun,
spawned ranks, the demo, the dashboard's marimo server); tests that measure threading set
their own count and restore it.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the environment, which torch reads at import)

torch.set_num_threads(1)
