"""End to end: faults end the job instead of hanging it, and leave nothing behind.

A user's own training loop with ``HierarchicalSGD`` under ``mpiexec``: an
exception on one rank, a rank killed with SIGKILL, the launcher killed with
SIGTERM. Each job must end (a hang fails at the timeout) and leave nothing
in ``/dev/shm`` or the temporary directories (:func:`mpirun.remove_leftovers`).
"""

import os
import re
import signal
import subprocess
import time

import pytest
from mpirun import ROOT, kill_job, mpi_command, mpi_env, remove_leftovers, run_mpi, snapshot

LOOP = """
import os, sys, time, torch
from mpi4py import MPI
from hsgd import HierarchicalSGD
model = torch.nn.Linear(4, 2)
opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
rank, fault, at = MPI.COMM_WORLD.Get_rank(), sys.argv[1], int(sys.argv[2])
print(f"ready {rank} {os.getpid()}", flush=True)
for step in range(10**9):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    if step == at and rank == 1:
        if fault == "raise":
            raise RuntimeError("a bug on rank 1")
        time.sleep(600)  # stall
    opt.step()
    time.sleep(0.005)
"""


def test_an_exception_on_one_rank_aborts_the_job_with_one_tagged_traceback():
    proc = run_mpi(3, ["-c", LOOP, "raise", "3"], timeout=90)  # a hang fails here
    assert proc.returncode != 0
    assert proc.stderr.count("Traceback") == 1, proc.stderr
    assert "[rank 1] RuntimeError: a bug on rank 1" in proc.stderr, proc.stderr
    assert "uncaught exception on rank 1 of 3: aborting the job" in proc.stderr


def test_stall_abort_ends_the_job_naming_the_stalled_rank():
    proc = run_mpi(3, ["-c", LOOP, "sleep", "5"], env={"HSGD_STALL_TIMEOUT": "2", "HSGD_STALL_ABORT": "1"},
                   timeout=120)  # rank 1 sleeps 600 s: only the abort ends the job in time
    assert proc.returncode != 0
    reports = [line for line in proc.stderr.splitlines() if "hsgd stall: waiting" in line]
    assert reports and all(line.endswith("missing: rank 1 (last at step 4)") for line in reports), proc.stderr
    assert "aborting the job" in proc.stderr


def test_the_abort_hook_can_be_turned_off():
    code = ("import os, sys, torch, hsgd.faults.abort as a\n"
            "os.environ[a.ENV] = '0'\n"
            "before = sys.excepthook\n"
            "assert not a.install_abort_hook() and sys.excepthook is before\n"
            "os.environ[a.ENV] = '1'\n"
            "assert a.install_abort_hook() and sys.excepthook is not before\n"
            "a.abort_on_exception(False)\n"
            "raise SystemExit(7)\n")
    proc = run_mpi(1, ["-c", code], timeout=60)
    assert proc.returncode == 7, proc.stderr


def _start(tmp_path):
    tmpdir = str(tmp_path / "tmp")
    os.mkdir(tmpdir)
    before = snapshot()
    proc = subprocess.Popen(mpi_command(3, ["-c", LOOP, "none", "-1"]), cwd=ROOT, env=mpi_env(tmpdir=tmpdir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    pids, deadline = {}, time.monotonic() + 90
    try:
        while len(pids) < 3:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, f"the job never started:\n{proc.stderr.read()}"
            for rank, pid in re.findall(r"ready (\d+) (\d+)", line):  # ranks' lines may interleave
                pids[int(rank)] = int(pid)
    except BaseException:
        _end(proc, pids)
        raise
    time.sleep(0.5)  # in the training loop
    return proc, pids, before, tmpdir


def _dead(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _end(proc, pids):
    """Kill whatever is left of the job: the launcher's tree, and ranks it may have orphaned."""
    kill_job(proc)
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("victim", ["rank", "launcher"])
def test_a_killed_rank_or_launcher_ends_the_job_and_leaves_nothing(tmp_path, victim):
    proc, pids, before, tmpdir = _start(tmp_path)
    try:
        if victim == "rank":
            os.kill(pids[1], signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)  # a hang fails here
        deadline = time.monotonic() + 10  # the launcher is gone; its ranks follow within moments
        while not (gone := all(_dead(pid) for pid in pids.values())) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        _end(proc, pids)
    assert gone, f"ranks still running 10 s after the job ended: {pids}"
    assert proc.returncode != 0
    left = remove_leftovers(before, tmpdir)
    assert not left, f"a job ended by SIGKILL/SIGTERM ({victim}) left files behind: {left}"
