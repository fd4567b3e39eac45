"""The MPI suite (tests/mpi) on emulated hosts: 2 + 2 and 2 + 1 ranks, TCP between the hosts.

Each layout is one ``mpiexec`` over two hosts, whose ranks run ``python -m
mpi4py -m pytest tests/mpi`` as under ``tests/e2e/test_mpi_driver.py``; the
tests there take their expectations from the hosts they find (host names),
so "physical nodes" are the hosts here. The links must have carried the
suite's inter-node traffic. ``HSGD_HOSTS_LAYOUTS`` (comma-separated, default
``2+2,2+1``) picks the layouts; ``.ci/run`` runs 2 + 2 under MPICH and 2 + 1 under Open MPI.
"""

import os
import re
import sys

import pytest
from mpirun import run_command

LAYOUTS = os.environ.get("HSGD_HOSTS_LAYOUTS", "2+2,2+1").split(",")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mpi_suite_across_hosts(emulated_hosts, layout):
    ranks = [int(k) for k in layout.split("+")]
    hosts = emulated_hosts(len(ranks), "1gbit")
    before = hosts.counters()
    cmd = hosts.mpi_command([sys.executable, "-m", "mpi4py", "-m", "pytest", "tests/mpi", "-q",
                             "-p", "no:cacheprovider", "-o", "addopts="], ranks)
    proc = run_command(cmd, env=hosts.tcp_env())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"MPI suite failed on hosts {layout} (exit {proc.returncode}):\n{output[-12000:]}"
    passed = [int(n) for n in re.findall(r"(\d+) passed", output)]
    assert len(passed) == sum(ranks) and min(passed) > 0, output[-4000:]
    hosts.verify_crossed(before, 1 << 20)  # the suite's averages between hosts went over the links
