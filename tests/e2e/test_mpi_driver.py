"""Layer 3: run the MPI tests in tests/mpi under mpiexec for several sizes.

Each size is one ``mpiexec -n N python -m mpi4py -m pytest tests/mpi`` in a
subprocess with a timeout (see :mod:`mpirun`): a hang fails the test instead
of stalling CI, the ranks' output is shown on failure, and the job must leave
nothing in ``/dev/shm`` or its temporary directory. ``-m mpi4py`` turns an
uncaught exception on one rank into ``MPI_Abort`` so the others cannot hang.

``HSGD_MPI_TEST_SIZES`` (comma-separated, default ``1,2,3,4,5``) picks the
sizes; ``.ci/run`` runs 1 and 5 (and 2 again at the oldest torch).
"""

import os
import re

import pytest
from mpirun import run_mpi

SIZES = [int(n) for n in os.environ.get("HSGD_MPI_TEST_SIZES", "1,2,3,4,5").split(",")]


@pytest.mark.parametrize("nprocs", SIZES)
def test_mpi_suite(nprocs):
    proc = run_mpi(nprocs, ["-m", "mpi4py", "-m", "pytest", "tests/mpi", "-q",
                            "-p", "no:cacheprovider", "-o", "addopts="])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"MPI test suite failed on {nprocs} ranks (exit {proc.returncode}):\n{output[-12000:]}")
    passed = [int(n) for n in re.findall(r"(\d+) passed", output)]
    assert len(passed) == nprocs and min(passed) > 0, (
        f"expected a pytest summary with passed tests from each of {nprocs} ranks:\n{output[-4000:]}")
