"""Stall inspector: when ranks wait too long in a synchronization, name the ones missing.

In the manner of Horovod's stall inspector and torch's ``monitored_barrier``:
every rank publishes, before it enters a synchronization, how many it has
entered and at which step, into a small :class:`~hsgd.remote.RemoteMemory`
board on rank 0 (two int64 stores where rank 0's memory is mapped, on its
node; a 16-byte RMA put otherwise). A watchdog thread on each rank wakes every
``timeout / 4`` seconds (at most every second); if its rank has been waiting
in the same synchronization for ``timeout`` seconds, it reads the board (a
one-sided read: the ranks stuck in MPI need not answer) and writes to stderr::

    [rank 0] hsgd stall: waiting 60 s in synchronization #118 (step 117, step()); missing: rank 2 (last at step 103)

and again every ``timeout`` seconds while the wait lasts. The missing ranks
are exactly those that have entered fewer synchronizations than this rank;
in the lockstep modes every rank enters the same ones, so a rank that
arrived is never named. In the modes whose ranks do not step together (the
parameter box, gossip) the ranks named are those behind this one. With
``abort`` the job is aborted (``MPI_Abort``) after the first report.

When every rank has entered (the board names no one), the wait is most
likely ending at that instant: the report waits one more period and is made,
as ``missing: none (all arrived)``, only if the wait outlasts it (a hung
network or MPI progress, not a missing rank).

``timeout`` defaults to ``HSGD_STALL_TIMEOUT`` (seconds, default 60; 0
disables the inspector: no board, no thread) and ``abort`` to
``HSGD_STALL_ABORT=1``. The ranks must agree on both.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Optional

import torch

from .._engine.agree import collective_error
from ..errors import InputValueError

__all__ = ["StallInspector", "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "ABORT_ENV"]

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV, ABORT_ENV = "HSGD_STALL_TIMEOUT", "HSGD_STALL_ABORT"


def _settings(timeout: Optional[float], abort: Optional[bool]):
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            timeout = float("nan")
    if abort is None:
        abort = os.environ.get(ABORT_ENV, "0").strip().lower() in ("1", "true", "yes", "on")
    return timeout, bool(abort)


class StallInspector:
    """The stall inspector of one synchronization mode (collective to build and to close).

    Args:
        comm: the ranks that synchronize.
        timeout: seconds of waiting before a report (``None``: ``HSGD_STALL_TIMEOUT`` or 60;
            0 disables).
        abort: abort the job after the first report (``None``: ``HSGD_STALL_ABORT``).
    """

    def __init__(self, comm, timeout: Optional[float] = None, abort: Optional[bool] = None):
        timeout, abort = _settings(timeout, abort)
        every = comm.allgather((timeout, abort))
        if any(not (isinstance(t, (int, float)) and t >= 0 and t != float("inf")) for t, _ in every):
            raise collective_error(InputValueError, f"Invalid stall timeout {timeout!r} (argument stall_timeout "
                                   f"or {TIMEOUT_ENV}); use seconds >= 0 (0 disables the stall inspector)")
        if len(set(every)) > 1:
            raise collective_error(InputValueError, "ranks were given different stall timeouts or stall_abort "
                                   f"({every}); set {TIMEOUT_ENV}/{ABORT_ENV} alike on every rank")
        from mpi4py import MPI

        self.timeout, self.abort = float(timeout), abort
        self.comm, self.rank = comm, comm.Get_rank()
        self._threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE  # may the watchdog call MPI?
        self.entered, self._step, self._what, self._since = 0, 0, "", None
        self._mine = torch.zeros(2, dtype=torch.int64)
        self.board, self._slot, self._thread, self._stop = None, None, None, threading.Event()
        if self.timeout > 0:
            from ..remote.memory import RemoteMemory

            self.board = RemoteMemory(comm, 2 * comm.Get_size(), dtype=torch.int64, owners=[0])
            view = self.board.direct_view(0)
            self._slot = None if view is None else view[2 * self.rank:2 * self.rank + 2]
            self._thread = threading.Thread(target=self._watch, name="hsgd-stall-inspector", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.board is not None

    @contextmanager
    def waiting(self, step: int, what: str = "step()"):
        """Around a synchronization that waits for other ranks. Re-entrant: an inner one
        (``synchronize()`` inside ``step()``) counts as part of the outer."""
        if self.board is None or self._since is not None:
            yield
            return
        self.entered += 1
        self._step, self._what = int(step), what
        if self._slot is not None:  # rank 0's board is mapped here: two stores
            self._slot[0], self._slot[1] = self.entered, self._step
        else:
            self._mine[0], self._mine[1] = self.entered, self._step
            self.board.write(2 * self.rank, self._mine)
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        period = min(1.0, self.timeout / 4)
        reported = (None, 0)  # (the wait's start, reports made during it)
        arrived = None  # the wait in which every rank was first seen arrived
        while not self._stop.wait(period):
            since = self._since
            if since is None:
                continue
            waited = time.monotonic() - since
            count = reported[1] if reported[0] == since else 0
            if waited < self.timeout * (count + 1):
                continue
            names = self._missing()
            if names is None and arrived != since:
                # Every rank has entered: the wait is most likely ending right now. Report
                # "all arrived" (a hung network, not a missing rank) only if it outlasts a period.
                arrived = since
                continue
            if self._since != since:
                continue
            reported = (since, count + 1)
            self._report(waited, names or "none (all arrived)")
            if self.abort:
                from mpi4py import MPI

                sys.stderr.write(f"[rank {self.rank}] hsgd stall: aborting the job ({ABORT_ENV}/stall_abort)\n")
                sys.stderr.flush()
                MPI.COMM_WORLD.Abort(1)

    def _missing(self) -> Optional[str]:
        """The ranks that have not entered this rank's synchronization, named with their
        last step; ``None`` if every rank has entered."""
        if not self._threads:
            return "unknown (MPI was initialized without MPI_THREAD_MULTIPLE)"
        board = torch.empty(2 * self.comm.Get_size(), dtype=torch.int64)
        self.board.read(0, board)
        entered, steps = board[0::2].tolist(), board[1::2].tolist()
        missing = [r for r, n in enumerate(entered) if n < self.entered]
        return ", ".join(f"rank {r} (last at step {steps[r]})" if entered[r] else
                         f"rank {r} (no synchronization yet)" for r in missing) or None

    def _report(self, waited: float, names: str) -> None:
        sys.stderr.write(f"[rank {self.rank}] hsgd stall: waiting {waited:.0f} s in synchronization "
                         f"#{self.entered} (step {self._step}, {self._what}); missing: {names}\n")
        sys.stderr.flush()

    def close(self) -> None:
        """Stop the watchdog and free the board. Collective; idempotent."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.board is not None:
            self._slot = None
            self.board.close()
            self.board = None
