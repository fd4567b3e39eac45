"""The run directory's ``metrics.jsonl`` as the supervisor follows it.

The trainer's rank 0 appends its records (``start``, ``step``, ``checkpoint``, ``epoch``,
``end`` when the run ends or stops);
any rank that ends the job appends a ``fault`` record saying why (an uncaught exception,
a stall abort: :func:`hsgd.faults.record_faults_to`); the supervisor appends a ``restart``
record per restart. Every writer appends whole lines with one ``write`` to a file opened
for appending, so the lines never interleave. :class:`Journal` reads the lines added
since it last looked, whole lines only, and keeps what the supervisor decides on: the
last step a job reached and when, its faults, its ``start`` record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

__all__ = ["Journal", "JobRecords"]


class JobRecords:
    """What one job wrote: its last step record (``last``, the one before ``previous``), its
    ``start`` and ``end`` records and its ``fault`` records; ``startup_timed_out``: the
    seconds after which the supervisor killed a job that had not started (else ``None``)."""

    def __init__(self):
        self.last: Optional[dict] = None
        self.previous: Optional[dict] = None
        self.start: Optional[dict] = None
        self.end: Optional[dict] = None
        self.faults: List[dict] = []
        self.startup_timed_out: Optional[float] = None

    def take(self, record: dict) -> None:
        event = record.get("event")
        if event == "step" and isinstance(record.get("wall"), (int, float)):
            self.previous, self.last = self.last, record
        elif event == "start":
            self.start = record
        elif event == "end":
            self.end = record
        elif event == "fault":
            self.faults.append(record)

    def seconds_per_step(self) -> float:
        """The pace between the last two step records (0 if unknown)."""
        if self.last is None or self.previous is None or self.last["step"] <= self.previous["step"]:
            return 0.0
        return (self.last["wall"] - self.previous["wall"]) / (self.last["step"] - self.previous["step"])

    def cause(self) -> Optional[dict]:
        """The first fault record of an uncaught exception, else of a stall, else ``None``."""
        for cause in ("exception", "stall"):
            for fault in self.faults:
                if fault.get("cause") == cause:
                    return fault
        return None


class Journal:
    """``run_dir/metrics.jsonl`` from its current end on (records written before are not read)."""

    def __init__(self, run_dir):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self._partial = b""

    def read_new(self) -> List[dict]:
        """The records appended since the last call (a line still being written waits)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut off by a killed job
            if isinstance(record, dict):
                records.append(record)
        return records

    def append(self, record: dict) -> None:
        """Append ``record`` as one line (one ``write``, the file opened for appending), after
        a line break if a killed job left half a line."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record) + "\n"
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a killed job left half a line
                line = "\n" + line
            os.write(fd, line.encode())
        finally:
            os.close(fd)
