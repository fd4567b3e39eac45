"""A one-sided read from owners on other hosts, a few short pieces at a time.

:func:`get_windowed` is :meth:`hsgd.remote.RemoteMemory.read`'s transfer from
owners it does not reach by load and store; :mod:`hsgd.remote.pacing` sizes
its pieces.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, Dict, Tuple

import numpy as np
from mpi4py import MPI

from .._core.waits import Backoff
from .pacing import Pacer

__all__ = ["get_windowed", "READ_WINDOW"]

READ_WINDOW = 2  # pieces in flight per owner in a read from another host


def get_windowed(win, mpi_type, itemsize: int, bells, pacers: Dict[int, Pacer],
                 queues: Dict[int, Deque[Tuple[np.ndarray, int]]]) -> None:
    """Read every ``(buffer, displacement)`` of ``queues[owner]`` from ``owner`` of ``win``, at most
    ``READ_WINDOW`` pieces in flight per owner, all owners at once, waiting politely.

    Why a window: over TCP a read is a request to the owner and the owner's answer, on the
    one connection each way between two processes. Everything this rank asks for at once
    is queued on the owner's side of that connection, and every later message the owner
    sends this rank (its own read requests, its accumulates, the control word's answers)
    waits behind it: with a whole model asked for at once, a rank that started reading a
    little later took nearly twice as long. The pieces are sized by their time on the link
    (:class:`~hsgd.remote.pacing.Pacer`: ``TARGET_S``, at least ``LEAST_BYTES``), so the
    queue drains in a few milliseconds on a slow link as on a fast one."""
    inflight: Dict[int, Deque[Tuple[MPI.Request, int]]] = {owner: deque() for owner in queues}
    began = time.monotonic()
    for pacer in pacers.values():
        pacer.begin(began)
    backoff = Backoff()
    while any(queues.values()) or any(inflight.values()):
        moved = False
        for owner, queue in queues.items():
            pending, pacer = inflight[owner], pacers[owner]
            while pending and pending[0][0].Test():
                pacer.arrived(pending.popleft()[1], time.monotonic())
                moved = True
            while queue and len(pending) < READ_WINDOW:
                buf, disp = queue[0]
                count = min(len(buf), max(1, pacer.next_bytes() // itemsize))
                if count == len(buf):
                    queue.popleft()
                else:
                    queue[0] = (buf[count:], disp + count)
                bells.ring(owner)
                request = win.Rget([buf[:count], mpi_type], owner, (disp, count, mpi_type))
                pending.append((request, count * itemsize))
                moved = True
        if moved:
            backoff.reset()
        else:
            backoff.idle()
