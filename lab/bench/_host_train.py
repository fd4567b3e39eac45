"""Under ``mpiexec`` for ``python -m lab.bench train --hosts N``: the methods across emulated hosts.

:func:`worker` runs on every rank: on one host it is :func:`hsgd.bench._train_worker.worker`;
across emulated hosts it runs that worker with this module as ``across`` (its
``init_gloo``, ``LinkMeter``, ``methods`` and ``limits``): the hosts are
the nodes, the methods are those of :func:`methods` (with :class:`_FlatAllreduce`, one
``MPI_Allreduce`` of all gradients), what crossed each link is read by
:class:`lab.bench._links.LinkMeter`, and :func:`limits` adds each method's wire limit.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

from hsgd.bench import _train_worker
from hsgd.bench._harness import median
from hsgd.bench._train_worker import _horovod, _horovod_optimizer, _Method

from ._links import LinkMeter, init_gloo, link_rates, on_hosts, wire_limit

__all__ = ["worker", "methods", "limits", "LinkMeter", "init_gloo"]


def worker(args):
    """On every rank: each workload, every method; rank 0 returns one row per workload."""
    return _train_worker.worker(args, across=sys.modules[__name__] if on_hosts(args) else None)


class _FlatAllreduce:
    """``flat MPI``: after backward, one ``MPI_Allreduce`` of all gradients (flattened) over every
    rank, the mean copied back, then the inner optimizer's step: the flat baseline."""

    def __init__(self, inner, model, comm):
        import torch

        self.inner, self.comm, self.params = inner, comm, [p for p in model.parameters() if p.requires_grad]
        self.flat = torch.zeros(sum(p.numel() for p in self.params))

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        from mpi4py import MPI

        offset = 0
        for p in self.params:
            self.flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        self.comm.Allreduce(MPI.IN_PLACE, self.flat.numpy(), op=MPI.SUM)
        self.flat.mul_(1.0 / self.comm.size)
        offset = 0
        for p in self.params:
            p.grad.copy_(self.flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        self.inner.step()


def methods(workload, batches, comm, topology, skipped: list):
    """The methods across emulated hosts (the hosts are the nodes), in order; collective."""
    from torch.nn.parallel import DistributedDataParallel

    from hsgd import HierarchicalSGD

    plain = lambda inner, model: inner  # noqa: E731
    made = OrderedDict()
    made["no comm"] = _Method(workload, batches, plain)
    made["hsgd"] = _Method(workload, batches, lambda o, m: HierarchicalSGD(o, m, topology=topology))
    for how in ("leader", "sharded"):
        made[f"hsgd {how}"] = _Method(workload, batches, lambda o, m, how=how: HierarchicalSGD(
            o, m, topology=topology, inter_node=how))
    made["hsgd fp16"] = _Method(workload, batches, lambda o, m: HierarchicalSGD(
        o, m, topology=topology, compression="fp16"))
    made["hsgd overlap"] = _Method(workload, batches, lambda o, m: HierarchicalSGD(
        o, m, topology=topology, overlap=True))
    made["hsgd overlap 4MB"] = _Method(workload, batches, lambda o, m: HierarchicalSGD(
        o, m, topology=topology, overlap=True, bucket_cap_mb=4))
    made["hsgd overlap sharded 4MB"] = _Method(workload, batches, lambda o, m: HierarchicalSGD(
        o, m, topology=topology, overlap=True, bucket_cap_mb=4, inter_node="sharded"))
    for name, view in (("DDP", False), ("DDP bucket view", True)):
        made[name] = _Method(workload, batches, plain, model_wrap=lambda m, view=view: DistributedDataParallel(
            m, gradient_as_bucket_view=view))
    made["flat MPI"] = _Method(workload, batches, lambda o, m: _FlatAllreduce(o, m, comm))
    horovod = _horovod(skipped)
    if horovod is not None:
        made["Horovod"] = _Method(workload, batches, lambda o, m: _horovod_optimizer(horovod, o, m))
    return made


def limits(times, crossed, args) -> dict:
    """What a row across hosts adds: the bytes that crossed each link, and each method's wire limit."""
    floor = median(times["no comm"]) / args.steps
    total = args.steps * args.repeats  # the steps the counters covered
    return dict(crossed=crossed, timed_repeats=args.repeats,
                limits={n: wire_limit(c, link_rates(args), floor, total) for n, c in crossed.items()})

