"""``--balance`` in the trainer: a :class:`~hsgd.LoadBalancer` calibrated before the first step
and fed each epoch's busy time (data, compute and straggling, not waiting for other ranks).

Also carries shares that a checkpoint of a balanced run brings: they keep weighting the
averages until the interrupted epoch ends, then batches are equal again (without
``--balance``), or the run stops with an error if the mode cannot weight them mid-epoch;
and the even split of a global batch that the rank count does not divide, whose
unequal shares weight the averages too (or, in a mode that cannot weight them, stop the
run with one error line).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from typing import Callable, Optional, Tuple

import torch

from .._core.agree import collective_error
from ..balance import LoadBalancer
from ..errors import InputValueError
from .hooks import Hook
from .tasks import Classification, Task

__all__ = ["Balancing", "BUSY_PHASES"]

logger = logging.getLogger("hsgd.train")

BUSY_PHASES = ("data", "compute", "straggler")  # a rank's own work per step: what --balance equalizes


class Balancing(Hook):
    """The trainer's load balancing, a hook; collective to build (the warm-up) and in :meth:`epoch_start`."""

    def __init__(self, cfg, loader, opt, model, device, comm, straggle: Optional[Callable[[float], None]],
                 autocast=contextlib.nullcontext, task: Optional[Task] = None):
        self.cfg, self.loader, self.opt, self.comm = cfg, loader, opt, comm
        self.balancer: Optional[LoadBalancer] = None
        self._busy: Optional[Tuple[float, int]] = None  # (busy seconds, steps) of the last epoch
        if not (cfg.balance or loader.shares or _uneven(loader.batch_shares)):
            return
        if not opt.balances:
            if loader.shares and loader.position:  # shares from a balanced run's checkpoint, in another mode
                raise collective_error(InputValueError, f"the checkpoint's epoch runs with per-rank batch "
                                       f"shares (--balance); --sync {cfg.sync} cannot weight them: "
                                       f"resume with --sync sync or local, or from an epoch-end checkpoint")
            loader.set_shares(None)
            if _uneven(loader.batch_shares):
                world, batch = loader.world_size, loader.global_batch
                fits = [n for n in range(1, min(batch, 4 * world) + 1) if batch % n == 0]
                raise collective_error(InputValueError, f"--batch-size {batch} does not split evenly over {world} "
                                       f"ranks ({loader.batch_shares}), and --sync {cfg.sync} cannot weight "
                                       f"unequal batches: run on a rank count that divides it "
                                       f"({', '.join(map(str, fits))}, ...), or with a --batch-size that "
                                       f"{world} divides (from an epoch-end checkpoint when resuming)")
            return
        self.balancer = LoadBalancer(loader, opt, comm)
        if cfg.balance:
            work = _calibration_work(model, loader, opt, device, comm, straggle, autocast,
                                     task or Classification(0))
            shares = self.balancer.calibrate(work)
            if comm.Get_rank() == 0:
                logger.info("--balance: batch shares %s after a warm-up", shares)

    def epoch_start(self, epoch: int, position: int) -> None:
        """At an epoch's first step (collective): the shares for it."""
        if self.balancer is None or position != 0:
            return
        if not self.cfg.balance:  # a balanced run's shares, resumed without --balance: equal again
            self.loader.set_shares(None)
            self.balancer.apply_shares()
            self.balancer = None
        elif self._busy is not None:
            self.balancer.rebalance(*self._busy)

    def epoch_end(self, record: dict, times: Counter, steps: int) -> None:
        """The finished epoch's phase times of this rank (``times``) over its ``steps``."""
        self._busy = (sum(times[phase] for phase in BUSY_PHASES), steps)


def _uneven(shares) -> bool:
    return len(set(shares)) > 1


def _calibration_work(model, loader, opt, device, comm, straggle, autocast, task: Task):
    """One step's computation (forward under ``autocast()``, backward, straggling) on ``b``
    synthetic samples (``task``'s), leaving no trace: the gradients are zeroed, buffers and the
    RNG state restored."""
    data = torch.Generator().manual_seed(comm.Get_rank())
    x, y = task.synthetic(loader.batch_size, loader.sample_shape, data, device)

    def work(b: int) -> None:
        rng, buffers = torch.get_rng_state(), [t.clone() for t in model.buffers()]
        start = time.perf_counter()
        with opt.no_sync():  # overlap=True: no averaging in backward
            with autocast():
                inputs, targets = task.inputs((x[:b], y[:b]), device)
                loss = task.loss(model(inputs), targets)
            loss.backward()
        if straggle is not None:
            straggle(time.perf_counter() - start)
        opt.zero_grad()
        torch.set_rng_state(rng)
        with torch.no_grad():
            for saved, now in zip(buffers, model.buffers()):
                now.copy_(saved)
    return work
