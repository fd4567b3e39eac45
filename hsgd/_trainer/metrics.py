"""Where the time goes: per-phase clocks, JSON-lines metrics and a Chrome trace.

:class:`PhaseClock` accumulates the seconds a rank spends in each phase of a step
(``data``, ``compute``, ``intra``, ``inter``, ``eval``) and, when asked, records every
phase as a Chrome-trace "complete" event, so that ``--timeline FILE`` shows all ranks'
phases on one time axis in Perfetto or ``chrome://tracing``, as Horovod's timeline
does. :class:`MetricsLog` appends JSON records to ``RUN_DIR/metrics.jsonl`` (format:
:func:`hsgd.report.load_run`). Example::

    >>> clock = PhaseClock(rank=0, trace=True)
    >>> with clock.phase("compute"):
    ...     loss.backward()
    >>> clock.take()
    {'compute': 0.012}
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..errors import InputValueError

__all__ = ["PhaseClock", "MetricsLog", "write_timeline", "process_age"]


class PhaseClock:
    """Seconds per phase since the last :meth:`take`, plus optional trace events."""

    def __init__(self, rank: int, trace: bool = False):
        self.rank = rank
        self.events: Optional[List[dict]] = [] if trace else None
        self._totals: Dict[str, float] = defaultdict(float)
        # Trace timestamps: wall-clock origin plus a monotonic offset, in microseconds.
        self._wall0, self._perf0 = time.time(), time.perf_counter()

    def record(self, name: str, start: float, end: float, seconds: Optional[float] = None) -> None:
        """Count ``end - start`` (``perf_counter`` seconds) towards phase ``name``.

        ``seconds`` overrides the amount counted (the trace event still spans
        ``start`` to ``end``), for a phase that contains other recorded phases.
        """
        self._totals[name] += (end - start) if seconds is None else seconds
        if self.events is not None:
            ts = (self._wall0 + (start - self._perf0)) * 1e6
            self.events.append({"name": name, "ph": "X", "ts": round(ts, 1),
                                "dur": round((end - start) * 1e6, 1), "pid": 0, "tid": self.rank})

    @contextlib.contextmanager
    def phase(self, name: str, excluding: Sequence[str] = ()):
        """Time the block as phase ``name``, less the phases ``excluding`` recorded inside it."""
        start, inner = time.perf_counter(), self.total(*excluding)
        try:
            yield
        finally:
            end = time.perf_counter()
            self.record(name, start, end, seconds=(end - start) - (self.total(*excluding) - inner))

    def total(self, *names: str) -> float:
        """Seconds counted so far (since the last :meth:`take`) in ``names``."""
        return sum(self._totals.get(name, 0.0) for name in names)

    def take(self) -> Dict[str, float]:
        """The totals since the previous call, then reset."""
        totals, self._totals = dict(self._totals), defaultdict(float)
        return totals


def process_age() -> Optional[float]:
    """Seconds since this process started (``/proc``: Linux), ``None`` where unknown: a job's
    start-up, the interpreter and the imports included."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"), 3)  # field 22: start, in ticks since boot


def write_timeline(path, events_per_rank: List[List[dict]]) -> Path:
    """Write one Chrome-trace JSON with a named track per rank."""
    path = Path(path)
    trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
              "args": {"name": f"rank {rank}"}} for rank in range(len(events_per_rank))]
    trace.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "hsgd"}})
    for events in events_per_rank:
        trace.extend(events)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    tmp.replace(path)
    return path


def open_tensorboard(run_dir):
    """A ``SummaryWriter`` on ``run_dir/tensorboard``; an InputError if tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise InputValueError("--tensorboard needs the tensorboard package: pip install tensorboard "
                              "(or hsgd[tensorboard]), or leave out --tensorboard") from None
    return SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))


def _scalars(prefix: str, fields: dict):
    """``(tag, number)`` for every numeric field, nested dicts (``time``) flattened."""
    for key, value in fields.items():
        if isinstance(value, dict):
            yield from _scalars(f"{prefix}{key}/", value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield prefix + key, value


class MetricsLog:
    """Appends one JSON object per line to ``run_dir/metrics.jsonl`` (rank 0 only).

    With ``tensorboard=True`` every record also goes to TensorBoard event files
    in ``run_dir/tensorboard``: step records as ``step/<key>`` at their step,
    epoch records as ``epoch/<key>`` at their epoch.
    """

    def __init__(self, run_dir, enabled: bool = True, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self._board = open_tensorboard(run_dir) if enabled and tensorboard else None
        if enabled:
            torn = False
            if self.path.exists() and self.path.stat().st_size:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"  # a killed run left half a line
            self._file = open(self.path, "a", buffering=1)
            if torn:
                self._file.write("\n")

    def write(self, event: str, **fields) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, **fields}) + "\n")
        if self._board is not None:
            at = fields.get(event, fields.get("step", 0))  # an epoch record at its epoch
            for tag, value in _scalars(f"{event}/", fields):
                self._board.add_scalar(tag, value, global_step=at)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            self._board.close()
            self._board = None
