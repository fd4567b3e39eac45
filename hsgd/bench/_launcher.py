"""Starting MPI jobs on this machine: one launcher for MPICH and Open MPI, no job left running.

The one launcher of the tools: ``hsgd.bench`` (every job it starts), the lab beside the
package (``lab.bench``, and ``lab.hosts`` for the ``mpiexec`` and its flavour) and the
tests (``tests/mpirun.py``) start their jobs through it: :func:`mpiexec` (the one next
to this Python, else on ``PATH``), :func:`mpi_flavour`, :func:`mpi_command` (Open MPI gets ``--oversubscribe``: more
ranks than cores is the point of some runs), :func:`mpi_env`, and :func:`run_job` (or
:func:`start` then :func:`wait`).

Invariant: a job that outlives its ``timeout`` is killed whole, ranks included, and
:class:`JobHung` raised with what it wrote; on any other way out of the wait (Ctrl-C)
it is killed too. MPICH starts its ranks in sessions of their own, so only parentage
finds them (:func:`descendants`).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, cast

__all__ = ["mpiexec", "mpi_flavour", "mpi_command", "mpi_env", "root_env", "start", "wait", "run_job", "JobHung",
           "kill_tree", "descendants"]


def mpiexec() -> str:
    """The mpiexec next to this Python (a pip MPI wheel), else ``PATH``'s."""
    local = Path(sys.executable).with_name("mpiexec")
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("hsgd: mpiexec not found: install the 'mpich' extra "
                         "(pip install 'hsgd[mpich]') or put your MPI's mpiexec on PATH")
    return found


@functools.cache
def mpi_flavour(launcher: Optional[str] = None) -> str:
    """``"openmpi"`` or ``"mpich"``, from ``mpiexec --version`` (``launcher``, default :func:`mpiexec`)."""
    out = subprocess.run([launcher or mpiexec(), "--version"], capture_output=True, text=True,
                         timeout=60)
    text = (out.stdout + out.stderr).lower()
    return "openmpi" if ("open mpi" in text or "openrte" in text) else "mpich"


def mpi_command(ranks: int, args: Sequence[str]) -> List[str]:
    """``mpiexec -n RANKS python ARGS`` with the flags this MPI needs on a small machine."""
    launcher = mpiexec()
    extra = ["--oversubscribe"] if mpi_flavour(launcher) == "openmpi" else []
    return [launcher, *extra, "-n", str(ranks), sys.executable, *args]


def root_env(flavour: str) -> Dict[str, str]:
    """The variables without which Open MPI refuses to start as root; none for MPICH or another user."""
    if flavour == "openmpi" and os.geteuid() == 0:
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return {}


def mpi_env(env: Optional[Dict[str, str]] = None, drop: Sequence[str] = (),
            one_thread: bool = True) -> Dict[str, str]:
    """This environment for a job: unbuffered, Open MPI allowed as root, ``OMP_NUM_THREADS=1``
    unless not ``one_thread`` (the trainer then picks its own share of the cores);
    ``drop``: variables to leave out; ``env``: added last."""
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full["PYTHONUNBUFFERED"] = "1"
    if one_thread:
        full["OMP_NUM_THREADS"] = "1"
    full.update(root_env(mpi_flavour()))
    full.update(env or {})
    return full


class JobHung(Exception):
    """A job that ran longer than its timeout and was killed whole; ``out`` and ``err``: what it wrote."""

    def __init__(self, cmd: Sequence[str], timeout: float, out: str, err: str):
        super().__init__(f"{' '.join(cmd)} ran longer than {timeout:g} s and was killed")
        self.cmd, self.timeout, self.out, self.err = list(cmd), timeout, out, err


def start(cmd: Sequence[str], env: Dict[str, str], cwd: Optional[str] = None) -> subprocess.Popen[str]:
    """Start ``cmd`` in a session of its own, its stdout and stderr captured as text."""
    return subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=cwd, start_new_session=True)


def wait(proc: subprocess.Popen[str], timeout: Optional[float] = None) -> Tuple[str, str]:
    """``proc``'s stdout and stderr once it ends. After ``timeout`` seconds kill it and every
    process below it and raise :class:`JobHung`; on any other way out (Ctrl-C) kill them too."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        assert timeout is not None  # only a timeout expires
        raise JobHung(cast(Sequence[str], proc.args), timeout, out, err) from None  # the list start() gave
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): take the ranks down with the launcher
            kill_tree(proc.pid)


def run_job(cmd: Sequence[str], env: Dict[str, str], timeout: Optional[float] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to its end, output captured (:func:`start`, :func:`wait`); :class:`JobHung`
    if it outlives ``timeout``."""
    proc = start(cmd, env, cwd)
    out, err = wait(proc, timeout)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and its descendants (found through ``/proc`` where there is one)."""
    for pid in reversed(descendants(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def descendants(root: int) -> List[int]:
    """PIDs of ``root`` and every process below it (MPICH's ranks call setsid, so their
    session and process group are their own: only parentage finds them)."""
    children: Dict[int, List[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found
