"""Faults that end a job instead of hanging it, and leave nothing behind.

- ``hsgd.faults.abort``: an uncaught exception on any rank prints its
  traceback once, tagged with the rank, and aborts the whole job
  (``MPI_Abort``), in the manner of ``python -m mpi4py``;
- ``hsgd.faults.stall``: the :class:`StallInspector` names the ranks
  missing from a synchronization that waits too long, and ends a job that
  waits for good; both write why the job ended as one JSON record where
  :func:`record_faults_to` says;
- :mod:`hsgd._core.leftovers`: the files MPI leaves in ``/dev/shm`` and
  the temporary directory when a job ends abnormally are unlinked while the
  job runs, as soon as every rank has attached them.

:func:`protect` installs both; every synchronization mode calls it when it
is built. ``HSGD_ABORT_ON_EXCEPTION=0`` and ``HSGD_UNLINK_MPI_FILES=0`` turn
them off.
"""

from .._core.leftovers import unlink_mpi_files
from .abort import abort_job, abort_on_exception, install_abort_hook, record_faults_to
from .stall import StallInspector, StallSettings

__all__ = ["protect", "abort_job", "abort_on_exception", "install_abort_hook", "unlink_mpi_files", "StallInspector",
           "StallSettings", "record_faults_to"]


def protect(comm) -> None:
    """Install the abort hook and unlink this job's MPI files. Collective over ``comm``
    the first time only (a split and a barrier)."""
    install_abort_hook()
    unlink_mpi_files(comm)
