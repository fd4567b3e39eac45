"""What MPI jobs leave behind: shared-memory segments and MPICH's Hydra topology files.

A process that ends without ``MPI_Finalize`` (killed, aborted, or cleaned up
by Slurm) can leave a segment in ``/dev/shm``; MPICH's ``mpiexec`` (Hydra)
writes ``/tmp/hydra_hwloc_xmlfile_*`` at a fixed path that ignores
``TMPDIR``. Used by ``tests/mpirun.py`` (after each job) and
``tests/conftest.py`` (after each test).

A file counts as left behind when it is new since a snapshot, belongs to
this user, and no live process maps it or holds it open. Decided after the
fact, from the file system, so a job too short for any polling to see its
segments is still accounted for.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable, List, Optional, Set

__all__ = ["snapshot", "in_use", "leftovers", "remove"]

# (folder, name prefix): every file of /dev/shm, Hydra's files in /tmp
_PLACES = (("/dev/shm", ""), ("/tmp", "hydra_hwloc_xmlfile_"))
# Segment names of the MPI libraries' own transports (MPICH, Open MPI, UCX, libfabric)
MPI_SEGMENTS = ("mpich_", "sm_segment.", "vader_segment.", "ucx_", "fi_", "hydra_hwloc_xmlfile_")


def snapshot() -> Set[str]:
    """Paths of the files that count (this user's), as they are now."""
    found = set()
    uid = os.getuid()
    for folder, prefix in _PLACES:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.name.startswith(prefix) and entry.stat(follow_symlinks=False).st_uid == uid:
                    found.add(entry.path)
            except OSError:
                continue  # removed meanwhile
    return found


def in_use(paths: Iterable[str], pids: Optional[Iterable[int]] = None) -> Set[str]:
    """Those of ``paths`` that a live process (of ``pids``, if given) maps or holds open."""
    paths = set(paths)
    used: Set[str] = set()
    if not paths:
        return used
    dirs = Path("/proc").glob("[0-9]*") if pids is None else (Path(f"/proc/{pid}") for pid in pids)
    for proc in dirs:
        try:
            maps = (proc / "maps").read_text()
            used.update(path for path in paths if path in maps)
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target in paths:
                    used.add(target)
        except OSError:
            continue  # ended meanwhile, or not ours to read
    return used


def leftovers(before: Set[str], mpi_only: bool = False, grace_s: float = 0.0) -> List[str]:
    """Files new since ``before`` that no live process uses (see the module doc).

    ``mpi_only``: only names of MPI transports (:data:`MPI_SEGMENTS`), so that
    another program's files are not blamed on a job. ``grace_s``: while new
    files remain, wait up to this long for them to go or to be released (the
    ranks of an aborted job may still be dying, a launcher may still be
    removing its files); then return the ones no process uses.
    """
    deadline = time.monotonic() + grace_s
    while True:
        new = {p for p in snapshot() - before
               if not mpi_only or os.path.basename(p).startswith(MPI_SEGMENTS)}
        used = in_use(new)
        if not new or time.monotonic() >= deadline:
            return sorted(new - used)
        time.sleep(0.2)


def remove(paths: Iterable[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)
