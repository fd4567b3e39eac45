"""Fault injection: every fault hsgd handles, what happened, and how long the job took to end.

One command (the table in docs/reliability.md)::

    python benchmarks/faults.py              # 3 ranks; about 3 minutes
    python benchmarks/faults.py --ranks 4

Each row starts one job (``mpiexec -n RANKS``), injects one fault and
records the exit status, what the job printed about it, the seconds from
the fault to the end of the job (from the start of the job where the fault
is in the program itself) and the files the job left in ``/dev/shm`` and
the temporary directories. The user-loop jobs are a plain training loop
with ``HierarchicalSGD`` (the ``LOOP`` program below); the trainer jobs are
``python -m hsgd.train`` on a small MNIST-1D. Every row is also a test in
``tests/`` (named in the last column), run by CI with a timeout.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOP = """
import os, sys, time, torch
from mpi4py import MPI
from hsgd import HierarchicalSGD
model = torch.nn.Linear(4, 2)
opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
rank, fault, at = MPI.COMM_WORLD.Get_rank(), sys.argv[1], int(sys.argv[2])
print(f"ready {rank} {os.getpid()}", flush=True)
for step in range(at + 50 if fault != "none" else 10**9):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    if step == at and rank == 1:
        if fault == "raise":
            raise RuntimeError("a bug on rank 1")
        if fault == "sleep":
            time.sleep(float(sys.argv[3]))
    opt.step()
    time.sleep(0.005)
opt.close()
"""

SMALL = ["--mnist1d-samples", "2000", "--epochs", "2", "--batch-size", "48", "--progress", "lines"]  # 48: 2, 3, 4 ranks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=3)
    args = p.parse_args(argv)
    mpiexec = Path(sys.executable).with_name("mpiexec")
    jobs = Jobs([str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.ranks)])
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            jobs.loop("exception on rank 1 (user loop)", "raise RuntimeError at step 20",
                      ["raise", "20"], test="test_faults.py::test_an_exception_on_one_rank_aborts_*"),
            jobs.loop("rank 1 killed (user loop)", "SIGKILL to rank 1 in the loop", ["none", "0"],
                      kill="rank", test="test_faults.py::test_a_killed_rank_or_launcher_*[rank]"),
            jobs.loop("launcher killed (user loop)", "SIGTERM to mpiexec", ["none", "0"],
                      kill="launcher", test="test_faults.py::test_a_killed_rank_or_launcher_*[launcher]"),
            jobs.loop("rank 1 stalls 8 s (user loop)", "sleep in step 20; HSGD_STALL_TIMEOUT=2",
                      ["sleep", "20", "8"], env={"HSGD_STALL_TIMEOUT": "2"},
                      test="test_stall_mpi.py::test_a_sleeping_rank_is_named_*"),
            jobs.loop("rank 1 stalls, stall_abort (user loop)",
                      "sleep 120 s in step 20; HSGD_STALL_TIMEOUT=2 HSGD_STALL_ABORT=1",
                      ["sleep", "20", "120"], env={"HSGD_STALL_TIMEOUT": "2", "HSGD_STALL_ABORT": "1"},
                      test="test_faults.py::test_stall_abort_ends_the_job_*"),
            *jobs.trainer_rows(Path(tmp)),
        ]
    print(f"{args.ranks} ranks, {jobs.flavour}\n")
    print("| fault | injected | exit | what the job said | s to end | left behind | test |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


class Jobs:
    def __init__(self, launcher):
        self.launcher = launcher
        version = subprocess.run([launcher[0], "--version"], capture_output=True, text=True).stdout.lower()
        self.flavour = "Open MPI" if "open mpi" in version or "openrte" in version else "MPICH"
        if self.flavour == "Open MPI":
            self.launcher = [launcher[0], "--oversubscribe", *launcher[1:]]

    def _run(self, argv, env=None, kill=None):
        """Start a job, inject ``kill`` once every rank printed ``ready``; returns
        (exit, stderr, seconds from the fault, or from the start, to the end, left files)."""
        before = _snapshot()
        full = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(env or {})}
        start = time.monotonic()
        proc = subprocess.Popen([*self.launcher, sys.executable, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=full, start_new_session=True)
        if kill:
            pids = {}
            while len(pids) < int(self.launcher[self.launcher.index("-n") + 1]):
                line = proc.stdout.readline()
                if not line:
                    break
                pids.update({int(r): int(p) for r, p in re.findall(r"ready (\d+) (\d+)", line)})
            time.sleep(1.0)
            start = time.monotonic()
            if kill == "rank":
                os.kill(pids[1], signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGTERM if kill == "launcher" else kill)
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            err += "\n(HUNG: killed after 300 s)"
        seconds = time.monotonic() - start
        time.sleep(1.0)  # killed ranks finish dying
        return proc.returncode, err, seconds, _new_files(before)

    def loop(self, name, injected, loop_args, kill=None, env=None, test=""):
        code, err, seconds, left = self._run(["-c", LOOP, *loop_args], env=env, kill=kill)
        return [name, injected, str(code), _said(err), f"{seconds:.1f}", ", ".join(left) or "nothing", test]

    def trainer_rows(self, tmp: Path):
        train = ["-m", "hsgd.train", "--cache-dir", str(tmp / "cache"), *SMALL]
        rows = []
        run = tmp / "signal"
        # SIGUSR1 needs the trainer to be training: wait for its first step record, not "ready".
        code, err, seconds, left = self._signal_trainer([*train, "--epochs", "50", "--run-dir", str(run)])
        rows.append(["SIGUSR1 to the trainer (Slurm's warning)", "SIGUSR1 to mpiexec during epoch 0",
                     str(code), _said(err), f"{seconds:.1f}", ", ".join(left) or "nothing",
                     "test_train.py::test_signal_checkpoints_and_exits_for_requeue"])
        run = tmp / "damaged"
        common = [*train, "--run-dir", str(run), "--save-every", "10"]
        code, err, _, _ = self._run([*common, "--stop-after", "20"])
        if code != 0:
            sys.exit(f"the run to damage a checkpoint of failed:\n{err[-3000:]}")
        newest = sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1]
        newest.write_bytes(newest.read_bytes()[:1000])
        code, err, seconds, left = self._run([*common, "--resume", "--stop-after", "5"])
        rows.append(["newest checkpoint truncated", f"{newest.name} cut to 1000 bytes, then --resume",
                     str(code), _said(err), f"{seconds:.1f}", ", ".join(left) or "nothing",
                     "test_train.py::test_resume_skips_a_damaged_newest_checkpoint_*"])
        code, err, seconds, left = self._run([*train, "--optimizer", "sgd", "--lr", "1e20",
                                              "--nonfinite-limit", "3", "--run-dir", str(tmp / "nan")])
        rows.append(["NaN/Inf gradients", "--optimizer sgd --lr 1e20 --nonfinite-limit 3", str(code),
                     _said(err), f"{seconds:.1f}", ", ".join(left) or "nothing",
                     "test_train.py::test_non_finite_gradients_skip_steps_then_stop_the_run"])
        code, err, seconds, left = self._run(["-m", "hsgd.train", "--cache-dir", str(tmp / "cache"),
                                              "--mnist1d-samples", "10", "--batch-size", "6", "--epochs", "2",
                                              "--sync", "async", "--straggler", "1:3", "--progress", "lines",
                                              "--run-dir", str(tmp / "uneven")])
        rows.append(["uneven work", "8 samples on the ranks, 2 test samples (a rank evaluates none), "
                     "--sync async --straggler 1:3", str(code), _said(err), f"{seconds:.1f}",
                     ", ".join(left) or "nothing",
                     "test_train.py::test_uneven_data_and_an_empty_evaluation_shard_end_cleanly"])
        return rows

    def _signal_trainer(self, argv):
        before = _snapshot()
        full = {**os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        proc = subprocess.Popen([*self.launcher, sys.executable, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=full, start_new_session=True)
        metrics = Path(argv[argv.index("--run-dir") + 1]) / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and '"step"' in metrics.read_text()):
            time.sleep(0.2)
        start = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=300)
        seconds = time.monotonic() - start
        time.sleep(1.0)
        return proc.returncode, err, seconds, _new_files(before)


def _said(err: str) -> str:
    """The job's own words about the fault: hsgd's lines, the launcher's first verdict."""
    keys = ("hsgd", "error:", "Error", "stopped", "damaged", "skipped", "resuming", "BAD TERMINATION",
            "KILLED", "Terminated", "HUNG")
    lines = [line.strip() for line in err.splitlines() if any(k in line for k in keys)]
    seen, picked = set(), []
    for line in lines:
        short = re.sub(r"\d+", "N", line)[:60]
        if short not in seen:
            seen.add(short)
            picked.append(line.replace("|", "/")[:160])
    return "<br>".join(picked[:3]) or "(nothing)"


def _snapshot():
    return {p: None for d in ("/dev/shm", tempfile.gettempdir()) for p in _listing(d)}


def _listing(directory):
    try:
        return [os.path.join(directory, name) for name in os.listdir(directory)]
    except OSError:
        return []


def _new_files(before):
    mpi = re.compile(r"(mpich_|sm_segment|ucx_|hydra_|ompi\.|prte)")
    return sorted(p for p in _snapshot() if p not in before and mpi.search(os.path.basename(p)))


if __name__ == "__main__":
    main()
