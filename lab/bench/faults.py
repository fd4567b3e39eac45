"""Fault injection: every fault hsgd handles, what happened, and how long the job took to end.

One command (the table in docs/reliability.md)::

    python -m lab.bench faults                       # 3 ranks; about 3 minutes
    python -m lab.bench faults --ranks 4
    python -m lab.bench faults --rows raise kill-rank   # some rows only
    python -m lab.bench faults --hosts 2 --ranks-per-host 2   # as root: across emulated hosts

Each row starts one job, injects one fault and records the exit status, what the job
printed about it, the seconds from the fault to the end of the job and the files the
job left behind. Every row is also a test in ``tests/`` (named in the last column); a
job still running after ``JOB_TIMEOUT_S`` seconds is killed and its row says HUNG. With
``--hosts`` two more rows are possible: a host dies, a link goes down. docs/benchmark-methods.md (``faults``).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict

from hsgd.bench import _launcher
from hsgd.bench._harness import Progress, Result, Table, int_at_least

from ._launch import add_hosts_options, check_hosts_options, job, placement

LOOP = """
import os, sys, time, torch
from mpi4py import MPI
from hsgd import HierarchicalSGD
model = torch.nn.Linear(4, 2)
opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
rank, fault, at = MPI.COMM_WORLD.Get_rank(), sys.argv[1], int(sys.argv[2])
sys.stdout.write(f"ready {rank} {os.getpid()}\\n")  # one write: lines from several hosts interleave
sys.stdout.flush()
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
                   help="ranks of every job (3; with --hosts, --ranks-per-host sets them)")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=None,
                   help=f"which faults (all; {', '.join(HOST_ROWS)} only with --hosts)")
    add_hosts_options(p)


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser)
    if args.rows is None:
        args.rows = [row for row in ROWS if args.hosts or row not in HOST_ROWS]
    if not args.hosts and set(args.rows) & set(HOST_ROWS):
        parser.error(f"argument --rows: {', '.join(sorted(set(args.rows) & set(HOST_ROWS)))} need --hosts 2 or more")
    if args.hosts and (args.hosts < 2 or sum(args.host_ranks) < 2 or args.host_ranks[-1] == 0):
        parser.error("argument --hosts: the faults need 2 hosts or more, 2 ranks or more, and ranks on the last "
                     "host (the one that dies or is cut off)")


def run(args, extra) -> Result:
    raw = []
    with tempfile.TemporaryDirectory() as tmp, placement(args) as where, \
            Progress(len(args.rows), "lab.bench faults", args.progress) as progress:
        jobs = Jobs(args.ranks, where)
        for key in args.rows:
            fault, injected, test, (code, err, seconds, left) = ROWS[key](jobs, Path(tmp))
            raw.append({"row": key, "fault": fault, "injected": injected, "exit": code, "said": _said(err),
                        "seconds": seconds, "left": left, "test": test})
            progress.step(key)
        ranks = f"{args.ranks} ranks" if where is None else where.describe()
    flavour = "Open MPI" if _launcher.mpi_flavour() == "openmpi" else "MPICH"
    table = Table(COLUMNS, title=f"{ranks}, {flavour}")
    for r in raw:
        table.rows.append([r["fault"], r["injected"], str(r["exit"]), r["said"], f"{r['seconds']:.1f}",
                           ", ".join(r["left"]) or "nothing", r["test"]])
    return Result([table], raw)


class Jobs:
    """Starts the jobs of the rows on ``ranks`` ranks (or across ``where``'s emulated hosts) and
    times them."""

    def __init__(self, ranks: int, where=None):
        self.ranks, self.where = (ranks if where is None else where.ranks), where

    def run(self, argv, env=None, kill=None):
        """Start a job, inject ``kill`` once every rank printed ``ready``; returns
        (exit, stderr, seconds from the fault, or from the start, to the end, left files)."""
        before = _snapshot()
        start = time.monotonic()
        proc = self._start(argv, env)
        if kill:
            pids: Dict[int, int] = {}
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

    def signal_trainer(self, argv, fault="SIGUSR1", env=None):
        """Start the trainer; once it logged its first step record, inject ``fault``: SIGUSR1 to
        mpiexec, ``"host"`` (the last host dies) or ``"link"`` (the last host's link goes down)."""
        before = _snapshot()
        proc = self._start(argv, env)
        metrics = Path(argv[argv.index("--run-dir") + 1]) / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and '"step"' in metrics.read_text()):
            time.sleep(0.2)
        start = time.monotonic()
        last = None if self.where is None else len(self.where.hosts) - 1
        if fault == "host":
            self.where.hosts.kill_host(last)
        elif fault == "link":
            self.where.hosts.set_link(last, up=False)
        else:
            proc.send_signal(signal.SIGUSR1)
        result = self._finish(proc, start, before)
        if fault == "link":  # the next rows need the host: end what still runs there, reconnect it
            self.where.hosts.kill_host(last)
        if fault in ("link", "host"):  # ... and a killed host answers again once its link is brought up
            self.where.hosts.set_link(last, up=True)
        return result

    def _start(self, argv, env=None):
        return _launcher.start(*job(argv, self.ranks, self.where, env))

    def _finish(self, proc, start, before):
        try:
            _, err = _launcher.wait(proc, JOB_TIMEOUT_S)
        except _launcher.JobHung as hung:
            err = hung.err + f"\n(HUNG: killed after {JOB_TIMEOUT_S} s)"
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


def _host_dies(jobs, tmp):
    result = jobs.signal_trainer([*_train(tmp), "--epochs", "500", "--run-dir", str(tmp / "host")], fault="host")
    return ("a host dies (trainer)", "every process on the last host killed, its launcher proxy included",
            "test_faults_hosts.py::test_a_host_that_dies_ends_the_job", result)


def _link_down(jobs, tmp):
    result = jobs.signal_trainer([*_train(tmp), "--epochs", "500", "--run-dir", str(tmp / "link")], fault="link",
                                 env={"HSGD_STALL_TIMEOUT": "2", "HSGD_STALL_ABORT_AFTER": "5"})
    return ("a link goes down (trainer)", "the last host's link down mid-run; HSGD_STALL_TIMEOUT=2 "
            "HSGD_STALL_ABORT_AFTER=5", "test_faults_hosts.py::test_a_link_that_goes_down_*", result)


def _damaged_checkpoint(jobs, tmp):
    common = [*_train(tmp), "--run-dir", str(tmp / "damaged"), "--save-every", "10"]
    code, err, _, _ = jobs.run([*common, "--stop-after", "20"])
    if code != 0:
        sys.exit(f"lab.bench faults: the run to damage a checkpoint of failed:\n{err[-3000:]}")
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
                       "--batch-size", str(2 * jobs.ranks), "--epochs", "2", "--sync", "async", "--straggler", "1:3",
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
    "kill-host": _host_dies,
    "link-down": _link_down,
}
HOST_ROWS = ("kill-host", "link-down")  # with --hosts only


def _said(err: str) -> str:
    """The job's own words about the fault: hsgd's lines, the launcher's first verdict."""
    keys = ("hsgd", "error:", "Error", "stopped", "damaged", "skipped", "resuming", "BAD TERMINATION",
            "KILLED", "Terminated", "HUNG", "assert (!closed)")
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
