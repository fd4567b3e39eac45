"""One instrument per mode: the bytes it moves and the time of its communication phases.

The mode makes a :class:`Meter` and gives it at construction to everything below it
that moves data or runs a phase (engine, averager, both levels, transports, remote
memory); each records into it where the bytes move and the phase runs, and returns
none of it. ``opt.traffic`` reads its counts, ``opt.on_phase = fn`` sets its callback.
A phase also runs under ``torch.profiler.record_function("hsgd::<name>")``. Example::

    >>> names = []
    >>> meter = Meter(on_phase=lambda name, start, end: names.append(name))
    >>> with meter.phase("intra"):
    ...     meter.add_intra(4096)
    >>> names, meter.as_dict()
    (['intra'], {'intra_bytes': 4096, 'inter_bytes': 0})
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from torch.profiler import record_function

from .traffic import Traffic

__all__ = ["Meter", "Phase", "PhaseCallback"]

#: ``fn(name, start, end)``: a communication phase's name and its start and end times
#: (``time.perf_counter()`` seconds).
PhaseCallback = Callable[[str, float, float], None]


class Meter(Traffic):
    """This rank's byte counts (a :class:`~hsgd._core.traffic.Traffic`) and the callback that
    hears of every phase, ``on_phase`` (``None``: nobody listens)."""

    __slots__ = ("on_phase",)

    def __init__(self, on_phase: Optional[PhaseCallback] = None) -> None:
        super().__init__()
        self.on_phase = on_phase

    def report(self, name: str, start: float, end: float) -> None:
        """Phase ``name`` ran from ``start`` to ``end`` (``time.perf_counter()`` seconds), e.g.
        work that completed in the background."""
        if self.on_phase is not None:
            self.on_phase(name, start, end)

    def phase(self, name: str) -> Phase:
        """A context manager that reports the block's time as phase ``name`` (not if it raises)."""
        return Phase(self, name)


class Phase:
    """``with meter.phase(name):``; a class, not a generator, so a bucket's phase costs little."""

    __slots__ = ("meter", "name", "start", "profiled")

    def __init__(self, meter: Meter, name: str) -> None:
        self.meter, self.name = meter, name

    def __enter__(self) -> None:
        self.profiled = record_function(f"hsgd::{self.name}")
        self.profiled.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        end = time.perf_counter()
        self.profiled.__exit__(kind, value, traceback)
        if kind is None:
            self.meter.report(self.name, self.start, end)
