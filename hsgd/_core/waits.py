"""Waiting for MPI requests without holding a core: test, yield, then nap.

A blocking ``MPI_Wait``/``MPI_Recv`` spins inside MPI. Where ranks share cores
with each other or with the kernel's TCP stack (more ranks than cores, data-loader
workers, emulated hosts), the spinning ranks take the cycles the transfer itself
needs (measured: docs/benchmarks-appendix.md, "The cores, for exchanges of many MB").

:func:`wait_all` tests the requests (which drives MPI's progress), yields the
core for the first ``spins`` tests, then sleeps ``nap`` seconds between tests:
a rank whose peers are late costs almost nothing, and one whose data is
arriving sees it within a test or two.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from mpi4py import MPI

__all__ = ["wait_all", "Backoff", "SPINS", "NAP_S"]

SPINS = 100     # tests with a yield in between before napping
NAP_S = 50e-6   # the nap between later tests


class Backoff:
    """What a polling loop does between tests that found nothing: yield the core for the first
    ``spins`` times, then sleep ``nap`` seconds; :meth:`reset` when something moved."""

    def __init__(self, spins: int = SPINS, nap: float = NAP_S):
        self.spins, self.nap, self.tests = spins, nap, 0

    def idle(self) -> None:
        if self.tests < self.spins:
            os.sched_yield()
        else:
            time.sleep(self.nap)
        self.tests += 1

    def reset(self) -> None:
        self.tests = 0


def wait_all(requests: Sequence[MPI.Request], spins: int = SPINS, nap: float = NAP_S) -> None:
    """Complete every request of ``requests`` (as ``MPI.Request.Waitall``), politely."""
    requests, backoff = list(requests), Backoff(spins, nap)
    while not MPI.Request.Testall(requests):
        backoff.idle()
