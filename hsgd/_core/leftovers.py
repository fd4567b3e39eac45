"""Nothing left behind: unlink the files MPI would leave after an abnormal end.

MPICH keeps a shared-memory segment per node and job, ``/dev/shm/mpich_shm_*``,
under its name until ``MPI_Finalize``, and its launcher's proxy keeps
``hydra_hwloc_xmlfile_*`` in the temporary directory; a job that ends any other way
leaves both, and on a cluster node they pile up until reboot. Once every rank is
past initialisation (a barrier) the names are no longer needed, so
:func:`unlink_mpi_files` removes them then; the memory and file go with the last
process that uses them. Only this job's files are touched.

If a whole node dies, a site epilog should remove ``/dev/shm/mpich_shm_*``,
``/dev/shm/sm_segment.*`` (Open MPI) and ``$TMPDIR/hydra_hwloc_xmlfile_*`` owned by
the job's user. ``HSGD_UNLINK_MPI_FILES=0`` turns this off.
"""

from __future__ import annotations

import os
import re
from typing import List

__all__ = ["unlink_mpi_files", "job_files", "ENV"]

ENV = "HSGD_UNLINK_MPI_FILES"
_SEGMENT = re.compile(r"^/dev/shm/mpich_shm_[^/\s]*$")
_PROXY_FILE = re.compile(r"/hydra_hwloc_xmlfile_[^/\s]*$")
_done = {"unlinked": False}


def job_files() -> List[str]:
    """The named files of this job that MPI would leave behind: MPICH segments this process
    maps, and the topology file its ``hydra_pmi_proxy`` parent holds open."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.rstrip("\n").split(maxsplit=5)
                if len(parts) == 6 and _SEGMENT.match(parts[5]):  # "(deleted)" ones do not match
                    found.add(parts[5])
        parent = os.getppid()
        with open(f"/proc/{parent}/cmdline", "rb") as cmdline:
            is_proxy = os.path.basename(cmdline.read().split(b"\0")[0]) == b"hydra_pmi_proxy"
        if is_proxy:
            for fd in os.listdir(f"/proc/{parent}/fd"):
                try:
                    target = os.readlink(f"/proc/{parent}/fd/{fd}")
                except OSError:
                    continue
                if _PROXY_FILE.search(target):
                    found.add(target)
    except OSError:  # no /proc (not Linux), or the parent is gone
        pass
    return sorted(found)


def unlink_mpi_files(comm) -> List[str]:
    """Once per process: after a barrier on ``comm`` (every rank is past ``MPI_Init`` and has
    attached the segments), one rank per node unlinks ``job_files()``. Collective the first
    time; returns what this rank removed. Only for a ``comm`` as large as ``COMM_WORLD``:
    a rank outside ``comm`` might not have attached yet."""
    from mpi4py import MPI

    if _done["unlinked"] or os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off") \
            or comm.Get_size() != MPI.COMM_WORLD.Get_size():
        return []
    _done["unlinked"] = True
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    node_leader = node.Get_rank() == 0
    node.Free()
    comm.Barrier()
    removed = []
    if node_leader:
        for path in job_files():
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:  # another leader of this physical node was first, or not ours
                pass
    return removed
