"""Fault injection: every fault hsgd handles, what happened, and how long the job took to end.

One command (the table in docs/reliability.md)::

    python -m hsgd.bench faults                       # 3 ranks; about 3 minutes
    python -m hsgd.bench faults --ranks 4
    python -m hsgd.bench faults --rows raise kill-rank   # some rows only

Each row starts one job (``mpiexec -n RANKS``), injects one fault and
records the exit status, what the job printed about it, the seconds from
the fault to the end of the job (from the start of the job where the fault
is in the program itself) and the files the job left in ``/dev/shm`` and
the temporary directories. The user-loop jobs are a plain training loop
with ``HierarchicalSGD`` (the ``LOOP`` program below); the trainer jobs are
``python -m hsgd.train`` on a small MNIST-1D. Every row is also a test in
``tests/`` (named in the last column), run by CI with a timeout. A job
still running after 300 s is killed and its row says HUNG.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._harness import Progress, Result, Table, int_at_least
from ._launch import kill_tree, mpi_command, mpi_env, mpi_flavour

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
COLUMNS = ("fault", "injected", "exit", "what the job said", "s to end", "left behind", "test")
JOB_TIMEOUT_S = 300


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(2, " (the faults hit rank 1)"), default=3,
                   help="ranks of every job (3)")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="which faults (all)")


def run(args, extra) -> Result:
    jobs = Jobs(args.ranks)
    raw = []
    with tempfile.TemporaryDirectory() as tmp, \
            Progress(len(args.rows), "hsgd.bench faults", args.progress) as progress:
        for key in args.rows:
            fault, injected, test, (code, err, seconds, left) = ROWS[key](jobs, Path(tmp))
            raw.append({"row": key, "fault": fault, "injected": injected, "exit": code, "said": _said(err),
                        "seconds": seconds, "left": left, "test": test})
            progress.step(key)
    flavour = "Open MPI" if mpi_flavour() == "openmpi" else "MPICH"
    table = Table(COLUMNS, title=f"{args.ranks} ranks, {flavour}")
    for r in raw:
        table.rows.append([r["fault"], r["injected"], str(r["exit"]), r["said"], f"{r['seconds']:.1f}",
                           ", ".join(r["left"]) or "nothing", r["test"]])
    return Result([table], raw)


class Jobs:
    """Starts the jobs of the rows on ``ranks`` ranks and times them."""

    def __init__(self, ranks: int):
        self.ranks = ranks

    def run(self, argv, env=None, kill=None):
        """Start a job, inject ``kill`` once every rank printed ``ready``; returns
        (exit, stderr, seconds from the fault, or from the start, to the end, left files)."""
        before = _snapshot()
        start = time.monotonic()
        proc = self._start(argv, env)
        if kill:
            pids = {}
            while len(pids) < self.ranks:
                line = proc.stdout.readline()
                if not line:
                    break
                pids.update({int(r): int(p) for r, p in re.findall(r"ready (\d+) (\d+)", line)})
            time.sleep(1.0)
            start = time.monotonic()
            if kill == "rank":
                os.kill(pids[1], signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGTERM)
        return self._finish(proc, start, before)

    def signal_trainer(self, argv):
        """Start the trainer, send SIGUSR1 to mpiexec once it logged its first step record."""
        before = _snapshot()
        proc = self._start(argv)
        metrics = Path(argv[argv.index("--run-dir") + 1]) / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and '"step"' in metrics.read_text()):
            time.sleep(0.2)
        start = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
        return self._finish(proc, start, before)

    def _start(self, argv, env=None):
        return subprocess.Popen(mpi_command(self.ranks, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=mpi_env(env), start_new_session=True)

    def _finish(self, proc, start, before):
        try:
            _, err = proc.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            _, err = proc.communicate()
            err += f"\n(HUNG: killed after {JOB_TIMEOUT_S} s)"
        seconds = time.monotonic() - start
        time.sleep(1.0)  # killed ranks finish dying
        return proc.returncode, err, seconds, _new_files(before)


def _loop(fault, injected, loop_args, test, kill=None, env=None):
    def row(jobs, tmp):
        return fault, injected, test, jobs.run(["-c", LOOP, *loop_args], env=env, kill=kill)
    return row


def _train(tmp: Path):
    return ["-m", "hsgd.train", "--cache-dir", str(tmp / "cache"), *SMALL]


def _sigusr1(jobs, tmp):
    # SIGUSR1 needs the trainer to be training: wait for its first step record, not "ready".
    result = jobs.signal_trainer([*_train(tmp), "--epochs", "50", "--run-dir", str(tmp / "signal")])
    return ("SIGUSR1 to the trainer (Slurm's warning)", "SIGUSR1 to mpiexec during epoch 0",
            "test_train.py::test_signal_checkpoints_and_exits_for_requeue", result)


def _damaged_checkpoint(jobs, tmp):
    common = [*_train(tmp), "--run-dir", str(tmp / "damaged"), "--save-every", "10"]
    code, err, _, _ = jobs.run([*common, "--stop-after", "20"])
    if code != 0:
        sys.exit(f"hsgd.bench faults: the run to damage a checkpoint of failed:\n{err[-3000:]}")
    newest = sorted((tmp / "damaged" / "checkpoints").glob("ckpt-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    return ("newest checkpoint truncated", f"{newest.name} cut to 1000 bytes, then --resume",
            "test_train.py::test_resume_skips_a_damaged_newest_checkpoint_*",
            jobs.run([*common, "--resume", "--stop-after", "5"]))


def _nonfinite(jobs, tmp):
    result = jobs.run([*_train(tmp), "--optimizer", "sgd", "--lr", "1e20", "--nonfinite-limit", "3",
                       "--run-dir", str(tmp / "nan")])
    return ("NaN/Inf gradients", "--optimizer sgd --lr 1e20 --nonfinite-limit 3",
            "test_train.py::test_non_finite_gradients_skip_steps_then_stop_the_run", result)


def _uneven(jobs, tmp):
    result = jobs.run(["-m", "hsgd.train", "--cache-dir", str(tmp / "cache"), "--mnist1d-samples", "10",
                       "--batch-size", "6", "--epochs", "2", "--sync", "async", "--straggler", "1:3",
                       "--progress", "lines", "--run-dir", str(tmp / "uneven")])
    return ("uneven work", "8 samples on the ranks, 2 test samples (a rank evaluates none), "
            "--sync async --straggler 1:3",
            "test_train.py::test_uneven_data_and_an_empty_evaluation_shard_end_cleanly", result)


#: The rows, in table order: ``--rows`` name -> function(jobs, tmp) -> (fault, injected, test, job result).
ROWS = {
    "raise": _loop("exception on rank 1 (user loop)", "raise RuntimeError at step 20", ["raise", "20"],
                   "test_faults.py::test_an_exception_on_one_rank_aborts_*"),
    "kill-rank": _loop("rank 1 killed (user loop)", "SIGKILL to rank 1 in the loop", ["none", "0"],
                       "test_faults.py::test_a_killed_rank_or_launcher_*[rank]", kill="rank"),
    "kill-launcher": _loop("launcher killed (user loop)", "SIGTERM to mpiexec", ["none", "0"],
                           "test_faults.py::test_a_killed_rank_or_launcher_*[launcher]", kill="launcher"),
    "stall": _loop("rank 1 stalls 8 s (user loop)", "sleep in step 20; HSGD_STALL_TIMEOUT=2", ["sleep", "20", "8"],
                   "test_stall_mpi.py::test_a_sleeping_rank_is_named_*", env={"HSGD_STALL_TIMEOUT": "2"}),
    "stall-abort": _loop("rank 1 stalls, stall_abort (user loop)",
                         "sleep 120 s in step 20; HSGD_STALL_TIMEOUT=2 HSGD_STALL_ABORT=1", ["sleep", "20", "120"],
                         "test_faults.py::test_stall_abort_ends_the_job_*",
                         env={"HSGD_STALL_TIMEOUT": "2", "HSGD_STALL_ABORT": "1"}),
    "sigusr1": _sigusr1,
    "checkpoint": _damaged_checkpoint,
    "nonfinite": _nonfinite,
    "uneven": _uneven,
}


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
    return {p for d in ("/dev/shm", tempfile.gettempdir()) for p in _listing(d)}


def _listing(directory):
    try:
        return [os.path.join(directory, name) for name in os.listdir(directory)]
    except OSError:
        return []


def _new_files(before):
    mpi = re.compile(r"(mpich_|sm_segment|ucx_|hydra_|ompi\.|prte)")
    return sorted(p for p in _snapshot() if p not in before and mpi.search(os.path.basename(p)))
