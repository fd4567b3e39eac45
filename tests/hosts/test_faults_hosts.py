"""Faults across hosts end the job, and leave nothing in /dev/shm or /tmp on any host.

- a host whose processes are all killed (the launcher's proxy with them): within 30 s;
- a link that goes down mid-run: the waiting ranks name the missing ones, and the job ends
  within ``stall_abort_after`` + 30 s (5 s here, through ``HSGD_STALL_ABORT_AFTER``);
- one rank killed, on the first host or on the second;
- a rank that fails right after start, before any mode is built.

Every job runs the trainer (or a small script) under ``mpiexec`` across two emulated hosts;
leftovers are checked by :func:`mpirun.remove_leftovers` (what is new in ``/dev/shm`` and
Hydra's ``/tmp`` files, used by no live process: all hosts share this machine's file system).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpirun import ROOT, kill_job, mpi_env, remove_leftovers, snapshot

from hsgd.data import ensure_mnist1d

ABORT_AFTER_S = 5


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    ensure_mnist1d(str(path), num_samples=2000)
    return str(path)


def start(hosts, args, tmp_path, env=None):
    """The trainer (or ``args`` as given, if it starts with a path) on 2 + 2 ranks; returns
    (process, run directory, leftover snapshot, private TMPDIR)."""
    run = tmp_path / "run"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    cmd = hosts.mpi_command([sys.executable, *args, "--run-dir", str(run)], 2)
    before = snapshot()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env({**hosts.tcp_env(), **(env or {})}, str(tmpdir)), start_new_session=True)
    return proc, run, before, str(tmpdir)


def train_args(cache, epochs=500):
    return ["-m", "hsgd.train", "--cache-dir", cache, "--mnist1d-samples", "2000", "--epochs", str(epochs),
            "--batch-size", "64", "--log-every", "5", "--progress", "lines"]


def wait_for_training(proc, run):
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and '"step"' in (run / "metrics.jsonl").read_text()):
        assert proc.poll() is None, f"the job ended before training: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.2)


def ends_within(proc, seconds, what):
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        _, err = proc.communicate()
        pytest.fail(f"the job did not end within {seconds} s after {what}:\n{err[-4000:]}")
    return time.monotonic() - start, err


def rank_pid(proc, rank):
    """The pid of trainer rank ``rank`` among the job's processes (MPICH's PMI_RANK)."""
    from mpirun import descendants

    for pid in descendants(proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in env and b"hsgd.train" in cmdline:
            return pid
    raise AssertionError(f"no rank {rank} among the job's processes")


def test_a_host_that_dies_ends_the_job(emulated_hosts, cache, tmp_path):
    hosts = emulated_hosts(2, "1gbit")
    proc, run, before, tmpdir = start(hosts, train_args(cache), tmp_path)
    try:
        wait_for_training(proc, run)
        hosts.kill_host(1)  # every process on it: ranks 2 and 3, the launcher's proxy
        seconds, err = ends_within(proc, 30, "host 1 died")
    finally:
        kill_job(proc)
    assert proc.returncode != 0, err[-3000:]
    assert not remove_leftovers(before, tmpdir), "a job whose host died left files behind"


def test_a_link_that_goes_down_names_the_missing_ranks_and_ends_the_job(emulated_hosts, cache, tmp_path):
    hosts = emulated_hosts(2, "1gbit")
    proc, run, before, tmpdir = start(hosts, train_args(cache), tmp_path, env={
        "HSGD_STALL_TIMEOUT": "2", "HSGD_STALL_ABORT_AFTER": str(ABORT_AFTER_S)})
    try:
        wait_for_training(proc, run)
        hosts.set_link(1, up=False)  # a partition: host 1 and its ranks 2, 3 are cut off
        seconds, err = ends_within(proc, ABORT_AFTER_S + 30, "host 1's link went down")
    finally:
        kill_job(proc)
    assert proc.returncode != 0, err[-3000:]
    reports = [line for line in err.splitlines() if "hsgd stall: waiting" in line]
    assert reports, err[-3000:]
    assert all(line.startswith(("[rank 0]", "[rank 1]")) and "missing: rank 2 (" in line and ", rank 3 (" in line
               for line in reports), reports
    assert f"longer than stall_abort_after / HSGD_STALL_ABORT_AFTER = {ABORT_AFTER_S} s" in err, err[-3000:]
    assert not remove_leftovers(before, tmpdir), "a job cut off by a partition left files behind"


@pytest.mark.parametrize("victim", [0, 3], ids=["rank 0, host 0", "rank 3, host 1"])
def test_a_killed_rank_ends_the_job_and_leaves_nothing(emulated_hosts, cache, tmp_path, victim):
    hosts = emulated_hosts(2, "1gbit")
    proc, run, before, tmpdir = start(hosts, train_args(cache), tmp_path)
    try:
        wait_for_training(proc, run)
        os.kill(rank_pid(proc, victim), signal.SIGKILL)
        _, err = ends_within(proc, 30, f"rank {victim} was killed")
    finally:
        kill_job(proc)
    assert proc.returncode != 0, err[-3000:]
    assert not remove_leftovers(before, tmpdir), f"a job whose rank {victim} was killed left files behind"


def test_a_rank_that_fails_before_any_mode_is_built_leaves_nothing(emulated_hosts, tmp_path):
    """An exception right after start (a topology, no mode yet) aborts the job across hosts;
    MPI's files were unlinked as soon as every rank had attached them."""
    hosts = emulated_hosts(2, "1gbit")
    script = tmp_path / "fail_early.py"
    script.write_text("import sys\nimport hsgd\nfrom mpi4py import MPI\n"
                      "topology = hsgd.Topology.from_comm()\n"
                      "if MPI.COMM_WORLD.Get_rank() == 3:\n    raise RuntimeError('boom on rank 3')\n"
                      "MPI.COMM_WORLD.Barrier()\n")
    proc, _, before, tmpdir = start(hosts, ["-m", "mpi4py", str(script)], tmp_path)
    try:
        _, err = ends_within(proc, 60, "rank 3 raised")
    finally:
        kill_job(proc)
    assert proc.returncode != 0 and "boom on rank 3" in err, err[-3000:]
    assert not remove_leftovers(before, tmpdir), "a job that failed early left files behind"
