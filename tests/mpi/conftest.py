"""Layer-2 tests: this folder runs under mpiexec, one pytest per rank.

Launched by ``tests/e2e/test_mpi_driver.py`` as
``mpiexec -n N python -m mpi4py -m pytest tests/mpi``. A test that fails on
one rank while the others wait in a collective would hang the job, so a
failure prints its report and aborts the whole MPI job at once; the driver's
timeout catches anything else. At the end the ranks compare which tests they
ran and how each ended (a test skipped on one rank only, or collected by one
rank only, fails the session on every rank).
"""

import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hsgd._core.leftovers import unlink_mpi_files

_outcomes = {}  # test id -> "passed" / "skipped", on this rank


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or report.skipped:
        _outcomes[item.nodeid] = report.outcome
    if report.failed:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {item.nodeid}\n{report.longreprtext}\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def pytest_sessionstart(session):
    """MPI's files unlinked once every rank attached them (hsgd._core.leftovers): a test that
    fails and aborts the job before any hsgd object was built leaves nothing either."""
    unlink_mpi_files(MPI.COMM_WORLD)


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


def _need_cuda() -> None:
    """Skip a ``cuda`` variant where there is no GPU, saying so. ``torch.cuda.is_available()``
    gives the same answer on every rank of one machine, so the ranks skip together (and the
    session's end compares the ranks' outcomes anyway)."""
    if not torch.cuda.is_available():
        pytest.skip("cuda variant: torch sees no GPU here (torch.cuda.is_available() is False)")
    torch.cuda.set_device(MPI.COMM_WORLD.Get_rank() % torch.cuda.device_count())


@pytest.fixture(params=["zero_copy", "staged", "cuda"])
def binding(request):
    """The ways gradients (or parameters) meet the shared slot: as views into it (CPU
    tensors), staged, copied in and out, on the CPU (the mode's ``zero_copy=False``), and
    staged from a GPU (``cuda``: model and batches on CUDA; skipped without a GPU). A test
    passes ``zero_copy=binding == "zero_copy"`` to the mode and puts its model and batches on
    ``on(binding)``."""
    if request.param == "cuda":
        _need_cuda()
    return request.param


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The device of a test's tensors: the CPU, and a GPU (skipped without one, saying why)."""
    if request.param == "cuda":
        _need_cuda()
    return torch.device(request.param)


@pytest.fixture(scope="module")
def shared_dir():
    """A temporary directory every rank sees (rank 0 makes it and removes it at the end)."""
    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="hsgd-mpi-") if comm.Get_rank() == 0 else None, root=0)
    yield Path(path)
    comm.Barrier()  # every rank has closed its files before rank 0 removes them
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    """Every rank must have run the same tests with the same outcomes (rank 0's, for reference)."""
    comm = MPI.COMM_WORLD
    mine = sorted(_outcomes.items())
    reference = comm.bcast(mine, root=0)
    if not comm.allreduce(mine == reference, op=MPI.LAND):
        if mine != reference:
            differ = sorted(set(mine) ^ set(reference))
            sys.stderr.write(f"\n[rank {comm.Get_rank()}] ran other tests, or with other outcomes, "
                             f"than rank 0: {differ[:20]}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
