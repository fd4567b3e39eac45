"""Data-parallel training with HierarchicalSGD: the main job.

Launch::

    mpiexec -n 4 python -m hsgd.train                      # MNIST-1D, the paper's CNN
    mpiexec -n 4 python -m hsgd.train --optimizer lars --lr 2 --batch-size 4096 --scale-lr
    mpiexec -n 8 python -m hsgd.train --data my.h5 --x-key x --y-key y --model resnet
    mpiexec -n 4 python -m hsgd.train --model gpt           # a transformer on byte tokens
    mpiexec -n 4 python -m hsgd.train --model mypkg.models:build --data my.h5   # your own model
    srun --mpi=pmi2 python -m hsgd.train --run-dir runs/a --resume   # see scripts/slurm/
    python -m hsgd.train --help                            # every option, with defaults

On SIGUSR1 or SIGTERM (Slurm's warning) every rank finishes its step, a checkpoint is
written and the job exits with status 75 for the batch script to requeue; ``--resume``
gives the same result as a run never stopped. Bad input exits with 2. docs/trainer.md.
"""

from __future__ import annotations

import logging
import signal
import sys

from mpi4py import MPI

from ._trainer.config import TrainConfig, parse_config
from ._trainer.loop import EXIT_REQUEUE, Trainer
from .faults import abort_job, protect

__all__ = ["main", "TrainConfig", "parse_config", "Trainer", "EXIT_BAD_INPUT", "EXIT_REQUEUE"]

logger = logging.getLogger("hsgd.train")

EXIT_BAD_INPUT = 2


class StopSignal:
    """Remembers SIGUSR1/SIGTERM from the moment it is built (first thing in ``main``);
    the ranks agree on one step to stop at (see :mod:`hsgd._trainer.stopping`)."""

    def __init__(self):
        self.received = 0.0
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = 1.0


def main(argv=None) -> int:
    stopper = StopSignal()  # before anything slow: a signal during set-up must not kill us
    comm = MPI.COMM_WORLD
    protect(comm)  # an uncaught exception aborts the job; MPI's files are unlinked once attached
    try:
        cfg = parse_config(argv, quiet=comm.Get_rank() != 0)
    except SystemExit as exc:  # --help, or an argparse error (printed by rank 0)
        return int(exc.code or 0)
    problem = cfg.validate()  # the same on every rank: plain argument checks
    if problem:
        if comm.Get_rank() == 0:
            print(f"python -m hsgd.train: error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if cfg.ignored_flags() and comm.Get_rank() == 0:
        print(f"python -m hsgd.train: warning: {' '.join(cfg.ignored_flags())} do(es) not apply "
              f"to --sync {cfg.sync}; ignored", file=sys.stderr)
    try:
        return Trainer(cfg, comm, stopper).run()
    except Exception as exc:  # noqa: BLE001 - sorted below
        if getattr(exc, "hsgd_agreed", False):  # raised on every rank, agreed
            if comm.Get_rank() == 0:
                print(f"python -m hsgd.train: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        abort_job(*sys.exc_info())  # this rank alone may have failed: never leave the others hanging
        return 1


if __name__ == "__main__":
    sys.exit(main())
