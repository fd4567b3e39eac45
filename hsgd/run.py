"""Run ``python -m hsgd.train`` under a supervisor that restarts it on the hosts that are left.

Launch::

    python -m hsgd.run --hosts-file hosts.txt --min-nodes 2 -- --run-dir runs/a --epochs 30
    python -m hsgd.run --slurm --launcher-args=--mpi=pmi2 -- --run-dir runs/a   # in a batch script
    python -m hsgd.run --help

It starts the MPI job on every host that answers and watches it. When the job ends because
a host was lost (MPI ended it, or hsgd's stall inspector did and said so in a ``fault``
record), it probes the hosts again and restarts the job with ``--resume`` on those that
answer, at the new rank count, from the newest checkpoint; a host that answers again, or
is added to the hosts file, joins at the next restart. Each restart is a ``restart``
record in the run's ``metrics.jsonl`` (``python -m hsgd.report`` shows it). A job that has
not started training ``--startup-timeout`` seconds after its launch (hung in MPI's start-up)
is killed and started again the same way. Not restarted:
a job that ended well (0), on bad input (2), after a signal (75: checkpointed), or with an
uncaught exception (its ``fault`` record). Exit status: the job's last, 2 on bad input
here, 75 when fewer than ``--min-nodes`` hosts answer (a batch script requeues). docs/faults.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ._supervisor.jobs import LAUNCHERS
from ._supervisor.supervisor import EXIT_BAD_INPUT, EXIT_REQUEUE, PROG, Supervisor
from .errors import InputError

__all__ = ["main", "EXIT_BAD_INPUT", "EXIT_REQUEUE"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                usage=f"{PROG} (--hosts-file FILE | --slurm) [options] -- TRAINER_OPTIONS")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hosts-file", metavar="FILE", help="one host (or host:ranks) per line, read again "
                       "before every start: a host added to it joins at the next restart")
    where.add_argument("--slurm", action="store_true", help="the nodes of this Slurm allocation "
                       "(the default inside one, without --hosts-file)")
    p.add_argument("--ranks-per-host", type=int, metavar="K", help="ranks on every host (default: the "
                   "hosts file's host:ranks, else $SLURM_NTASKS_PER_NODE, else 1)")
    p.add_argument("--launcher", choices=("auto", *LAUNCHERS), default="auto",
                   help="how ranks start: mpich (hydra's mpiexec -hosts), openmpi (mpiexec --host), srun "
                   "(inside a Slurm allocation); auto: srun with --slurm, else the flavour of --mpiexec")
    p.add_argument("--mpiexec", metavar="PATH", help="the mpiexec (default: the one next to this Python, "
                   "else PATH's)")
    p.add_argument("--launcher-args", default="", metavar="ARGS", help="more options for the launcher, one "
                   "string (e.g. \"-launcher ssh -iface ib0\", or --launcher-args=--mpi=pmi2 for srun)")
    p.add_argument("--min-nodes", type=int, default=1, metavar="N",
                   help="fewest hosts to run on; below it the supervisor stops with status 75 (1)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N", help="restarts after lost hosts (3)")
    p.add_argument("--probe-timeout", type=float, default=5.0, metavar="S",
                   help="seconds a host has to start a process before it counts as lost (5)")
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                   help="seconds a job has from its launch to the trainer's start record (data and "
                   "checkpoint loaded) before it is killed and started again, as a lost host's is; "
                   "0: no limit (300)")
    p.add_argument("--stall-abort-pace", type=float, metavar="K", help="end a job whose ranks wait K times "
                   "their slowest recent step (at least 3 s) for a rank that is gone: the stall inspector's "
                   "HSGD_STALL_ABORT_PACE, set for the job (default: the environment's, else 20; 0: off)")
    p.add_argument("trainer", nargs=argparse.REMAINDER, help="after --: the options of python -m hsgd.train "
                   "(--run-dir is needed: the checkpoints and metrics.jsonl are found there)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        supervisor = Supervisor(args)
    except InputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return supervisor.loop()



if __name__ == "__main__":
    sys.exit(main())
