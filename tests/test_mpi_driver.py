"""Layer 3: run the MPI tests in tests/mpi under mpiexec for several sizes.

Each size is one ``mpiexec -n N python -m mpi4py -m pytest tests/mpi`` in a
subprocess with a timeout: a hang fails the test instead of stalling CI, and
the ranks' output is shown on failure. ``-m mpi4py`` turns an uncaught
exception on one rank into ``MPI_Abort`` so the others cannot hang.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = int(os.environ.get("HSGD_MPI_TEST_TIMEOUT", "420"))


def mpiexec() -> str:
    """The mpiexec next to this Python (the pip ``mpich`` wheel), else PATH's."""
    local = Path(sys.executable).with_name("mpiexec")
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra "
                    "(pip install -e '.[mpich,test]') or put your MPI on PATH")
    return found


def run_mpi(nprocs: int, args, timeout: float = TIMEOUT_S, env=None):
    """Run ``python args`` on ``nprocs`` ranks; fail with the output on error."""
    cmd = [mpiexec(), "-n", str(nprocs), sys.executable, *args]
    full_env = {k: v for k, v in os.environ.items() if k != "HSGD_RANKS_PER_NODE"}
    full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})})
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"{' '.join(cmd)} hung for more than {timeout} s; output:\n{out[-8000:]}")
    return proc


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5])
def test_mpi_suite(nprocs):
    proc = run_mpi(nprocs, ["-m", "mpi4py", "-m", "pytest", "tests/mpi", "-q",
                            "-p", "no:cacheprovider", "-o", "addopts="])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"MPI test suite failed on {nprocs} ranks (exit {proc.returncode}):\n{output[-12000:]}")
    passed = [int(n) for n in re.findall(r"(\d+) passed", output)]
    assert len(passed) == nprocs and min(passed) > 0, (
        f"expected a pytest summary with passed tests from each of {nprocs} ranks:\n{output[-4000:]}")

