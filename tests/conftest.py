"""Every test leaves nothing behind in ``/dev/shm`` or (Hydra's files) ``/tmp``.

Launches through ``tests/mpirun.py`` clean up what their own job left;
this hook catches the rest, *per test*: whatever is new after a test's
teardown (module fixtures included, so Slurm jobs too) and used by no live
process is removed, and the test errors at teardown naming the files. So a
leak names its test instead of failing the whole CI run at the end (see
:mod:`leftovers`).

Not active inside the ranks of ``tests/mpi`` (they share ``/dev/shm`` with
each other while they run).
"""

import os

import pytest
from leftovers import leftovers, remove, snapshot

_UNDER_MPI = any(key in os.environ for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))
_BEFORE = pytest.StashKey[set]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if not _UNDER_MPI:
        item.stash[_BEFORE] = snapshot()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "teardown" or _BEFORE not in item.stash:
        return
    left = leftovers(item.stash[_BEFORE], grace_s=5.0)  # a launcher may still be removing its files
    if left:
        remove(left)
        report = outcome.get_result()
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} left files behind (now removed); a process ended "
                           "without cleaning up:\n" + "\n".join(left))
