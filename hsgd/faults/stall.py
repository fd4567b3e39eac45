"""Stall inspector: when ranks wait too long in a synchronization, name the ones missing,
and end a job that waits for good.

In the manner of Horovod's stall inspector and torch's ``monitored_barrier``: before it
enters a synchronization, every rank publishes how many it has entered and at which
step in its own slot of a :class:`~hsgd.remote.RemoteMemory` board; a watchdog thread
reads every slot one-sidedly once its rank has waited ``timeout`` seconds, names on
stderr the ranks that entered fewer synchronizations than this one, and after
``abort_after`` seconds (or the first report, with ``abort``; or, with ``abort_pace`` K, a wait
K times its rank's slowest recent step) aborts the job (``MPI_Abort``), so a lost host or a
partitioned network ends the job instead of holding its allocation forever. docs/faults.md;
the report looks like::

    [rank 0] hsgd stall: waiting 60 s in synchronization #118 (step 117, step()); missing: rank 2 (last at step 103)

``timeout`` 0 disables it, the abort included. The ranks must agree on the settings (not on
the pace each measures: the first rank past its limit ends the job).
"""

from __future__ import annotations

import collections
import functools
import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Tuple, Union

import torch

from .._core.agree import collective_error
from ..errors import InputValueError
from .abort import flush_to_launcher, write_fault_record

if TYPE_CHECKING:
    import numpy as np

    from ..remote.memory import RemoteMemory

__all__ = ["StallInspector", "StallSettings", "Stall", "WatchedComm", "DEFAULT_TIMEOUT_S", "DEFAULT_ABORT_AFTER_S",
           "TIMEOUT_ENV", "ABORT_ENV", "ABORT_AFTER_ENV", "ABORT_PACE_ENV", "PACE_FLOOR_S", "EXIT_GRACE_S", "Pace"]

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_ABORT_AFTER_S = 600.0
TIMEOUT_ENV, ABORT_ENV, ABORT_AFTER_ENV = "HSGD_STALL_TIMEOUT", "HSGD_STALL_ABORT", "HSGD_STALL_ABORT_AFTER"
ABORT_PACE_ENV = "HSGD_STALL_ABORT_PACE"
PACE_FLOOR_S = 3.0     # the shortest wait an abort_pace ends: a first rare wait (a checkpoint's gather) passes
EXIT_GRACE_S = 20.0   # after MPI_Abort, if the process is still alive
_READ_TIMEOUT_S = 5.0  # how long a report waits for the other ranks' slots
_ABORT_READ_S = 1.0    # ... and the one that names them when the job is ended: an abort is not put off
_PACE_WINDOW, _PACE_WARMUP = 64, 8  # steps a pace is measured over; steps measured before it applies
_BOARD_IDLE_S = 0.05   # the progress threads' poll for the board, while no doorbell comes in
_STEP_BITS = 32        # a board word: (synchronizations entered << 32) | step


def _seconds(value, env: str, default: float) -> float:
    if value is None:
        raw = os.environ.get(env, "").strip()
        try:
            value = float(raw) if raw else default
        except ValueError:
            value = float("nan")
    return value


def _settings(timeout, abort, abort_after, abort_pace) -> Tuple[float, bool, float, float]:
    timeout = _seconds(timeout, TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
    abort_after = _seconds(abort_after, ABORT_AFTER_ENV, DEFAULT_ABORT_AFTER_S)
    abort_pace = _seconds(abort_pace, ABORT_PACE_ENV, 0.0)
    if abort is None:
        abort = os.environ.get(ABORT_ENV, "0").strip().lower() in ("1", "true", "yes", "on")
    return timeout, bool(abort), abort_after, abort_pace


def _valid(seconds) -> bool:
    return isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds < float("inf")


@dataclass(frozen=True)
class StallSettings:
    """What a mode's own stall inspector is built with (a mode's ``stall=`` argument); ``None``
    takes the environment's value. The ranks must agree on all three.

    Args:
        timeout: seconds of waiting before a report (``None``: ``HSGD_STALL_TIMEOUT`` or 60;
            0 disables the inspector, the abort included).
        abort: abort the job after the first report (``None``: ``HSGD_STALL_ABORT``).
        abort_after: abort the job after a wait this long (``None``: ``HSGD_STALL_ABORT_AFTER``
            or 600; 0: never).
        abort_pace: abort the job after a wait this many times the rank's slowest recent step
            (``Pace``; ``None``: ``HSGD_STALL_ABORT_PACE`` or 0: never).
    """

    timeout: Optional[float] = None
    abort: Optional[bool] = None
    abort_after: Optional[float] = None
    abort_pace: Optional[float] = None


#: A mode's ``stall=`` argument: ``None`` (its own inspector, settings from the environment),
#: :class:`StallSettings` (its own, with these settings) or a caller's open :class:`StallInspector`.
Stall = Union[None, StallSettings, "StallInspector"]


class Pace:
    """The longest wait a rank lets pass under ``abort_pace``: ``factor`` times the longest of
    its last 64 steps (the times between its synchronizations, each with its wait), at least
    ``floor`` seconds; no limit (``inf``) before 8 steps were measured or with ``factor`` 0.
    A wait that outlasts many of the rank's own recent steps is not a slow peer but a lost one.
    Only the rank's thread calls :meth:`entered`; :attr:`limit` is read by its watchdog."""

    def __init__(self, factor: float, floor: float = PACE_FLOOR_S):
        self.factor, self.floor = factor, floor
        self._steps: collections.deque = collections.deque(maxlen=_PACE_WINDOW)
        self._last: Optional[float] = None
        self.limit = math.inf

    def entered(self, now: float) -> float:
        """A synchronization entered at ``now`` (monotonic seconds); returns the new limit."""
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now
        if self.factor > 0 and len(self._steps) >= _PACE_WARMUP:
            self.limit = max(self.floor, self.factor * max(self._steps))
        return self.limit


class StallInspector:
    """The stall inspector of one synchronization mode (collective to build and to close).

    Args:
        comm: the ranks that synchronize.
        timeout: seconds of waiting before a report (``None``: ``HSGD_STALL_TIMEOUT`` or 60;
            0 disables the inspector).
        abort: abort the job after the first report (``None``: ``HSGD_STALL_ABORT``).
        abort_after: abort the job after a wait this long (``None``: ``HSGD_STALL_ABORT_AFTER``
            or 600; 0: never).
        abort_pace: abort the job after a wait ``abort_pace`` times this rank's slowest recent
            step, at least ``PACE_FLOOR_S`` (``Pace``; ``None``: ``HSGD_STALL_ABORT_PACE`` or
            0: never). ``python -m hsgd.run`` sets it for its jobs.

    The watchdog wakes every ``timeout / 4`` seconds (at most every second) and reports
    again every ``timeout`` seconds while a wait lasts. The ranks need not answer its
    reads: where the network needs the owner's MPI to move the bytes, the owner's progress
    thread does (``hsgd.remote.progress_thread``), and a rank that does not answer within a few
    seconds (its host dead or cut off) is named as such. In the lockstep modes every rank
    enters the same synchronizations, so a rank that arrived is never named; in the modes
    whose ranks do not step together (the box, gossip) the ranks named are those behind
    this one. If every rank has entered, the wait is most likely ending at that instant:
    the report (``missing: none (all arrived)``) comes only if it outlasts one more period.
    If ``MPI_Abort`` cannot reach the launcher, the process exits after ``EXIT_GRACE_S``.
    """

    def __init__(self, comm, timeout: Optional[float] = None, abort: Optional[bool] = None,
                 abort_after: Optional[float] = None, abort_pace: Optional[float] = None):
        timeout, abort, abort_after, abort_pace = _settings(timeout, abort, abort_after, abort_pace)
        every = comm.allgather((timeout, abort, abort_after, abort_pace))
        if any(not (_valid(t) and _valid(a) and _valid(p)) for t, _, a, p in every):
            raise collective_error(InputValueError, f"Invalid stall timeout {timeout!r}, abort-after "
                                   f"{abort_after!r} or abort-pace {abort_pace!r} (StallSettings timeout, "
                                   f"abort_after, abort_pace or {TIMEOUT_ENV}, {ABORT_AFTER_ENV}, {ABORT_PACE_ENV}); "
                                   "use numbers >= 0 (0 disables)")
        if len(set(map(repr, every))) > 1:
            raise collective_error(InputValueError, "ranks were given different stall settings "
                                   f"({every}); set {TIMEOUT_ENV}/{ABORT_ENV}/{ABORT_AFTER_ENV}/{ABORT_PACE_ENV} "
                                   "alike on every rank")
        from mpi4py import MPI

        self.timeout, self.abort, self.abort_after = float(timeout), abort, float(abort_after)
        self.pace = Pace(float(abort_pace))
        self._limit = self.abort_after if self.abort_after > 0 else math.inf  # the wait that ends the job
        self.comm, self.rank = comm, comm.Get_rank()
        self._threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE  # may the watchdog call MPI?
        self.entered, self._step, self._what = 0, 0, ""
        self._named: Tuple[List[int], List[int]] = ([], [])  # the last report's missing and silent ranks
        self._since: Optional[float] = None
        self.board: Optional[RemoteMemory] = None
        self._slot: Optional[np.ndarray] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.closed = False
        if self.timeout > 0:
            from ..remote.memory import RemoteMemory

            # Each rank's own element: publishing is a store into its own memory, no MPI call, on
            # any network. (A put and a flush into a board on rank 0 cost a round trip per step,
            # and over TCP a wait for rank 0 to enter MPI, which deadlocked with ranks that spin
            # on shared memory.) Read only by reports: the owners' progress threads may poll slowly.
            self.board = RemoteMemory(comm, comm.Get_size(), dtype=torch.int64, owners=range(comm.Get_size()),
                                      progress_idle=_BOARD_IDLE_S)
            self._slot = self.board.direct_view(self.rank)  # this rank's own memory
            self._thread = threading.Thread(target=self._watch, name="hsgd-stall-inspector", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.board is not None

    @contextmanager
    def waiting(self, step: int, what: str = "step()", count: bool = True) -> Iterator[None]:
        """Around a synchronization that waits for other ranks. Re-entrant: an inner one
        (``synchronize()`` inside ``step()``) counts as part of the outer. ``count=False``: a
        wait that not every rank enters at the same point (an allreduce inside a backward hook, whose turn
        depends on timing) is reported and ends the job after ``abort_after`` like the others,
        but is not published as a synchronization of its own: the missing ranks are named
        against the last one counted."""
        if self.board is None or self._since is not None:
            yield
            return
        self._step, self._what = int(step), what
        now = time.monotonic()
        if count:
            self._limit = min(self.abort_after or math.inf, self.pace.entered(now))
            self.entered += 1
            assert self._slot is not None  # the board's own shard, mapped while there is a board
            self._slot[0] = (self.entered << _STEP_BITS) | (self._step & ((1 << _STEP_BITS) - 1))
        self._since = now
        try:
            yield
        finally:
            self._since = None

    def watched(self, comm, step: Callable[[], int]) -> WatchedComm:
        """``comm`` whose collectives (``Allreduce``, ``bcast``, ``gather``, ...) each run as a
        wait of this inspector, at step ``step()``: for a caller's own collectives between
        the mode's (the trainer's metrics, evaluation, checkpoints, stop agreement)."""
        return WatchedComm(comm, self, step)

    def _watch(self) -> None:
        reported: Tuple[Optional[float], int] = (None, 0)  # (the wait's start, reports made during it)
        arrived: Optional[float] = None  # the wait in which every rank was first seen arrived
        # A quarter of the shortest of the timeout and the limit, so that an abort is at most that late
        while not self._stop.wait(min(1.0, self.timeout / 4, self._limit / 4)):
            since, limit = self._since, self._limit
            if since is None:
                continue
            waited = time.monotonic() - since
            count = reported[1] if reported[0] == since else 0
            ending = waited >= limit
            if waited < self.timeout * (count + 1) and not ending:
                continue
            names = self._missing(_ABORT_READ_S if ending else _READ_TIMEOUT_S)
            if ending and names is None and limit < (self.abort_after or math.inf):
                # Every rank is in: a slow transfer, not a lost rank; only abort_after ends that
                ending = False
                if waited < self.timeout * (count + 1):
                    continue
            if names is None and arrived != since and not ending:
                # Every rank has entered: the wait is most likely ending right now. Report
                # "all arrived" (a hung network, not a missing rank) only if it outlasts a period.
                arrived = since
                continue
            if self._since != since:
                continue
            reported = (since, count + 1)
            self._report(waited, names or "none (all arrived)")
            if self.abort or ending:
                if self.abort:
                    why = f"{ABORT_ENV}/stall_abort"
                elif limit == self.abort_after:
                    why = f"waited {waited:.0f} s, longer than stall_abort_after / {ABORT_AFTER_ENV} = " \
                          f"{self.abort_after:g} s"
                else:
                    why = f"waited {waited:.1f} s, longer than {limit:.1f} s: stall_abort_pace / {ABORT_PACE_ENV} " \
                          f"= {self.pace.factor:g} x this rank's slowest recent step, at least {self.pace.floor:g} s"
                self._abort(why, waited)

    def _abort(self, why: str, waited: float) -> None:
        from mpi4py import MPI

        sys.stderr.write(f"[rank {self.rank}] hsgd stall: aborting the job ({why})\n")
        missing, silent = self._named
        write_fault_record("stall", step=self._step, waited_s=round(waited, 1), missing=missing, silent=silent)
        flush_to_launcher()
        # MPI_Abort may wait for a launcher that waits for a lost host: leave anyway.
        threading.Timer(EXIT_GRACE_S, os._exit, (1,)).start()
        MPI.COMM_WORLD.Abort(1)

    def _missing(self, within: float) -> Optional[str]:
        """The ranks that have not entered this rank's synchronization, named with their
        last step (a rank that does not answer in ``within`` seconds: as such); ``None`` if
        every rank has entered."""
        if not self._threads:
            return "unknown (MPI was initialized without MPI_THREAD_MULTIPLE)"
        board = torch.full((self.comm.Get_size(),), -1, dtype=torch.int64)
        assert self.board is not None  # the watchdog runs only while there is a board
        silent = set(self.board.read_within(0, board, within))
        words = board.tolist()
        entered = [w >> _STEP_BITS for w in words]
        steps = [w & ((1 << _STEP_BITS) - 1) for w in words]
        missing = [r for r, n in enumerate(entered) if r in silent or n < self.entered]
        self._named = (missing, sorted(silent))
        return ", ".join(f"rank {r} (not answering for {within:g} s: its host or network may be gone)"
                         if r in silent else f"rank {r} (last at step {steps[r]})" if entered[r] else
                         f"rank {r} (no synchronization yet)" for r in missing) or None

    def _report(self, waited: float, names: str) -> None:
        sys.stderr.write(f"[rank {self.rank}] hsgd stall: waiting {waited:.0f} s in synchronization "
                         f"#{self.entered} (step {self._step}, {self._what}); missing: {names}\n")
        sys.stderr.flush()

    def close(self) -> None:
        """Stop the watchdog and free the board. Collective; idempotent."""
        self.closed = True
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.board is not None:
            self._slot = None
            self.board.close()
            self.board = None


_COLLECTIVES = frozenset(
    name for base in ("allreduce", "reduce", "bcast", "barrier", "allgather", "gather", "scatter", "alltoall",
                      "scan", "exscan", "reduce_scatter", "allgatherv", "gatherv", "scatterv", "alltoallv")
    for name in (base, base.capitalize()))


class WatchedComm:
    """An mpi4py communicator whose collectives wait under a :class:`StallInspector`
    (:meth:`hsgd.faults.StallInspector.watched`); everything else passes through. Not a ``MPI.Comm``: hand
    the plain communicator to what builds MPI objects from it (windows, splits)."""

    def __init__(self, comm, inspector: StallInspector, step: Callable[[], int]):
        self.comm, self._inspector, self._step = comm, inspector, step

    def __getattr__(self, name: str):
        attr = getattr(self.comm, name)
        if name not in _COLLECTIVES:
            return attr

        @functools.wraps(attr)
        def watched(*args, **kwargs):
            with self._inspector.waiting(self._step(), name):
                return attr(*args, **kwargs)
        return watched
