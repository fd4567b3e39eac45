"""Abort, not hang: an uncaught exception on one rank ends the whole job.

Without this, a rank that raises exits (or its traceback prints and it
waits in ``MPI_Finalize``) while the others wait forever in their next
collective. :func:`install_abort_hook` replaces ``sys.excepthook`` with one
that prints the traceback once, each line tagged ``[rank R]``, then calls
``MPI_Abort`` on ``COMM_WORLD``, which ends every rank (under ``mpiexec``
and under ``srun``) with a non-zero exit. Every synchronization mode
installs it when built; ``HSGD_ABORT_ON_EXCEPTION=0`` (or
``abort_on_exception(False)``) turns it off, for example to debug one rank
interactively. With :func:`record_faults_to`, the abort also appends one JSON line saying
why the job ends (``{"event": "fault", "cause": "exception", ...}``), which a supervisor
reads instead of the job's free text (``python -m hsgd.run``).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time
import traceback
from typing import Any, Dict

__all__ = ["abort_job", "abort_on_exception", "install_abort_hook", "flush_to_launcher", "record_faults_to",
           "write_fault_record", "ENV"]

ENV = "HSGD_ABORT_ON_EXCEPTION"
_state: Dict[str, Any] = {"enabled": True, "previous": None, "record": None}


def record_faults_to(path) -> None:
    """Where this process appends a fault record when it ends the job (``None``: nowhere).
    The trainer names its ``metrics.jsonl`` on every rank; local."""
    _state["record"] = None if path is None else os.fspath(path)


def write_fault_record(cause: str, **fields: Any) -> None:
    """Append ``{"event": "fault", "cause": cause, "rank", "host", "wall", **fields}`` to the
    file of :func:`record_faults_to`, if any, in one ``write`` to a file opened for appending
    (several ranks may write at once); best effort: a failure to write is ignored."""
    if _state["record"] is None:
        return
    from mpi4py import MPI

    record = {"event": "fault", "cause": cause, "rank": MPI.COMM_WORLD.Get_rank(), "host": socket.gethostname(),
              "wall": round(time.time(), 3), **fields}
    try:
        fd = os.open(_state["record"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def abort_job(exc_type, exc, tb, code: int = 1) -> None:
    """Print the traceback tagged with this rank, then ``MPI_Abort`` the whole job."""
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    lines = "".join(traceback.format_exception(exc_type, exc, tb)).rstrip("\n").split("\n")
    text = "\n".join(f"[rank {rank}] {line}" for line in lines)
    sys.stderr.write(f"{text}\n[rank {rank}] hsgd: uncaught exception on rank {rank} of {size}: "
                     f"aborting the job (MPI_Abort)\n")
    write_fault_record("exception", error=f"{exc_type.__name__}: {exc}"[:500])
    flush_to_launcher()
    MPI.COMM_WORLD.Abort(code)


def flush_to_launcher(timeout: float = 2.0) -> bool:
    """Flush stdout and stderr, then wait (at most ``timeout`` seconds) until the launcher has
    read them: before ``MPI_Abort``, whose launcher kills every process and forwards nothing
    it has not read yet. Under ``mpiexec`` (hydra, PRRTE) a rank's stdout and stderr are pipes
    read by the launcher's proxy; on a loaded machine the last lines, the ones that say why the
    job ends, were lost in 3 of 8 aborts. Returns whether everything was read."""
    import fcntl
    import termios

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    pipes = []
    for fd in (1, 2):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                pipes.append(fd)
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    buf = bytearray(4)
    while pipes:
        try:
            pipes = [fd for fd in pipes if fcntl.ioctl(fd, termios.FIONREAD, buf) == 0
                     and int.from_bytes(buf, sys.byteorder) > 0]
        except OSError:
            return False
        if not pipes:
            break
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


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
