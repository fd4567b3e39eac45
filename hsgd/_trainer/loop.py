"""The training loop of ``python -m hsgd.train``: :class:`Trainer`, one per rank.

Read top to bottom: :meth:`Trainer.run` runs epochs until the last one or a stop;
:meth:`Trainer._run_epoch` runs steps; :meth:`Trainer._train_step` is one step (data,
forward/backward, the synchronization mode's ``step()``, the LR schedule); what a batch
is made into, its loss and its score are the task's (:mod:`hsgd._trainer.tasks`).
Around the steps the loop logs every ``--log-every`` steps and checkpoints every
``--save-every`` (steps or seconds: the state gathered at the step, written in the
background, :mod:`hsgd._trainer.saving`); everything else is a hook (:mod:`hsgd._trainer.hooks`).
:meth:`Trainer._end_epoch` evaluates and writes the epoch record.

Invariants: every method is collective, but inside an epoch the loop adds no
collective of its own for a mode whose ranks do not step together (``opt.lockstep``
false): its step records carry rank 0's own loss and throughput (``"ranks": 1``), and
the stop is agreed through remote memory. An epoch's end and ``--save-every`` are the
points where all ranks meet.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Optional

import torch
from mpi4py import MPI

from .._core.agree import check_all, collective_error, on_root
from ..errors import InputValueError
from ..faults import record_faults_to
from ..faults.stall import StallInspector
from .balancing import Balancing
from .config import TrainConfig
from .hooks import Hooks, StopAfter, Straggler
from .metrics import MetricsLog, PhaseClock, process_age, write_timeline
from .precision import MixedPrecision
from .progress_bar import Progress
from .saving import CheckpointWriter, SaveCadence, parse_save_every
from .setup import build, setup
from .stopping import STOP_CHECK_STEPS, stop_agreement
from .tasks import Task
from .training import checkpoint_state, evaluate, restore, resume_state

__all__ = ["Trainer", "EXIT_REQUEUE", "STOP_CHECK_STEPS"]

logger = logging.getLogger("hsgd.train")

EXIT_REQUEUE = 75  # EX_TEMPFAIL: checkpoint written after a signal; requeue and --resume


class Trainer:
    """The training loop of one rank; every method is collective over the ranks."""

    def __init__(self, cfg: TrainConfig, comm, stopper):
        self.cfg, self.stopper = cfg, stopper
        self.topo, self.device, self.run_dir, self.ckpt_dir = setup(cfg, comm)
        self.is_main = self.topo.rank == 0
        record_faults_to(self.run_dir / "metrics.jsonl")  # why the job ended, if hsgd ends it (python -m hsgd.run)
        self.amp = MixedPrecision(cfg.amp, self.device)
        # The mode's too: one inspector watches the mode's waits and the trainer's own collectives
        # (metrics, evaluation, checkpoints, the stop agreement), so a lost host or a partition
        # anywhere in the loop is reported, and ends the job after HSGD_STALL_ABORT_AFTER.
        self.stall = StallInspector(self.topo.comm)  # the mode's too: one count of synchronizations
        self.train_loader, self.test_loader, self.task, self.model, self.opt, self.scheduler = \
            build(cfg, self.topo, self.device, self.stall)
        self.step, self.epoch, self.best = 0, 0, 0.0
        self.comm = self.stall.watched(comm, lambda: self.step)  # the trainer's own collectives
        self.start = {"step": 0, "resumed": None, "load_s": 0.0}  # for the run's "start" record
        if cfg.resume:
            loading = time.perf_counter()
            self._resume()
            self.start["load_s"] = time.perf_counter() - loading
        self.clock = PhaseClock(self.topo.rank, trace=cfg.timeline is not None)
        self.opt.on_phase = self.clock.record
        self._sent_before = self.opt.traffic["inter_bytes"]
        self._guard = cfg.nonfinite_limit > 0 and self.opt.finite_guard
        # --amp fp16 in --sync sync: the scaler unscales the averages, so that every rank's scaler
        # sees the same gradients and keeps the same scale
        # and --clip-grad-norm there: the averages are clipped, the same on every rank
        self._average_first = self.opt.finite_guard and (self._guard or self.amp.scaler is not None
                                                         or cfg.clip_grad_norm > 0)
        self._skipped = 0  # steps skipped in a row for non-finite gradients
        self.log = _open_log(self.run_dir, self.comm, cfg.tensorboard)
        slowdown = cfg.straggler_factor(comm.Get_rank(), comm.Get_size())  # 1: not slowed
        straggler = Straggler(slowdown, self.clock) if slowdown > 1 else None
        balancing = Balancing(cfg, self.train_loader, self.opt, self.model, self.device, self.comm,
                              straggler.stretch if straggler else None, self.amp.autocast, self.task)
        self.clock.take()  # --balance's warm-up is not training time
        self.hooks = Hooks([straggler, balancing, stop_agreement(self.opt, comm, stopper, self.step, self.stall),
                            StopAfter(cfg.stop_after) if cfg.stop_after else None,
                            Progress(cfg.progress, self.is_main, len(self.train_loader))])
        self.writer = CheckpointWriter(self.ckpt_dir, cfg.keep_checkpoints)  # rank 0's
        self.cadence = SaveCadence(parse_save_every(cfg.save_every), self.comm, self.step)

    def _resume(self) -> None:
        state = resume_state(self.cfg, self.ckpt_dir, self.model, self.opt, self.comm)
        if state is not None:
            self.step, self.epoch, self.best = restore(state, self.model, self.opt, self.scheduler,
                                                       self.train_loader, self.comm, self.amp, self.cfg.seed)
            self.start.update(step=self.step, resumed=self.step)
        elif self.is_main:
            logger.info("no checkpoint in %s: starting afresh", self.ckpt_dir)

    def save(self) -> None:
        """Gather the state here, at the step boundary (collective); rank 0 writes it in the
        background, once its previous write is done (whose failure fails every rank here)."""
        start = time.perf_counter()
        state = checkpoint_state(self.cfg, self.model, self.opt, self.scheduler, self.train_loader,
                                 self.step, self.epoch, self.best, self.comm, self.amp.state_dict())
        on_root(self.comm, self.writer.submit, state, self.step)
        self.cadence.saved(self.step)
        position = self.train_loader.state_dict()  # the loader's epoch: at an epoch's end, the one just done
        self.log.write("checkpoint", step=self.step, epoch=position["epoch"], samples=position["samples"],
                       wall=round(time.time(), 3), gather_s=round(time.perf_counter() - start, 4),
                       last_write_s=self.writer.last_seconds)

    def _write_start(self) -> None:
        """The run's "start" record (collective): where it starts, on which hosts, and how long
        this process took to get here (``startup_s``, loading a checkpoint ``load_s`` included)."""
        hosts = self.comm.allgather(MPI.Get_processor_name())
        self.log.write("start", wall=round(time.time(), 3), epoch=self.epoch, world_size=self.comm.Get_size(),
                       num_nodes=self.topo.num_nodes, hosts=hosts, startup_s=process_age(),
                       **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.start.items()})

    def run(self) -> int:
        """Train to the last epoch or until stopped; returns the exit status."""
        self._write_start()
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
        self.hooks.epoch_start(self.epoch, loader.position)
        self._traffic_start = self.opt.traffic
        times: Counter[str] = Counter()
        start, totals = time.perf_counter(), torch.zeros(4, dtype=torch.float64)
        window, window_start, stop, batches = torch.zeros(4, dtype=torch.float64), start, None, iter(loader)
        epoch_steps, stepping_end = 0, start
        while stop is None and loader.position < len(loader):
            self.hooks.step_start()
            loss, correct, n = self._train_step(batches)
            self.step, run_steps, epoch_steps = self.step + 1, run_steps + 1, epoch_steps + 1
            stop = self.hooks.step_end(self.step, run_steps)
            stepping_end = time.perf_counter()
            window += torch.tensor([loss * n, correct, n, 0.0], dtype=torch.float64)
            if self.step % cfg.log_every == 0:
                self._log_window(window, stepping_end - window_start, times)
                totals += window
                window.zero_()
                window_start = time.perf_counter()
            if stop is None and self.cadence.due(self.step):
                self.save()
        totals += window
        with self.stall.waiting(self.step, "epoch end"):
            self._reduce(totals)  # where the ranks meet, however far apart their steps were
        stop = stop or ("signal" if totals[3] > 0 else None)
        if loader.position == len(loader):  # the epoch ran to its end (on every rank: one stop step)
            rate = epoch_steps / max(stepping_end - start, 1e-9)
            self._end_epoch(totals, time.perf_counter() - start, times, rate, epoch_steps)
        return stop, run_steps

    def _train_step(self, batches):
        """One step: data, forward/backward, average, update (not taken on non-finite averaged
        gradients, with the guard), the LR schedule; returns (loss, correct, samples)."""
        with self.clock.phase("data"):
            batch = next(batches)
        loss, correct, n, finite = _fit_batch(self.model, self.opt, batch, self.device, self.clock,
                                              self.amp, self.task, average_first=self._average_first,
                                              clip=self.cfg.clip_grad_norm)
        if self._guard:
            self._check_finite(finite)
        self.scheduler.step()
        return loss, correct, n

    def _check_finite(self, finite: bool) -> None:
        """Count steps skipped for NaN/Inf averaged gradients; stop after ``--nonfinite-limit`` in
        a row. The gradients are the same on every rank, so every rank makes the same decision."""
        self._skipped = 0 if finite else self._skipped + 1
        if finite:
            return
        scale = self.amp.scale()
        if self.is_main:
            logger.warning("step %d: the averaged gradients hold NaN or Inf; step skipped (%d in a row)%s",
                           self.step + 1, self._skipped, "" if scale is None else f"; loss scale now {scale:g}")
        if self._skipped >= self.cfg.nonfinite_limit:
            fp16 = "" if scale is None else (f"; with --amp fp16 each skip halved the loss scale (now {scale:g}): "
                                             f"raise --nonfinite-limit or use --amp bf16 if float16 overflows")
            raise collective_error(InputValueError, f"the averaged gradients held NaN or Inf in "
                                   f"{self._skipped} steps in a row (the last: step {self.step + 1}); the "
                                   f"run diverged: lower --lr, add warm-up (--warmup-epochs) or check the "
                                   f"data; --resume starts from the last checkpoint{fp16}")

    def _reduce(self, totals):
        """Sum loss/accuracy counts and this rank's stop flag over ranks, in place."""
        totals[3] = self.stopper.received
        self.comm.Allreduce(MPI.IN_PLACE, totals.numpy(), op=MPI.SUM)
        return totals

    def _log_window(self, window, seconds: float, epoch_times: Counter) -> None:
        """A step record: over all ranks in a lockstep mode, else rank 0's own (no collective)."""
        ranks = 1
        if self.opt.lockstep:
            window = window.clone()
            self.comm.Allreduce(MPI.IN_PLACE, window.numpy(), op=MPI.SUM)
            ranks = self.comm.Get_size()
        times = self.clock.take()
        epoch_times.update(times)
        sent = self.opt.traffic["inter_bytes"]  # rank 0's own, since its last record: no collective
        record = dict(epoch=self.epoch, step=self.step, wall=round(time.time(), 3), loss=(window[0] / window[2]).item(),
                      lr=self.scheduler.get_last_lr()[0], samples_per_s=window[2].item() / seconds,
                      ranks=ranks, time=times, own_inter_bytes=sent - self._sent_before)
        self._sent_before = sent
        self.log.write("step", **record)
        self.hooks.logged(record)

    def _end_epoch(self, totals, train_seconds: float, times: Counter, steps_per_s: float, steps: int) -> None:
        with self.clock.phase("eval"):
            test_loss, test_acc = evaluate(self.model, self.test_loader, self.comm, self.device,
                                           shared=self.opt.shared_state_dict if self.opt.replicas_differ else None,
                                           autocast=self.amp.autocast, task=self.task)
        times.update(self.clock.take())
        self.best = max(self.best, test_acc)
        seen = max(totals[2].item(), 1.0)  # 0 when resumed exactly at the epoch's end
        record = dict(epoch=self.epoch, step=self.step,
                      **self.task.metrics(totals[0].item() / seen, totals[1].item() / seen, test_loss, test_acc),
                      lr=self.scheduler.get_last_lr()[0],
                      samples_per_s=totals[2].item() / train_seconds,
                      seconds=train_seconds + times["eval"], time=dict(times), **self._epoch_ranks(steps_per_s))
        self.log.write("epoch", **record)
        self.hooks.epoch_end(record, times, steps)
        self.epoch += 1

    def _epoch_ranks(self, steps_per_s: float) -> dict:
        """Bytes moved this epoch inside and across nodes (summed over ranks), and each rank's
        steps per second until its last step (before waiting for the others at the epoch's end)."""
        now, keys = self.opt.traffic, ("intra_bytes", "inter_bytes")
        mine = [now[k] - self._traffic_start[k] for k in keys]
        every = self.comm.allgather((mine, steps_per_s))
        moved = [sum(m[i] for m, _ in every) for i in range(len(keys))]
        return dict(zip(keys, moved), rank_steps_per_s=[round(rate, 3) for _, rate in every],
                    batch_shares=self.train_loader.batch_shares)

    def _finish(self, stop: Optional[str]) -> None:
        on_root(self.comm, self.writer.wait)  # the last checkpoint is on disk before the job ends
        self.hooks.close()
        # the run's last record: how the job ended, for a supervisor that cannot trust the exit
        # status (Open MPI's launcher exits 0 when it ends a job after losing a host)
        self.log.write("end", step=self.step, stopped=stop)
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
        self.stall.close()
        self.topo.close()


def _open_log(run_dir, comm, tensorboard: bool) -> MetricsLog:
    """Rank 0's metrics log (and TensorBoard writer); every rank learns if that failed."""
    return check_all(comm, MetricsLog, run_dir, enabled=comm.Get_rank() == 0, tensorboard=tensorboard)


def _fit_batch(model, opt, batch, device, clock, amp: MixedPrecision, task: Task, average_first: bool = False,
               clip: float = 0.0):
    """Forward (under ``amp``'s autocast), backward, average, update; returns (loss, correct,
    samples, finite). ``task`` makes the inputs and the loss and scores the batch
    (:mod:`hsgd._trainer.tasks`). With ``average_first`` (a mode with ``gradients_finite``) the
    gradients are averaged, then unscaled (``--amp fp16``), and a step whose averages hold NaN or
    Inf is not taken (``finite`` False), on every rank. ``clip`` > 0 clips the gradients' norm
    (``--clip-grad-norm``) just before the update: the averages with ``average_first``, else
    this rank's own gradients (unscaled first under ``--amp fp16``)."""
    x, y = task.inputs(batch, device)
    # The optimizer update counts as compute; averaging (in backward with --overlap, else in
    # step()) is already in intra/inter.
    with clock.phase("compute", excluding=("intra", "inter")):
        opt.zero_grad()
        with amp.autocast():
            out = model(x)
            loss = task.loss(out, y)
        amp.backward(loss)
    finite = True
    with clock.phase("compute", excluding=("intra", "inter")):
        if average_first:
            opt.synchronize()
            amp.unscale_(opt)
            finite = opt.gradients_finite()
            if finite:
                _clip(model, clip)
                with opt.skip_synchronize():
                    amp.step(opt)
        else:
            if clip > 0:
                amp.unscale_(opt)
                _clip(model, clip)
            amp.step(opt)
        amp.update()
    correct, samples = task.score(out, y)
    return loss.item(), correct, samples, finite


def _clip(model, clip: float) -> None:
    """Scale the gradients down so that their L2 norm over all parameters is at most ``clip``
    (0: leave them)."""
    if clip > 0:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
