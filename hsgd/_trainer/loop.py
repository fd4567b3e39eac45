"""The training loop of ``python -m hsgd.train``: :class:`Trainer`, one per rank.

Read top to bottom: :meth:`Trainer.run` runs epochs until the last one or a
stop; :meth:`Trainer._run_epoch` runs steps (data, forward/backward, the
synchronization mode's ``step()``, the LR schedule), logs every
``--log-every`` steps, agrees on a stop signal every ``STOP_CHECK_STEPS``
steps and checkpoints every ``--save-every`` steps; :meth:`Trainer._end_epoch`
evaluates and writes the epoch record. Every method is collective.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Optional

import torch
from mpi4py import MPI

from .._engine.agree import agree, on_root
from ..errors import InputError
from .checkpoint import save_checkpoint
from .config import TrainConfig
from .metrics import MetricsLog, PhaseClock, write_timeline
from .progress import Progress
from .setup import build, setup
from .training import checkpoint_state, evaluate, restore, resume_state

__all__ = ["Trainer", "EXIT_REQUEUE", "STOP_CHECK_STEPS"]

logger = logging.getLogger("hsgd.train")

EXIT_REQUEUE = 75  # EX_TEMPFAIL: checkpoint written after a signal; requeue and --resume
STOP_CHECK_STEPS = 10  # how often the ranks agree on a received stop signal


class Trainer:
    """The training loop of one rank; every method is collective over the ranks."""

    def __init__(self, cfg: TrainConfig, comm, stopper):
        self.cfg, self.comm = cfg, comm
        self.topo, self.device, self.run_dir, self.ckpt_dir = setup(cfg, comm)
        self.is_main = self.topo.rank == 0
        self.train_loader, self.test_loader, self.model, self.opt, self.scheduler = \
            build(cfg, self.topo, self.device)
        self.step, self.epoch, self.best = 0, 0, 0.0
        if cfg.resume:
            self._resume()
        self.clock = PhaseClock(self.topo.rank, trace=cfg.timeline is not None)
        self.opt.on_phase = self.clock.record
        self.log = _open_log(self.run_dir, self.comm, cfg.tensorboard)
        self.stopper = stopper
        self.progress = Progress(cfg.progress, self.is_main, len(self.train_loader))

    def _resume(self) -> None:
        state = resume_state(self.cfg, self.ckpt_dir, self.model, self.comm)
        if state is not None:
            self.step, self.epoch, self.best = restore(state, self.model, self.opt, self.scheduler,
                                                       self.train_loader, self.comm)
        elif self.is_main:
            logger.info("no checkpoint in %s: starting afresh", self.ckpt_dir)

    def save(self) -> None:
        state = checkpoint_state(self.cfg, self.model, self.opt, self.scheduler,
                                 self.train_loader, self.step, self.epoch, self.best, self.comm)
        on_root(self.comm, save_checkpoint, self.ckpt_dir, state, self.step)

    def run(self) -> int:
        """Train to the last epoch or until stopped; returns the exit status."""
        stop, run_steps = None, 0
        while self.epoch < self.cfg.epochs and stop is None:
            stop, run_steps = self._run_epoch(run_steps)
            self.save()
        self._finish(stop)
        return EXIT_REQUEUE if stop == "signal" else 0

    def _run_epoch(self, run_steps: int):
        """One epoch, or its rest after a resume; returns (stop reason or None, steps run)."""
        cfg, loader = self.cfg, self.train_loader
        loader.set_epoch(self.epoch)
        self._traffic_start = self.opt.traffic
        self.progress.start_epoch(self.epoch, loader.position)
        start, totals, times = time.perf_counter(), torch.zeros(4, dtype=torch.float64), Counter()
        window, window_start, stop, batches = torch.zeros(4, dtype=torch.float64), start, None, iter(loader)
        while stop is None and loader.position < len(loader):
            with self.clock.phase("data"):
                batch = next(batches)
            loss, correct, n = _train_step(self.model, self.opt, batch, self.device, self.clock)
            self.scheduler.step()
            self.step, run_steps = self.step + 1, run_steps + 1
            window += torch.tensor([loss * n, correct, n, 0.0], dtype=torch.float64)
            if self.step % cfg.log_every == 0:
                stop = self._log_window(window, time.perf_counter() - window_start, times)
                totals += window
                window.zero_()
                window_start = time.perf_counter()
            elif self.step % STOP_CHECK_STEPS == 0:
                stop = self._agree_stop()
            self.progress.advance()
            if cfg.stop_after and run_steps >= cfg.stop_after:
                stop = stop or "stop-after"
            if stop is None and cfg.save_every and self.step % cfg.save_every == 0:
                self.save()
        totals += self._reduce(window)
        stop = stop or ("signal" if totals[3] > 0 else None)
        if loader.position == len(loader):  # the epoch ran to its end
            self._end_epoch(totals, time.perf_counter() - start, times)
        return stop, run_steps

    def _reduce(self, window):
        """Sum the window's loss/accuracy counts and this rank's stop flag over ranks."""
        window[3] = self.stopper.received
        self.comm.Allreduce(MPI.IN_PLACE, window.numpy(), op=MPI.SUM)
        return window

    def _agree_stop(self) -> Optional[str]:
        flag = self.comm.allreduce(self.stopper.received, op=MPI.MAX)
        return "signal" if flag > 0 else None

    def _log_window(self, window, seconds: float, epoch_times: Counter) -> Optional[str]:
        self._reduce(window)
        stop = "signal" if window[3] > 0 else None
        times = self.clock.take()
        epoch_times.update(times)
        record = dict(epoch=self.epoch, step=self.step, loss=(window[0] / window[2]).item(),
                      lr=self.scheduler.get_last_lr()[0], samples_per_s=window[2].item() / seconds,
                      time=times)
        self.log.write("step", **record)
        self.progress.update(record)
        return stop

    def _end_epoch(self, totals, train_seconds: float, times: Counter) -> None:
        with self.clock.phase("eval"):
            test_loss, test_acc = evaluate(self.model, self.test_loader, self.comm, self.device,
                                           shared=self.opt.shared_state_dict if self.opt.replicas_differ else None)
        times.update(self.clock.take())
        self.best = max(self.best, test_acc)
        seen = max(totals[2].item(), 1.0)  # 0 when resumed exactly at the epoch's end
        record = dict(epoch=self.epoch, step=self.step, train_loss=totals[0].item() / seen,
                      train_acc=totals[1].item() / seen, test_loss=test_loss,
                      test_acc=test_acc, lr=self.scheduler.get_last_lr()[0],
                      samples_per_s=totals[2].item() / train_seconds,
                      seconds=train_seconds + times["eval"], time=dict(times), **self._epoch_traffic())
        self.log.write("epoch", **record)
        self.progress.end_epoch(record)
        self.epoch += 1

    def _epoch_traffic(self) -> dict:
        """Bytes moved this epoch, inside nodes and across nodes, summed over all ranks."""
        now, keys = self.opt.traffic, ("intra_bytes", "inter_bytes")
        moved = torch.tensor([now[k] - self._traffic_start[k] for k in keys], dtype=torch.int64)
        self.comm.Allreduce(MPI.IN_PLACE, moved.numpy(), op=MPI.SUM)
        return dict(zip(keys, moved.tolist()))

    def _finish(self, stop: Optional[str]) -> None:
        self.progress.close()
        self.log.close()
        if self.cfg.timeline:
            events = self.comm.gather(self.clock.events, root=0)
            if self.is_main:
                logger.info("timeline: %s", write_timeline(self.cfg.timeline, events))
        if self.is_main:
            logger.info("%s after %d steps; best test accuracy %.2f%%; run directory %s",
                        f"stopped ({stop})" if stop else "done", self.step, 100 * self.best,
                        self.run_dir)
        self.opt.close()
        self.topo.close()


def _open_log(run_dir, comm, tensorboard: bool) -> MetricsLog:
    """Rank 0's metrics log (and TensorBoard writer); every rank learns if that failed."""
    log, error = None, None
    try:
        log = MetricsLog(run_dir, enabled=comm.Get_rank() == 0, tensorboard=tensorboard)
    except InputError as exc:
        error = exc
    agree(comm, error)
    return log


def _train_step(model, opt, batch, device, clock):
    """Forward, backward, average, update; returns (loss, correct, samples) as floats."""
    x = batch[0].to(device, torch.float32, non_blocking=True)  # any stored dtype, e.g. uint8 images
    y = batch[1].to(device, non_blocking=True)
    with clock.phase("compute"):
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
    start, comm_before = time.perf_counter(), clock.total("intra", "inter")
    opt.step()
    end = time.perf_counter()
    # The optimizer update counts as compute; its averaging is already in intra/inter.
    clock.record("compute", start, end, seconds=(end - start) - (clock.total("intra", "inter") - comm_before))
    correct = (out.argmax(1) == y).sum().item()
    return loss.item(), float(correct), float(y.numel())
