"""The signal that lets a rank in ``hvd.join()`` take part in a ``DistributedOptimizer``'s steps.

Each optimizer (``overlap=False``) has a :class:`StepToken` on its own duplicate of the set's
communicator. Before each average every rank that steps adds 0 to a one-integer allreduce on
it; a rank that joined keeps one posted, adding 1. So the steps cost one small allreduce and
no message through the name matching, and a joined rank learns of each step when its
allreduce completes: below the set's size, it averages zero gradients with the others and
posts the next; at the set's size, every member joined and no step comes. Every member posts
as many as the others (one per step it took, or followed while joined, plus one at its join).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

__all__ = ["StepToken"]


class StepToken:
    """One optimizer's step signal over ``comm`` (duplicated here; :meth:`free` frees it).
    ``joined_step``: what this rank runs, while joined, for each step of the others."""

    def __init__(self, comm, joined_step: Callable[[], None]):
        self.comm, self.joined_step = comm.Dup(), joined_step
        self.size = self.comm.Get_size()
        # the buffers live as long as the token: a non-blocking allreduce may read or write its
        # buffer until its Wait returns, and a temporary could be freed before that
        self._flag = np.zeros(1, dtype=np.int32)
        self._zero = np.zeros(1, dtype=np.int32)
        self._request: Optional[Any] = None  # the joined rank's posted allreduce

    def step(self) -> None:
        """This rank steps: tell the joined ranks (collective over the set; the ranks that
        joined take part through :meth:`progress`)."""
        # non-blocking, as the joined ranks' (MPI matches no blocking collective with a
        # non-blocking one); waited for in MPI, as the average's first fence (a node barrier)
        # would be: the ranks arrive skewed by their backward passes, and a rank napping here
        # would wake late
        self._zero[0] = 0
        self._start(self._zero).Wait()

    def join(self) -> None:
        """This rank joined: post its part of the others' next step."""
        self._flag[0] = 1
        self._request = self._start(self._flag)

    @property
    def joined(self) -> bool:
        """Whether this rank's allreduce is posted (it joined, and not every member has)."""
        return self._request is not None

    def progress(self) -> bool:
        """On a joined rank: follow a step of the others if one started. Whether one ended
        (a step followed, or every member joined)."""
        if self._request is None or not self._request.Test():
            return False
        self._request = None
        if int(self._flag[0]) < self.size:  # some rank stepped: average zeros with it, and wait again
            self.joined_step()
            self.join()
        return True

    def _start(self, flag: np.ndarray):
        from mpi4py import MPI

        return self.comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.SUM)

    def free(self) -> None:
        """Free the communicator (collective over the set)."""
        self.comm.Free()
