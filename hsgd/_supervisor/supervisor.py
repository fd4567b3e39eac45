"""``python -m hsgd.run``'s loop: start the job, and restart it on the hosts that answer.

Why a job ended is read from what it leaves, not from its free text: the exit status
(0 with the trainer's ``end`` record: done; 0 without one is not trusted, as Open MPI's
launcher exits 0 when it ends a job after losing a host; 2 bad input; 75 stopped by a
signal with a checkpoint) and the ``fault`` records
the trainer's ranks write when hsgd ends the job (``exception``: not restarted;
``stall``: the ranks it found missing). Any other end is a lost host if a host of the
job no longer answers the probe (MPI ended the job when it lost the host's processes), or
the stall inspector said ranks were missing; then the job restarts on the hosts that
answer. A restart's ``restart`` record is written once the new job has caught up with the
old one's last step record, or has ended: ``seconds_lost`` is the time between those two
step records, less the steps between them at the old pace. A host lost without a word (no
connection reset: a power loss, a partition) is seen by the stall inspector alone: its
jobs run with ``HSGD_STALL_ABORT_PACE`` (``--stall-abort-pace``) set. A job that hangs
before the trainer's ``start`` record (in MPI's start-up, where no stall inspector runs yet)
is killed after ``--startup-timeout`` and started again on the hosts that answer, a restart
like a lost host's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from typing import List, Optional

from ..bench._launcher import mpi_flavour, mpiexec
from ..errors import InputError, InputValueError
from .hostlist import Host, check_resolvable, probe, read_hosts_file, slurm_hosts
from .jobs import launch_command, launcher_env, probe_command, run_job
from .journal import JobRecords, Journal

__all__ = ["Supervisor", "PROG", "EXIT_BAD_INPUT", "EXIT_REQUEUE", "ABORT_PACE_ENV", "DEFAULT_ABORT_PACE"]

PROG = "python -m hsgd.run"
ABORT_PACE_ENV = "HSGD_STALL_ABORT_PACE"  # hsgd.faults.stall's, which imports torch: not here
# A wait of 20 of a rank's slowest recent steps (at least 3 s) ends a job: without it a host
# that dies without closing its connections is seen after stall_abort_after (600 s)
DEFAULT_ABORT_PACE = 20.0
EXIT_BAD_INPUT = 2
EXIT_REQUEUE = 75  # the trainer's after a signal; here also: too few hosts answer, requeue elsewhere


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _option(argv: List[str], flag: str) -> Optional[str]:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), or ``None``."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _without_resume(argv: List[str]) -> List[str]:
    """``argv`` without ``--resume`` (and the file after it, if any)."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--resume":
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("-")
        elif not arg.startswith("--resume="):
            out.append(arg)
    return out


class Supervisor:
    """The checked settings (an :class:`~hsgd.errors.InputError` for anything wrong) and the loop."""

    def __init__(self, args):
        self.args, self.env = args, dict(os.environ)
        trainer = list(args.trainer[1:] if args.trainer[:1] == ["--"] else args.trainer)
        self.run_dir = _option(trainer, "--run-dir")
        if not self.run_dir:
            raise InputValueError("the trainer's options need --run-dir (after --): its checkpoints and "
                                  "metrics.jsonl are where the supervisor looks")
        resumes = "--resume" in trainer or _option(trainer, "--resume") is not None
        self.first = trainer if resumes else [*trainer, "--resume"]  # none yet: the trainer starts afresh
        self.again = [*_without_resume(trainer), "--resume"]  # the newest checkpoint
        for name, value, low in (("--min-nodes", args.min_nodes, 1), ("--max-restarts", args.max_restarts, 0),
                                 ("--ranks-per-host", args.ranks_per_host or 1, 1)):
            if value < low:
                raise InputValueError(f"{name} must be >= {low}, got {value}")
        if not args.probe_timeout > 0:
            raise InputValueError(f"--probe-timeout must be positive seconds, got {args.probe_timeout}")
        if not 0 <= args.startup_timeout < float("inf"):
            raise InputValueError(f"--startup-timeout must be seconds >= 0 (0: no limit), got {args.startup_timeout}")
        if args.stall_abort_pace is not None:
            if not 0 <= args.stall_abort_pace < float("inf"):
                raise InputValueError(f"--stall-abort-pace must be a number >= 0 (0: off), got {args.stall_abort_pace}")
            self.env[ABORT_PACE_ENV] = f"{args.stall_abort_pace:g}"
        else:  # the user's environment, else the default
            self.env.setdefault(ABORT_PACE_ENV, f"{DEFAULT_ABORT_PACE:g}")
        self.slurm = args.slurm or (not args.hosts_file and "SLURM_JOB_NODELIST" in self.env)
        if not (self.slurm or args.hosts_file):
            raise InputValueError("say where to run: --hosts-file FILE, or --slurm inside an allocation")
        srun = args.launcher == "srun" or (args.launcher == "auto" and self.slurm)
        self.mpiexec = args.mpiexec or ("srun" if srun else mpiexec())
        if shutil.which(self.mpiexec) is None:
            raise InputValueError(f"no launcher {self.mpiexec!r} here: pass --mpiexec PATH, or put it on PATH")
        self.launcher = "srun" if srun else args.launcher if args.launcher != "auto" else mpi_flavour(self.mpiexec)
        self.extra = shlex.split(args.launcher_args)
        self.listed = hosts = self.hosts()
        if args.min_nodes > len(hosts):
            where = f"in {args.hosts_file}" if args.hosts_file else "of the allocation"
            raise InputValueError(f"--min-nodes {args.min_nodes} is more than the {len(hosts)} hosts {where}: "
                                  f"use --min-nodes <= {len(hosts)} or list more hosts")
        if self.launcher == "srun" and len({h.ranks for h in hosts}) > 1:
            raise InputValueError("srun starts the same number of ranks on every node: give every host the "
                                  "same ranks (or --ranks-per-host K)")

    def hosts(self) -> List[Host]:
        """The hosts as listed now (the hosts file is read again every time)."""
        if self.slurm:
            return slurm_hosts(self.env, self.args.ranks_per_host)
        hosts = read_hosts_file(self.args.hosts_file, self.args.ranks_per_host)
        check_resolvable(hosts, self.args.hosts_file)
        return hosts

    def answering(self) -> List[Host]:
        """The listed hosts that start a process within ``--probe-timeout`` (a hosts file
        that went bad since: the hosts listed before, with a warning)."""
        try:
            self.listed = self.hosts()
        except InputError as exc:
            _say(f"warning: {exc}; probing the hosts listed before")
        return probe(self.listed, lambda h: probe_command(self.launcher, self.mpiexec, self.extra, h),
                     self.args.probe_timeout, launcher_env(self.launcher, self.env))

    def launch(self, hosts: List[Host], first: bool, journal: Journal, on_records) -> tuple:
        """Run the trainer on ``hosts`` to its end: ``(exit status, JobRecords, signal or None)``."""
        program = [sys.executable, "-m", "hsgd.train", *(self.first if first else self.again)]
        cmd = launch_command(self.launcher, self.mpiexec, self.extra, hosts, program,
                             sorted(name for name in self.env if name.startswith("HSGD_")))
        _say(f"starting {sum(h.ranks for h in hosts)} ranks on {len(hosts)} hosts: "
             f"{', '.join(h.name for h in hosts)}")
        return run_job(cmd, launcher_env(self.launcher, self.env), journal, on_records, self.args.startup_timeout)

    def loop(self) -> int:
        """Start the job; restart it while hosts are lost; returns the exit status."""
        hosts = self.answering()
        if len(hosts) < self.args.min_nodes:
            _say(f"{len(hosts)} hosts answer, fewer than --min-nodes {self.args.min_nodes}: not starting")
            return EXIT_REQUEUE
        restarts, pending = 0, None
        while True:
            journal = Journal(self.run_dir)
            pending_record = _Pending(pending, journal) if pending else None
            code, records, received = self.launch(hosts, restarts == 0, journal,
                                                  pending_record.hear if pending_record else None)
            if pending_record:
                pending_record.write()
            why = self._not_restarted(code, records, received)
            if why is not None:
                _say(why)
                return code
            ended, probing = time.time(), time.monotonic()
            cause = records.cause()  # a stall, if any (an exception was not restarted)
            hung = records.startup_timed_out
            how = (f"did not start within --startup-timeout {hung:g} s (no start record; raise it if loading "
                   f"the data and checkpoint takes longer): killed it" if hung else f"ended with status {code}")
            _say(f"the job {how}"
                 f"{'; the stall inspector found ranks ' + str(cause.get('missing')) + ' missing' if cause else ''}; "
                 f"probing the hosts")
            now = self.answering()
            probe_s = time.monotonic() - probing
            lost = [h for h in hosts if h.name not in {a.name for a in now}]
            if not lost and cause is None and not hung:
                _say("every host answers: not a lost host; not restarted")
                return code
            if restarts >= self.args.max_restarts:
                _say(f"lost hosts: {', '.join(h.name for h in lost) or 'none'}; --max-restarts "
                     f"{self.args.max_restarts} reached: not restarted")
                return code
            if len(now) < self.args.min_nodes:
                _say(f"{len(now)} hosts answer, fewer than --min-nodes {self.args.min_nodes}: not restarted")
                return EXIT_REQUEUE
            restarts += 1
            pending = _restart(restarts, code, lost, cause, now, records, ended, probe_s)
            _say(f"lost hosts: {', '.join(h.name for h in lost) or 'none'}; restart {restarts} of at most "
                 f"{self.args.max_restarts}, from the newest checkpoint")
            hosts = now

    @staticmethod
    def _not_restarted(code: int, records: JobRecords, received) -> Optional[str]:
        """Why the job is not restarted, or ``None`` if it may be."""
        if code == 0 and records.end is not None:
            return "the job ended well"
        if received is not None or code == EXIT_REQUEUE:
            return f"the job stopped with status {code} after a signal (checkpointed): not restarted"
        if code == EXIT_BAD_INPUT:
            return "the job ended with status 2 (bad input, its error line above): not restarted"
        cause = records.cause()
        if cause is not None and cause.get("cause") == "exception":
            return (f"the job ended with status {code} after an uncaught exception on rank {cause.get('rank')} "
                    f"({cause.get('host')}): {cause.get('error')}; not restarted")
        return None


def _restart(number, code, lost, cause, hosts, records: JobRecords, ended, probe_s) -> dict:
    """The restart record as known when the new job starts."""
    last = records.last or {}
    return {"event": "restart", "restart": number, "wall": round(time.time(), 3), "exit": code,
            "startup_timed_out": records.startup_timed_out, "lost_hosts": [h.name for h in lost],
            "lost_ranks": list(cause.get("missing", [])) if cause and cause.get("cause") == "stall" else [],
            "hosts": [h.name for h in hosts], "world_size": sum(h.ranks for h in hosts),
            "last_step": last.get("step"), "last_wall": last.get("wall"), "pace": records.seconds_per_step(),
            "ended_wall": round(ended, 3), "probe_s": round(probe_s, 3)}


class _Pending:
    """A restart record waiting for the new job to catch up with the old one's last step."""

    def __init__(self, record: dict, journal: Journal):
        self.record, self.journal = dict(record), journal
        self.start: Optional[dict] = None
        self.done = False

    def hear(self, new: List[dict]) -> None:
        for record in new:
            if record.get("event") == "start":
                self.start = record
            elif record.get("event") == "step" and not self.done and self._caught_up(record):
                self.write(record)

    def _caught_up(self, step: dict) -> bool:
        last = self.record["last_step"]
        return last is None or step.get("step", -1) >= last

    def write(self, step: Optional[dict] = None) -> None:
        """Append the record (once): with the seconds lost if ``step`` caught up."""
        if self.done:
            return
        self.done = True
        r, start = self.record, self.start or {}  # no start record: the job ended before one
        if step is not None and r["last_wall"] is not None:
            r["seconds_lost"] = round(step["wall"] - r["last_wall"] - (step["step"] - r["last_step"]) * r["pace"], 3)
            r["redo_s"] = round(step["wall"] - start["wall"], 3) if "wall" in start else None
        else:
            r["seconds_lost"] = None
        r["from_step"] = start.get("resumed")
        r["startup_s"], r["load_s"] = start.get("startup_s"), start.get("load_s")
        r["down_s"] = round(r["wall"] - r["last_wall"], 3) if r["last_wall"] is not None else None
        self.journal.append(r)
