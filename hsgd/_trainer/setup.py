"""Building a training job: topology, threads, device, mixed precision, run directory, data,
model, optimizer.

Every function here is collective: the ranks build the same job, and a bad
value from the user raises the same :class:`~hsgd.errors.InputError` on
every rank (the trainer prints it once and exits with 2).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .._core.agree import check_all, collective_error, on_root
from ..devices import on_host, pick_device
from ..errors import InputPermissionError, InputValueError
from ..parallel_io import ContiguousH5Loader
from ..topology import Topology
from .checkpoint import check_writable
from .config import TrainConfig
from .mode_flags import build_mode
from .models import build_model
from .precision import check_amp
from .tasks import choose_task, data_kind
from .training import dataset_length, make_optimizer, make_scheduler, num_classes, prepare_data, test_batch_size

__all__ = ["setup", "build"]

logger = logging.getLogger("hsgd.train")


def setup(cfg: TrainConfig, comm):
    """Topology, logging, threads, device (with ``--amp``: tried there first) and run directory."""
    topo = Topology.from_comm(comm, ranks_per_node=cfg.ranks_per_node)
    logging.basicConfig(level=logging.INFO if topo.rank == 0 else logging.WARNING,
                        format=f"[rank {topo.rank}] %(message)s", stream=sys.stderr)
    host_rank, host_size = on_host(comm)
    torch.set_num_threads(cfg.threads or _default_threads(host_size))
    device = pick_device(cfg.device, comm, host_rank)  # the same kind on every rank, or an InputError
    check_amp(cfg.amp, device, comm)  # in a child process, before this one runs any kernel
    run_dir = Path(on_root(comm, _make_run_dir, cfg, topo))
    ckpt_dir = Path(cfg.checkpoint_dir or run_dir / "checkpoints")
    on_root(comm, check_writable, ckpt_dir)
    return topo, device, run_dir, ckpt_dir


def _default_threads(host_size: int) -> int:
    """What the launcher gave each rank (SLURM_CPUS_PER_TASK, OMP_NUM_THREADS), else a fair
    share of the cores among the ranks on this host (not on the virtual node: with
    --ranks-per-node 1 and 2 ranks on 2 cores, one thread each, not two)."""
    for var in ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    return max(1, len(os.sched_getaffinity(0)) // host_size)


def _make_run_dir(cfg: TrainConfig, topo: Topology) -> str:
    """Create the run directory; its config.json also records the job's shape for reports."""
    run_dir = Path(cfg.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    job = {"world_size": topo.size, "num_nodes": topo.num_nodes, "threads": torch.get_num_threads()}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({**asdict(cfg), **job}, indent=1))
    except OSError as exc:
        raise InputPermissionError(f"cannot write the run directory {run_dir}: {exc.strerror or exc}; "
                                   "pass a writable --run-dir") from None
    return str(run_dir)


def build(cfg, topo, device, stall=None):
    """Data loaders, the task (:mod:`hsgd._trainer.tasks`), model, optimizer, schedule: the same
    on every rank. ``stall``: the stall inspector that the mode shares with the trainer
    (``None``: its own)."""
    comm = topo.comm
    if cfg.batch_size < topo.size:
        raise collective_error(InputValueError, f"--batch-size {cfg.batch_size} is the global batch: it cannot "
                               f"give each of the {topo.size} ranks a sample; use --batch-size >= {topo.size}")
    train_path, test_path = prepare_data(cfg, comm)
    n = dataset_length(train_path, cfg.y_key, comm)
    if n is not None and n < cfg.batch_size:
        raise collective_error(InputValueError, f"--batch-size {cfg.batch_size} is larger than the {n} "
                               f"training samples in {train_path}; use --batch-size <= "
                               f"{max(topo.size, n - n % topo.size)} or more data")
    train = ContiguousH5Loader(train_path, cfg.x_key, cfg.y_key, global_batch=cfg.batch_size, comm=comm,
                               seed=cfg.seed)
    classes = num_classes(train_path, cfg.y_key, comm)
    task = check_all(comm, choose_task, cfg.model, data_kind(train_path, comm), train_path, train.sample_shape,
                     train.label_shape, classes, cfg.block_size)
    test = ContiguousH5Loader(test_path, cfg.test_x_key, cfg.test_y_key, comm=comm, shuffle=False,
                              drop_last=False, pad=False, check_labels=False,
                              batch_size=test_batch_size(test_path, cfg.test_y_key, comm, task.eval_batch))
    torch.manual_seed(cfg.seed)
    model = check_all(comm, build_model, cfg.model, train.sample_shape, task.num_classes, cfg.width,
                      cfg.gpt()).to(device)
    inner = make_optimizer(cfg, model)
    scheduler = make_scheduler(cfg, inner, len(train))
    opt = build_mode(cfg, inner, model, topo, stall=stall)
    logger.info("%s; %d train / %d test samples of shape %s, %s; %s %s",
                opt, train.num_samples, test.num_samples, tuple(train.sample_shape), task.describe(),
                cfg.model, cfg.optimizer)
    return train, test, task, model, opt, scheduler
