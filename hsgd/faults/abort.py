"""Abort, not hang: an uncaught exception on one rank ends the whole job.

Without this, a rank that raises exits (or its traceback prints and it
waits in ``MPI_Finalize``) while the others wait forever in their next
collective. :func:`install_abort_hook` replaces ``sys.excepthook`` with one
that prints the traceback once, each line tagged ``[rank R]``, then calls
``MPI_Abort`` on ``COMM_WORLD``, which ends every rank (under ``mpiexec``
and under ``srun``) with a non-zero exit. Every synchronization mode
installs it when built; ``HSGD_ABORT_ON_EXCEPTION=0`` (or
``abort_on_exception(False)``) turns it off, for example to debug one rank
interactively.
"""

from __future__ import annotations

import os
import sys
import traceback

__all__ = ["abort_job", "abort_on_exception", "install_abort_hook", "ENV"]

ENV = "HSGD_ABORT_ON_EXCEPTION"
_state = {"enabled": True, "previous": None}


def abort_job(exc_type, exc, tb, code: int = 1) -> None:
    """Print the traceback tagged with this rank, then ``MPI_Abort`` the whole job."""
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    lines = "".join(traceback.format_exception(exc_type, exc, tb)).rstrip("\n").split("\n")
    text = "\n".join(f"[rank {rank}] {line}" for line in lines)
    sys.stderr.write(f"{text}\n[rank {rank}] hsgd: uncaught exception on rank {rank} of {size}: "
                     f"aborting the job (MPI_Abort)\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(code)


def _hook(exc_type, exc, tb) -> None:
    if not _state["enabled"] or issubclass(exc_type, KeyboardInterrupt) or not _mpi_running():
        (_state["previous"] or sys.__excepthook__)(exc_type, exc, tb)
        return
    abort_job(exc_type, exc, tb)


def _mpi_running() -> bool:
    from mpi4py import MPI
    return MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1


def install_abort_hook() -> bool:
    """Make an uncaught exception abort the job (once per process; ``HSGD_ABORT_ON_EXCEPTION=0``
    leaves ``sys.excepthook`` alone). Returns whether the hook is in place."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if sys.excepthook is not _hook:
        _state["previous"] = sys.excepthook
        sys.excepthook = _hook
    return True


def abort_on_exception(enabled: bool = True) -> None:
    """Turn the installed hook on or off at run time (off: exceptions behave as without hsgd)."""
    _state["enabled"] = bool(enabled)
