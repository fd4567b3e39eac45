"""A stand-in for Horovod's ``test/utils/common.py``: the three helpers its ``test_torch.py`` imports.

Horovod's own module imports Horovod's runner; this one needs nothing but the standard
library. ``run_suite.py`` puts it beside the fetched test file.
"""

import contextlib
import os
import tempfile

__all__ = ["mpi_env_rank_and_size", "skip_or_fail_gpu_test", "temppath"]


def mpi_env_rank_and_size():
    """``(rank, size)`` of the world from the launcher's environment (MPICH's hydra or Open MPI),
    ``(0, 1)`` outside a launcher."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    """Skip ``test`` (a ``unittest.TestCase``) with ``message``; fail it instead when
    ``HOROVOD_TEST_GPU=1`` says GPUs are required."""
    if int(os.environ.get("HOROVOD_TEST_GPU", "0")):
        test.fail(message)
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    """A path to a file that does not exist yet, in a directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="hsgd-horovod-") as folder:
        yield os.path.join(folder, "temp_test_file")
