"""Layer-2 tests: this folder runs under mpiexec, one pytest per rank.

Launched by ``tests/e2e/test_mpi_driver.py`` as
``mpiexec -n N python -m mpi4py -m pytest tests/mpi``. A test that fails on
one rank while the others wait in a collective would hang the job, so a
failure prints its report and aborts the whole MPI job at once; the driver's
timeout catches anything else.
"""

import sys

import pytest
from mpi4py import MPI


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {item.nodeid}\n{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture
def comm():
    return MPI.COMM_WORLD
