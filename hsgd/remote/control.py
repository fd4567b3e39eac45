"""The control words of a :class:`~hsgd.remote.RemoteMemory`: its version counter and its lock.

Two int64 words in a small second RMA window on one rank (the region's
first owner), driven like the region itself: one ``Lock_all(MODE_NOCHECK)``
epoch for the window's lifetime, each operation followed by ``Flush``. The
lock is a ``Compare_and_swap`` spin with backoff and the counter a
``Fetch_and_op``, in the manner of mpi4py's ``util.sync.Mutex`` and
``Counter``, which are not used because they open a lock epoch per
operation, and MPICH grants that only when the owner enters MPI.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

__all__ = ["ControlWords"]

_VERSION, _LOCK = 0, 1  # the two int64 words
_FREE = 0
_BACKOFF_S = (20e-6, 2e-3)  # first and longest wait between tries for a held lock


def _word(value: int) -> list:
    """One int64, as an mpi4py buffer spec."""
    return [np.array([value], dtype=np.int64), MPI.INT64_T]


class ControlWords:
    """The version counter and the lock word on ``root``. Collective to build and to free.

    ``bells``: the region's :class:`~hsgd.remote.progress_thread.Doorbells`, rung before each operation.

    The caller makes the zeroed words visible to all ranks with a barrier
    after construction (``RemoteMemory`` does, once for both its windows).
    """

    def __init__(self, comm, root: int, info, bells):
        self.root, self._bells = root, bells
        self._me = comm.Get_rank() + 1  # the lock word holds the holder's rank + 1
        self._win = MPI.Win.Allocate(16 if comm.Get_rank() == root else 0, 8, info, comm)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        if comm.Get_rank() == root:
            np.frombuffer(self._win.tomemory(), dtype=np.int64)[:] = 0  # type: ignore[call-overload]  # numpy's stubs take no mpi4py buffer before Python 3.12
        self._win.Sync()
        self.held = False

    def bump_version(self) -> None:
        self._bells.ring(self.root)
        self._win.Accumulate(_word(1), self.root, (_VERSION, 1, MPI.INT64_T), MPI.SUM)
        self._win.Flush(self.root)

    def version(self) -> int:
        result = _word(0)
        self._bells.ring(self.root)
        self._win.Fetch_and_op(_word(0), result, self.root, _VERSION, MPI.NO_OP)
        self._win.Flush(self.root)
        return int(result[0][0])

    def acquire(self) -> None:
        """Take the lock, polling with backoff while another rank holds it."""
        if self.held:
            raise RuntimeError("this rank already holds the RemoteMemory lock (it is not re-entrant)")
        me, free, result = _word(self._me), _word(_FREE), _word(0)
        wait = _BACKOFF_S[0]
        while True:
            self._bells.ring(self.root)
            self._win.Compare_and_swap(me, free, result, self.root, _LOCK)
            self._win.Flush(self.root)
            if result[0][0] == _FREE:
                break
            time.sleep(wait)
            wait = min(2 * wait, _BACKOFF_S[1])
        self.held = True

    def release(self) -> None:
        me, free, result = _word(self._me), _word(_FREE), _word(0)
        self._bells.ring(self.root)
        self._win.Compare_and_swap(free, me, result, self.root, _LOCK)
        self._win.Flush(self.root)
        self.held = False
        if result[0][0] != self._me:
            raise RuntimeError(f"the RemoteMemory lock was not held by this rank (holder word {result[0][0]})")

    def free(self) -> None:
        """Collective."""
        self._win.Unlock_all()
        self._win.Free()
