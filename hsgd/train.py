"""Data-parallel training with HierarchicalSGD: the main job.

Launch::

    mpiexec -n 4 python -m hsgd.train                      # MNIST-1D, the paper's CNN
    mpiexec -n 4 python -m hsgd.train --optimizer lars --lr 2 --batch-size 4096 --scale-lr
    mpiexec -n 8 python -m hsgd.train --data my.h5 --x-key x --y-key y --model resnet
    srun --mpi=pmi2 python -m hsgd.train --run-dir runs/a --resume   # see scripts/slurm/
    python -m hsgd.train --help                            # every option, with defaults

With no ``--data``, rank 0 generates MNIST-1D (offline, package ``mnist1d``)
into a cache directory the first time; every rank then reads its share through
:class:`~hsgd.parallel_io.ContiguousH5Loader`. Each run writes ``RUN_DIR``
with ``config.json``, ``metrics.jsonl`` (see :mod:`hsgd.report`) and
``checkpoints/``. On SIGUSR1 or SIGTERM (Slurm's warning before the time
limit) every rank finishes its step, a checkpoint is written and the job
exits with status 75 so that the batch script requeues it; ``--resume``
continues from the latest checkpoint with the same result as a run that was
never stopped. Bad input prints one message from rank 0 and exits with 2.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from mpi4py import MPI

from . import Topology
from ._engine.agree import agree, check_all, collective_error, on_root
from ._trainer.checkpoint import check_writable, save_checkpoint
from ._trainer.config import TrainConfig, parse_config
from ._trainer.metrics import MetricsLog, PhaseClock, write_timeline
from ._trainer.models import build_model
from ._trainer.progress import Progress
from ._trainer.training import (
    checkpoint_state,
    dataset_length,
    evaluate,
    make_optimizer,
    make_scheduler,
    num_classes,
    prepare_data,
    restore,
    resume_state,
    test_batch_size,
)
from .errors import InputError, InputPermissionError, InputValueError
from .modes import SYNC_MODES
from .parallel_io import ContiguousH5Loader

logger = logging.getLogger("hsgd.train")

EXIT_BAD_INPUT = 2
EXIT_REQUEUE = 75  # EX_TEMPFAIL: checkpoint written after a signal; requeue and --resume


STOP_CHECK_STEPS = 10  # how often the ranks agree on a received stop signal


class StopSignal:
    """Remembers SIGUSR1/SIGTERM from the moment it is built (first thing in ``main``);
    the ranks agree on it every ``STOP_CHECK_STEPS`` steps and at epoch ends."""

    def __init__(self):
        self.received = 0.0
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = 1.0


def setup(cfg: TrainConfig, comm):
    """Topology, logging, threads, device and run directory."""
    topo = Topology.from_comm(comm, ranks_per_node=cfg.ranks_per_node)
    logging.basicConfig(level=logging.INFO if topo.rank == 0 else logging.WARNING,
                        format=f"[rank {topo.rank}] %(message)s", stream=sys.stderr)
    torch.set_num_threads(cfg.threads or _default_threads(topo.local_size))
    device = _pick_device(cfg.device, comm)
    run_dir = Path(on_root(comm, _make_run_dir, cfg, topo))
    ckpt_dir = Path(cfg.checkpoint_dir or run_dir / "checkpoints")
    on_root(comm, check_writable, ckpt_dir)
    return topo, device, run_dir, ckpt_dir


def _default_threads(local_size: int) -> int:
    """What the launcher gave each rank (SLURM_CPUS_PER_TASK, OMP_NUM_THREADS), else a fair share."""
    for var in ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    return max(1, len(os.sched_getaffinity(0)) // local_size)


def _pick_device(choice: str, comm) -> torch.device:
    """CPU, or the GPU of this rank's index among the ranks of its host; agreed by all ranks."""
    if choice == "cpu":
        return torch.device("cpu")
    everywhere = comm.allreduce(int(torch.cuda.is_available()), op=MPI.MIN)
    if not everywhere:
        if choice == "cuda":
            raise collective_error(InputValueError, "--device cuda, but torch sees no GPU on at least "
                                   "one rank; use --device cpu or auto")
        return torch.device("cpu")
    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    torch.cuda.set_device(host.Get_rank() % torch.cuda.device_count())
    host.Free()
    return torch.device("cuda")


def _make_run_dir(cfg: TrainConfig, topo: Topology) -> str:
    """Create the run directory; its config.json also records the job's shape for reports."""
    run_dir = Path(cfg.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    job = {"world_size": topo.size, "num_nodes": topo.num_nodes}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({**asdict(cfg), **job}, indent=1))
    except OSError as exc:
        raise InputPermissionError(f"cannot write the run directory {run_dir}: {exc.strerror or exc}; "
                                   "pass a writable --run-dir") from None
    return str(run_dir)


def build(cfg, topo, device):
    """Data loaders, model, optimizer, schedule: the same on every rank."""
    comm = topo.comm
    if cfg.batch_size % topo.size:
        raise collective_error(InputValueError, f"--batch-size {cfg.batch_size} is the global batch and "
                               f"must be a multiple of the {topo.size} ranks, e.g. "
                               f"{cfg.batch_size - cfg.batch_size % topo.size or topo.size}")
    train_path, test_path = prepare_data(cfg, comm)
    n = dataset_length(train_path, cfg.y_key, comm)
    if n is not None and n < cfg.batch_size:
        raise collective_error(InputValueError, f"--batch-size {cfg.batch_size} is larger than the {n} "
                               f"training samples in {train_path}; use --batch-size <= "
                               f"{max(topo.size, n - n % topo.size)} or more data")
    train = ContiguousH5Loader(train_path, cfg.x_key, cfg.y_key, batch_size=cfg.batch_size // topo.size,
                               comm=comm, seed=cfg.seed)
    test = ContiguousH5Loader(test_path, cfg.test_x_key, cfg.test_y_key, comm=comm, shuffle=False,
                              drop_last=False, pad=False, check_labels=False,
                              batch_size=test_batch_size(test_path, cfg.test_y_key, comm))
    classes = num_classes(train_path, cfg.y_key, comm)
    torch.manual_seed(cfg.seed)
    model = check_all(comm, build_model, cfg.model, train.sample_shape, classes).to(device)
    inner = make_optimizer(cfg, model)
    scheduler = make_scheduler(cfg, inner, len(train))
    opt = SYNC_MODES[cfg.sync].from_config(inner, model, topo, cfg)
    logger.info("%s; %d train / %d test samples of shape %s, %d classes; %s %s",
                opt, train.num_samples, test.num_samples, tuple(train.sample_shape), classes,
                cfg.model, cfg.optimizer)
    return train, test, model, opt, scheduler


class Trainer:
    """The training loop of one rank; every method is collective over the ranks."""

    def __init__(self, cfg: TrainConfig, comm, stopper: StopSignal):
        self.cfg, self.comm = cfg, comm
        self.topo, self.device, self.run_dir, self.ckpt_dir = setup(cfg, comm)
        self.is_main = self.topo.rank == 0
        self.train_loader, self.test_loader, self.model, self.opt, self.scheduler = \
            build(cfg, self.topo, self.device)
        self.step, self.epoch, self.best = 0, 0, 0.0
        if cfg.resume:
            self._resume()
        self.clock = PhaseClock(self.topo.rank, trace=cfg.timeline is not None)
        self.opt.averager.on_phase = self.clock.record
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
                                           replicas_differ=self.opt.replicas_differ)
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


def main(argv=None) -> int:
    stopper = StopSignal()  # before anything slow: a signal during set-up must not kill us
    comm = MPI.COMM_WORLD
    try:
        cfg = parse_config(argv, quiet=comm.Get_rank() != 0)
    except SystemExit as exc:  # --help, or an argparse error (printed by rank 0)
        return int(exc.code or 0)
    problem = cfg.validate()  # the same on every rank: plain argument checks
    if problem:
        if comm.Get_rank() == 0:
            print(f"python -m hsgd.train: error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return Trainer(cfg, comm, stopper).run()
    except Exception as exc:  # noqa: BLE001 - sorted below
        if getattr(exc, "hsgd_agreed", False):  # raised on every rank alike
            if comm.Get_rank() == 0:
                print(f"python -m hsgd.train: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)  # this rank alone may have failed: never leave the others hanging
        return 1


if __name__ == "__main__":
    sys.exit(main())
