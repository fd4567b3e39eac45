"""Progress for one-sided operations across hosts: doorbells and a polling thread of hsgd's own.

Over a network without RMA in hardware (plain TCP: MPICH's UCX ``tcp``
transport, libfabric's ``tcp`` provider, Open MPI's ``tcp`` BTL) an operation
completes only while the *owner* is inside an MPI call, so an owner that computes
stalls every rank that reads or writes its memory, and a rank that spins on
shared memory waiting for a rank that waits on it deadlocks. MPICH's
``MPIR_CVAR_ASYNC_PROGRESS=1`` fixes that with a thread per rank spinning inside
MPI: a core per rank. Here instead origins ring a :class:`Doorbells` message of
no bytes before an operation, and one :class:`ProgressThread` per owning process
polls MPI, fast after a doorbell and slowly otherwise.

A region whose ranks all share one host has neither. The thread needs
``MPI_THREAD_MULTIPLE`` (mpi4py's default); without it a region across hosts warns
once and waits for the owner to call MPI. ``HSGD_PROGRESS=0`` turns it off.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Dict, Optional

import numpy as np
from mpi4py import MPI

__all__ = ["Doorbells", "ProgressThread", "ENV", "IDLE_S", "HOT_S", "WARM_S", "WINDOW_S", "RING_S"]

ENV = "HSGD_PROGRESS"
IDLE_S = 5e-3    # between polls with no doorbell heard lately
HOT_S = 100e-6   # the first wait after a doorbell; doubled after each quiet poll...
WARM_S = 1e-3    # ... up to this while a doorbell came in the last WINDOW_S (a transfer under way,
WINDOW_S = 50e-3  # its origin blocked in MPI cannot ring again), then up to IDLE_S
RING_S = 2e-3    # an origin rings one owner at most this often
_TAG = 31173     # the doorbells' tag, on the region's private communicator


class ProgressThread:
    """The process's polling thread: serves the doorbell communicators registered with it.

    It runs only while this rank owns memory of a region that spans hosts, and calls
    ``MPI_Iprobe`` on those communicators, which drives the MPI library's progress engine
    and receives the doorbells. Idle, it polls every ``IDLE_S``, only to hear a doorbell; a
    doorbell makes it poll every ``HOT_S``, each poll without one doubling the wait up to
    ``WARM_S`` for ``WINDOW_S`` after the doorbell (an origin blocked in a long transfer
    cannot ring again), then back to ``IDLE_S``. Bulk transfers need little: the sockets
    buffer what arrives between polls.
    """

    _instance: Optional[ProgressThread] = None
    _guard = threading.Lock()

    def __init__(self):
        self._bells: Dict[int, Doorbells] = {}
        self._lock = threading.Lock()       # held while the thread polls, and to change _bells
        self._stop = threading.Event()
        self.polls = 0
        self._thread = threading.Thread(target=self._run, name="hsgd-progress", daemon=True)
        self._thread.start()

    @classmethod
    def serve(cls, bells: Doorbells) -> None:
        with cls._guard:
            if cls._instance is None:
                cls._instance = ProgressThread()
                atexit.register(cls._shutdown)  # before mpi4py's MPI_Finalize (atexit runs last-in first)
            with cls._instance._lock:
                cls._instance._bells[id(bells)] = bells

    @classmethod
    def unserve(cls, bells: Doorbells) -> None:
        """Stop serving ``bells``; the thread ends with the last one. On return the thread no
        longer touches ``bells``' communicator."""
        with cls._guard:
            me = cls._instance
            if me is None:
                return
            with me._lock:
                me._bells.pop(id(bells), None)
                empty = not me._bells
            if empty:
                cls._instance = None
                me._stop.set()
                me._thread.join()

    @classmethod
    def running(cls) -> bool:
        return cls._instance is not None

    @classmethod
    def _shutdown(cls) -> None:
        with cls._guard:
            me, cls._instance = cls._instance, None
        if me is not None:
            me._stop.set()
            me._thread.join()

    def _run(self) -> None:
        wait, rung = IDLE_S, -WINDOW_S
        while not self._stop.wait(wait):
            with self._lock:
                rang = sum(bells.poll() for bells in self._bells.values())
                idle = min((bells.idle for bells in self._bells.values()), default=IDLE_S)
                self.polls += 1
            now = time.monotonic()
            if rang:
                wait, rung = HOT_S, now
            else:
                wait = min(2 * wait, WARM_S if now - rung < WINDOW_S else idle)


class Doorbells:
    """The doorbells of one region over ``comm`` (collective to build and to :meth:`close`).

    Args:
        comm: the region's communicator.
        serves: whether this rank holds memory of the region that others reach.
        idle: the progress thread's wait between polls while no doorbell comes in, for this
            region (the thread uses the shortest of the regions it serves).

    Every rank learns which ranks share its host (``MPI_COMM_TYPE_SHARED``); if
    all do, there is nothing to do (:attr:`active` is false). Otherwise the
    region gets a private duplicate of ``comm``, origins :meth:`ring` the owners
    on other hosts, and a serving rank registers with :class:`ProgressThread`.
    """

    def __init__(self, comm, serves: bool, idle: float = IDLE_S):
        self.idle = float(idle)
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            host_of = comm.allgather(node.bcast(comm.Get_rank(), root=0))  # a host: its lowest rank
        finally:
            node.Free()
        mine = host_of[comm.Get_rank()]
        self.remote = {r for r, h in enumerate(host_of) if h != mine}  # ranks on other hosts
        self.active = len(set(host_of)) > 1
        self.comm = comm.Dup() if self.active else None
        self._last = np.full(comm.Get_size(), -np.inf)
        self._sent = np.zeros(comm.Get_size(), dtype=np.int64)
        self._heard = np.zeros(comm.Get_size(), dtype=np.int64)
        self._ringing = threading.Lock()  # ring() runs on the caller's threads: a count lost would
        self._serving = False             # leave a doorbell unreceived when close() frees the comm
        if not self.active:
            return
        wanted = os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")
        threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if serves and wanted and threads:
            ProgressThread.serve(self)
            self._serving = True
        elif serves and wanted and not _warned["threads"]:
            _warned["threads"] = True
            sys.stderr.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] hsgd: MPI was initialized without "
                             "MPI_THREAD_MULTIPLE, so one-sided operations on this rank's memory from "
                             "other hosts wait until it calls MPI; initialize MPI with THREAD_MULTIPLE "
                             "(mpi4py's default) for hsgd's progress thread\n")

    def ring(self, owner: int) -> None:
        """Before a one-sided operation on ``owner``: wake its progress thread, if it is on
        another host and was not rung in the last ``RING_S``."""
        if owner not in self.remote:
            return
        with self._ringing:
            now = time.monotonic()
            if now - self._last[owner] < RING_S:
                return
            self._last[owner] = now
            self._sent[owner] += 1
            assert self.comm is not None  # an owner on another host: active, and not closed
            # A message of no bytes on the region's own communicator; a long transfer rings
            # again before each chunk.
            self.comm.Isend([np.empty(0, dtype=np.uint8), MPI.BYTE], owner, _TAG).Free()

    def poll(self) -> int:
        """(The progress thread.) Drive MPI's progress; receive the doorbells that arrived."""
        status, heard = MPI.Status(), 0
        comm = self.comm
        assert comm is not None  # polled only while serving: active, and not closed
        while comm.Iprobe(MPI.ANY_SOURCE, _TAG, status):
            comm.Recv([np.empty(0, dtype=np.uint8), MPI.BYTE], status.Get_source(), _TAG)
            self._heard[status.Get_source()] += 1
            heard += 1
        return heard

    def close(self) -> None:
        """Collective: stop serving, receive every doorbell still on its way, free the communicator."""
        if self.comm is None:
            return
        if self._serving:
            ProgressThread.unserve(self)
            self._serving = False
        due = np.empty_like(self._sent)
        self.comm.Alltoall(self._sent, due)  # what each rank rang this one
        buf = [np.empty(0, dtype=np.uint8), MPI.BYTE]
        for source in np.flatnonzero(due - self._heard):
            for _ in range(int(due[source] - self._heard[source])):
                self.comm.Recv(buf, int(source), _TAG)
        self.comm.Free()
        self.comm = None


_warned = {"threads": False}

