"""The pieces of ``python -m hsgd.train`` that are not the loop itself.

Data preparation, optimizer and schedule construction, sharded evaluation,
and checkpoint state in and out. Every function that can fail because of the
user's input raises on every rank the same way (through :func:`hsgd._core.agree.agree`),
so the trainer can print one message from rank 0 and exit.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Tuple

import h5py
import numpy as np
import torch
from mpi4py import MPI

from .._core.agree import check_all, on_root
from .._engine.optimizer import mean_of_states
from ..data import ensure_mnist1d, ensure_stdlib_tokens
from ..errors import InputValueError
from ..lars import LARS
from ..parallel_io import ContiguousH5Loader
from ..replicas import average_buffers, map_tensors
from ..schedules import WarmupMultiStepLR, WarmupPolyLR, scaled_lr
from .checkpoint import load_checkpoint, newest_loadable
from .config import TrainConfig
from .tasks import Classification, Task

__all__ = ["prepare_data", "num_classes", "dataset_length", "test_batch_size", "make_optimizer", "make_scheduler",
           "evaluate", "resume_state", "checkpoint_state", "restore"]

logger = logging.getLogger(__name__)


def prepare_data(cfg: TrainConfig, comm) -> Tuple[str, str]:
    """Paths of the training and test files; when no ``--data``, generates MNIST-1D, or for
    ``--model gpt`` token data of the standard library's sources (``--corpus-bytes``)."""
    if cfg.data is None and cfg.model == "gpt":
        max_bytes = cfg.corpus_bytes or None
        if comm.Get_rank() == 0:
            logger.info("data: %s of the Python standard library's sources in blocks of %d bytes, in %s",
                        "all" if max_bytes is None else f"{max_bytes} bytes", cfg.block_size,
                        cfg.resolved_cache_dir())
        path = ensure_stdlib_tokens(cfg.resolved_cache_dir(), block_size=cfg.block_size, max_bytes=max_bytes,
                                    comm=comm)
        return str(path), cfg.test_data or str(path)
    if cfg.data is None:
        samples = int(round(cfg.mnist1d_samples / 0.8))  # mnist1d keeps 80% for training
        if comm.Get_rank() == 0:
            logger.info("data: MNIST-1D with %d training samples in %s", cfg.mnist1d_samples,
                        cfg.resolved_cache_dir())
        path = ensure_mnist1d(cfg.resolved_cache_dir(), num_samples=samples, comm=comm)
        return str(path), cfg.test_data or str(path)
    return cfg.data, cfg.test_data or cfg.data


def num_classes(path: str, y_key: str, comm) -> int:
    """1 + the largest label, read once by rank 0 (the loader checks the labels' type)."""
    def read_max():
        with h5py.File(path, "r") as f:
            labels = f[y_key]
            return int(max(labels[i:i + (1 << 20)].max() for i in range(0, len(labels), 1 << 20)))
    return on_root(comm, read_max) + 1


def dataset_length(path: str, key: str, comm) -> Optional[int]:
    """Rows of ``path[key]`` as rank 0 sees them; ``None`` if unreadable (the loader says why)."""
    def length():
        try:
            with h5py.File(path, "r") as f:
                return len(f[key])
        except Exception:  # noqa: BLE001 - the loader reports a bad file or key itself
            return None
    return on_root(comm, length)


def test_batch_size(path: str, y_key: str, comm, most: int = 1024) -> int:
    """Evaluation batch per rank: up to ``most``, small enough for every rank to get one."""
    n = dataset_length(path, y_key, comm)
    return most if not n else max(1, min(most, n // comm.Get_size()))


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module):
    """The inner optimizer with the (optionally linearly scaled) peak lr."""
    lr = scaled_lr(cfg.lr, cfg.batch_size, cfg.base_batch) if cfg.scale_lr else cfg.lr
    params = model.parameters()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lars":
        return LARS(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                    weight_decay=cfg.weight_decay, trust_coefficient=cfg.trust_coefficient)
    return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)


def make_scheduler(cfg: TrainConfig, optimizer, steps_per_epoch: int):
    """Per-step schedule: constant, warm-up + poly decay, or warm-up + steps."""
    warmup = int(round(cfg.warmup() * steps_per_epoch))
    total = cfg.epochs * steps_per_epoch
    if cfg.schedule == "poly":
        return WarmupPolyLR(optimizer, total_steps=total, warmup_steps=warmup, power=cfg.power)
    if cfg.schedule == "step":
        milestones = [m * steps_per_epoch for m in cfg.milestones]
        return WarmupMultiStepLR(optimizer, milestones=milestones, warmup_steps=warmup)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


@torch.no_grad()
def evaluate(model, loader: ContiguousH5Loader, comm, device, shared=None, autocast=contextlib.nullcontext,
             task: Optional[Task] = None):
    """Mean loss and accuracy over the whole split, each sample counted once, the forward
    pass inside ``autocast()`` (the training step's, with ``--amp``); ``task`` (default:
    classification) turns batches into inputs and scores them (:mod:`hsgd._trainer.tasks`).

    ``shared``: for a mode whose replicas differ (local SGD between averaging
    steps, the parameter box), its ``shared_state_dict``; the score is that
    of this model, the one a checkpoint holds, and each rank's own replica is
    put back afterwards. Collective.
    """
    task = task or Classification(0)
    if shared is None:
        average_buffers(model, comm)
        return _score(model, loader, comm, device, autocast, task)
    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(shared())
    try:
        return _score(model, loader, comm, device, autocast, task)
    finally:
        model.load_state_dict(own)


def _score(model, loader, comm, device, autocast, task: Task) -> Tuple[float, float]:
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for batch in loader:
        x, y = task.inputs(batch, device)
        with autocast():
            out = model(x)
            loss_sum, correct, count = task.sums(out, y)
        sums += torch.tensor([loss_sum, correct, count], dtype=torch.float64)
    model.train()
    comm.Allreduce(MPI.IN_PLACE, sums.numpy(), op=MPI.SUM)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def _check_compatible(state: dict, model: torch.nn.Module, cfg: TrainConfig, path) -> None:
    saved = state.get("config", {})
    mine = model.state_dict()
    theirs = state["model"]
    differ = [k for k in mine if k not in theirs or tuple(theirs[k].shape) != tuple(mine[k].shape)]
    if differ or set(theirs) - set(mine):
        raise InputValueError(
            f"checkpoint {path} was written for a different model (model={saved.get('model')!r}, "
            f"first mismatch: {(differ or sorted(set(theirs) - set(mine)))[0]!r}); this run builds "
            f"model={cfg.model!r}. Resume with the same --model and data, or use another "
            "--checkpoint-dir")


def resume_state(cfg: TrainConfig, checkpoint_dir: Path, model, opt, comm) -> Optional[dict]:
    """Rank 0 loads the checkpoint to resume from; every rank gets its part (or ``None``).

    Per-rank entries (``replicas``, ``rng``, ``rank_states``) are scattered, each rank getting
    its own as ``state["replica"]`` / ``state["rng"]`` / ``state["rank_state"]``; the rest is
    broadcast once. From a run with another number of ranks every rank gets the same replica:
    the saved (averaged) model and the mode's merge of the old ranks' optimizer states
    (``opt.merge_state_dicts``), an RNG state derived from ``--seed``, the step and its rank
    (``state["rng"]`` is ``None``), and no rank state (a codec's error feedback starts afresh).
    """
    state = None

    def load():
        nonlocal state
        if cfg.resume == "latest":
            path, state, damaged = newest_loadable(checkpoint_dir)
            if damaged:
                logger.warning("damaged checkpoint(s), skipped: %s; resuming from the newest that "
                               "loads, %s", "; ".join(damaged), path)
        else:
            assert cfg.resume is not None  # load() runs only with --resume
            path = Path(cfg.resume)
            state = load_checkpoint(path)
        if state is not None:
            _check_compatible(state, model, cfg, path)
            logger.info("resuming from %s (step %d)", path, state["step"])
    check_all(comm, load if comm.Get_rank() == 0 else (lambda: None))
    same_world = comm.bcast(None if state is None else state.get("world_size") == comm.Get_size())
    if same_world is None:
        return None
    replicas = state.pop("replicas", None) if state is not None else None
    rng = state.pop("rng", None) if state is not None else None
    rank_states = state.pop("rank_states", None) if state is not None else None
    if not same_world and replicas and comm.Get_rank() == 0:  # one merged replica for every new rank
        replicas = [{"optimizer": opt.merge_state_dicts([r["optimizer"] for r in replicas], comm.Get_size()),
                     **({"scaler": _merged_scaler(replicas)} if "scaler" in replicas[0] else {})}]
    # branches on same_world only: every rank takes the same one (replicas is rank 0's alone)
    replica = comm.scatter(replicas or None, root=0) if same_world else \
        comm.bcast(replicas[0] if replicas else None, root=0)
    rng = comm.scatter(rng if same_world and rng else None, root=0)
    rank_state = comm.scatter(rank_states if same_world and rank_states else None, root=0)
    state = comm.bcast(state, root=0)
    state["replica"], state["rng"], state["same_world"] = replica, rng, same_world
    state["rank_state"] = rank_state
    state["merged"] = bool(replicas) and not same_world  # for restore()'s account of it
    return state


def _merged_scaler(replicas):
    """The old ranks' GradScaler states, merged (their scale averaged)."""
    return mean_of_states([r["scaler"] for r in replicas])


def checkpoint_state(cfg, model, opt, scheduler, loader, step, epoch, best, comm, scaler=None) -> dict:
    """Everything a resumed run needs; collective, rank 0 gets the full dict.

    ``model`` is the mode's ``shared_state_dict()``: the average over ranks
    (the replicas are identical in synchronous SGD; in local SGD this is the
    model worth keeping), or the global weights ``W_g`` of the parameter box.
    With a mode whose replicas differ each rank's own replica and optimizer
    state are kept too, so that a resumed run continues exactly. ``scaler``:
    the state of ``--amp fp16``'s GradScaler (the same on every rank in
    ``--sync sync``; per rank with the replicas in the other modes). What differs between
    ranks in the mode's state although the replicas do not (a codec's error feedback:
    ``opt.rank_state_dict()``) is gathered from every rank as ``rank_states``.
    """
    rng = comm.gather(torch.get_rng_state(), root=0)
    rank_state = opt.rank_state_dict()  # None on every rank, or a dict on every rank
    shared = {k: v for k, v in opt.state_dict().items() if k not in (rank_state or {})}
    # Copies, not the live optimizer state: the write may go on while training does
    # (the model is a copy already, the gathered entries are unpickled copies).
    state = {"model": opt.shared_state_dict(), "optimizer": _copied(shared),
             "scheduler": _copied(scheduler.state_dict()), "loader": loader.state_dict(),
             "rng": rng, "step": step, "epoch": epoch, "best_test_acc": best,
             "config": asdict(cfg), "world_size": comm.Get_size()}
    if scaler is not None:
        state["scaler"] = scaler
    if rank_state is not None:
        state["rank_states"] = comm.gather(rank_state, root=0)
    if opt.replicas_differ:
        own = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if scaler is not None:
            own["scaler"] = scaler
        state["replicas"] = comm.gather(own, root=0)
    return state


def _copied(value):
    """``value`` with every tensor cloned and every container copied."""
    return map_tensors(lambda t: t.detach().clone(), value)


def restore(state: dict, model, opt, scheduler, loader, comm, amp=None, seed: int = 0) -> Tuple[int, int, float]:
    """Load a checkpoint's state on this rank; returns (step, epoch, best test accuracy).
    ``amp``: the run's :class:`~hsgd._trainer.precision.MixedPrecision`, which takes the saved
    loss scaler's state (if any).

    At any rank count the run goes on from the saved position: the epoch's remaining global
    batches (the loader), the step count and the LR schedule. At another rank count each
    rank's torch RNG is seeded from ``(seed, step, rank)``: at the same rank count the
    saved streams continue, so that the run ends bit for bit where an unstopped one does.
    """
    own = state.get("replica") or {}
    model.load_state_dict(own.get("model", state["model"]))
    # this rank's own part of the mode's state (saved by this rank); from another world it is
    # missing and the mode starts that part afresh, saying so
    opt.load_state_dict({**own.get("optimizer", state["optimizer"]), **(state.get("rank_state") or {})})
    scheduler.load_state_dict(state["scheduler"])
    if amp is not None:
        amp.load_state_dict(own.get("scaler", state.get("scaler")))
    step = int(state["step"])
    check_all(comm, loader.load_state_dict, state["loader"])
    if not state["same_world"] and comm.Get_rank() == 0:
        logger.info("the checkpoint is from %s ranks, this run has %d: epoch %d goes on from its global batch %d "
                    "(sample %d) with batch shares %s; %sRNG streams derived from --seed and the step",
                    state.get("world_size"), comm.Get_size(), loader.epoch, loader.position,
                    loader.position * loader.global_batch, loader.batch_shares,
                    "every replica starts from the saved average, the optimizer states averaged; "
                    if state.get("merged") else "")
    if state.get("rng") is not None:
        torch.set_rng_state(state["rng"])
    else:
        key = np.random.SeedSequence([seed, step, comm.Get_rank()]).generate_state(1, np.uint64)[0]
        torch.manual_seed(int(key))
    opt.load_shared_state_dict(state["model"])
    return step, int(state["epoch"]), float(state.get("best_test_acc", 0.0))
