"""How the ranks agree to stop mid-epoch after SIGUSR1/SIGTERM, at one common step.

A checkpoint holds one step count, one data position and one schedule for all ranks,
and every collective after the stop (the last reduction, the checkpoint) must be
reached by every rank, so all ranks stop after the same step. Two ways to agree,
chosen by the mode's ``lockstep``: :class:`CollectiveStop`, for modes whose ``step()``
is collective (an allreduce of the flag every ``STOP_CHECK_STEPS`` steps), and
:class:`RemoteStop`, for modes whose ranks never wait for each other (no collective at
all). Both also stop at an epoch's end: the epoch's last reduction carries every
rank's flag (:mod:`hsgd._trainer.loop`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from mpi4py import MPI

from ..remote.memory import RemoteMemory
from .hooks import Hook

__all__ = ["STOP_CHECK_STEPS", "CollectiveStop", "RemoteStop", "stop_agreement"]

STOP_CHECK_STEPS = 10  # how often the ranks look for a received stop signal


class _Stop(Hook):
    """A stop agreement as the trainer's hook: ``"signal"`` from the step all ranks stop after.
    ``stall``: the stall inspector under which its communication is a wait (or ``None``)."""

    _stall = None

    def should_stop(self, step: int) -> bool:
        raise NotImplementedError

    def _waiting(self, step: int):
        return self._stall.waiting(step, "stop check") if self._stall is not None else contextlib.nullcontext()

    def step_end(self, step: int, run_steps: int) -> Optional[str]:
        return "signal" if self.should_stop(step) else None


class CollectiveStop(_Stop):
    """``should_stop(step)``: an allreduce of the flag every ``STOP_CHECK_STEPS`` steps. Collective."""

    def __init__(self, comm, signal, step: int, stall=None):
        self.comm, self.signal, self._stall = comm, signal, stall

    def should_stop(self, step: int) -> bool:
        if step % STOP_CHECK_STEPS:
            return False
        with self._waiting(step):
            return self.comm.allreduce(self.signal.received, op=MPI.MAX) > 0


class RemoteStop(_Stop):
    """``should_stop(step)`` without a collective: the common stop step lives in remote memory.

    Construction and :meth:`close` are collective; ``step`` is the step count
    every rank starts from; ``stall``: the stall inspector under which the lock is a wait.

    A small :class:`~hsgd.remote.memory.RemoteMemory` region on rank 0 holds the stop step
    ``S`` (0: none yet) and the step at which each rank last looked. Every
    ``STOP_CHECK_STEPS`` steps a rank takes the region's lock, reads ``S`` and, if none is
    set, records its own step (a rank that got the signal sets ``S``). A rank looks again
    at most ``STOP_CHECK_STEPS`` steps after it recorded its step, so ``S = max(recorded
    steps, own step) + STOP_CHECK_STEPS`` is a step that no rank has passed without seeing ``S``.
    """

    def __init__(self, comm, signal, step: int, topology=None, stall=None):
        self.signal, self.rank, self._stall = signal, comm.Get_rank(), stall
        self.mem = RemoteMemory(comm, 1 + comm.Get_size(), dtype=torch.int64, owners=[0], topology=topology)
        self.words = torch.zeros(1 + comm.Get_size(), dtype=torch.int64)  # [S, rank 0's step, ...]
        if self.rank == 0:
            self.words.fill_(step)[0] = 0
            self.mem.write(0, self.words)
        comm.Barrier()
        self.stop_at: Optional[int] = None

    def should_stop(self, step: int) -> bool:
        if self.stop_at is None and step % STOP_CHECK_STEPS == 0:
            with self._waiting(step), self.mem.lock():
                stop_at = int(self.mem.read(0, self.words)[0])
                if stop_at == 0 and self.signal.received:
                    stop_at = max(int(self.words[1:].max()), step) + STOP_CHECK_STEPS
                    self.mem.write(0, torch.tensor([stop_at]))
                elif stop_at == 0:
                    self.mem.write(1 + self.rank, torch.tensor([step]))
            self.stop_at = stop_at or None
        return self.stop_at is not None and step >= self.stop_at

    def close(self) -> None:
        self.mem.close()


def stop_agreement(opt, comm, signal, step: int, stall):
    """The agreement that suits ``opt``'s mode (collective), its waits watched by ``stall``
    (the trainer's stall inspector, which the mode shares)."""
    if opt.lockstep:
        return CollectiveStop(comm, signal, step, stall=stall)
    return RemoteStop(comm, signal, step, topology=opt.topology, stall=stall)
