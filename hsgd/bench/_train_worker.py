"""Under ``mpiexec`` for ``python -m hsgd.bench train``: the workloads, the methods, the timed steps.

:func:`worker` runs on every rank of the jobs :mod:`hsgd.bench.training_steps` starts. For each
workload (:func:`_model`) every method gets its own copy of the model, seeded the same,
and the same batches (:func:`_batches`), with SGD (lr 0.01, momentum 0.9) under its
wrapper (:class:`_Method`): the methods of :func:`_methods`. Each repeat runs
``--steps`` steps of every method in a rotating order, timed on the slowest rank after
a barrier; then as many bare averages of hsgd's gradient buffer as steps were timed.
Rank 0 returns one row per workload. Across hosts emulated on one machine (the lab's
``python -m lab.bench train --hosts N``), ``across`` brings that run's methods and
the meter of what crossed each link.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple, Union

__all__ = ["worker"]

DEEP_LAYERS, DEEP_WIDTH = 8, 1024  # 'deep': 8 hidden layers of 1024, 7.4M parameters in 18 tensors
MLP2M = (1000, 1000, 1000, 10)  # 'mlp2m': the across-hosts benchmarks' MLP, 2.0M parameters
MLP_HIDDEN = 2950  # 40*2950 + 2950*2950 + 2950*10 weights: 8.85M parameters with the biases
SAMPLE, CLASSES = (40,), 10  # MNIST-1D


def _model(workload: str):
    import torch

    from hsgd._trainer.models import MLP, build_model

    torch.manual_seed(0)
    if workload == "mlp":
        return MLP(SAMPLE[0], CLASSES, hidden=MLP_HIDDEN)
    if workload == "mlp2m":
        sizes = MLP2M
        layers = [m for a, b in zip(sizes[:-2], sizes[1:-1]) for m in (torch.nn.Linear(a, b), torch.nn.ReLU())]
        return torch.nn.Sequential(*layers, torch.nn.Linear(*sizes[-2:]))
    if workload == "deep":
        widths = [SAMPLE[0]] + [DEEP_WIDTH] * DEEP_LAYERS
        layers = [m for a, b in zip(widths, widths[1:]) for m in (torch.nn.Linear(a, b), torch.nn.ReLU())]
        return torch.nn.Sequential(*layers, torch.nn.Linear(DEEP_WIDTH, CLASSES))
    return build_model("cnn", SAMPLE, CLASSES)


class _Method:
    """One method's model, optimizer and wrapper; ``step(i)`` trains on batch ``i``."""

    def __init__(self, workload, batches, wrap, after_step=None, model_wrap=None):
        import torch

        self.model = _model(workload).to(batches[0][0].device)  # the batches' device
        self.net = self.model if model_wrap is None else model_wrap(self.model)
        inner = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.opt = wrap(inner, self.model)
        self.after_step, self.batches = after_step, batches
        self.loss = torch.nn.CrossEntropyLoss()

    def step(self, i: int) -> None:
        x, y = self.batches[i % len(self.batches)]
        self.opt.zero_grad()
        self.loss(self.net(x), y).backward()
        self.opt.step()
        if self.after_step is not None:
            self.after_step(self.model)

    def close(self) -> None:
        if hasattr(self.opt, "close"):
            self.opt.close()


def _methods(workload, batches, comm, topologies, period, local: bool, skipped: list, only=None):
    """The methods in order (the same on every rank; building them is collective); ``only``: the
    names to build (None: all)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager,
    )
    from torch.nn.parallel import DistributedDataParallel

    from hsgd import HierarchicalLocalSGD, HierarchicalSGD

    plain = lambda inner, model: inner  # noqa: E731
    made: Dict[str, Callable[[], _Method]] = OrderedDict()  # name -> how to build it

    def add(name, wrap, **kw):
        made[name] = lambda: _Method(workload, batches, wrap, **kw)

    add("no comm", plain)
    add("hsgd", lambda o, m: HierarchicalSGD(o, m, topology=topologies[1]))
    add("hsgd overlap", lambda o, m: HierarchicalSGD(o, m, topology=topologies[1], overlap=True))
    if 2 in topologies:
        for how in ("leader", "sharded"):
            add(f"hsgd {how} 2n", lambda o, m, how=how: HierarchicalSGD(
                o, m, topology=topologies[2], inter_node=how))
        add("hsgd overlap sharded 2n", lambda o, m: HierarchicalSGD(
            o, m, topology=topologies[2], inter_node="sharded", overlap=True))
    for name, view in (("DDP", False), ("DDP bucket view", True)):
        add(name, plain, model_wrap=lambda m, view=view: DistributedDataParallel(
            m, gradient_as_bucket_view=view))
    import hsgd.horovod as hsgd_horovod

    hsgd_horovod.init()
    for name, overlap in (("hsgd.horovod", False), ("hsgd.horovod overlap", True)):
        add(name, lambda o, m, overlap=overlap: _horovod_optimizer(hsgd_horovod, o, m, overlap=overlap))
    horovod = _horovod(skipped)
    if horovod is not None:
        add("Horovod", lambda o, m: _horovod_optimizer(horovod, o, m))
    if local:
        add("hsgd local", lambda o, m: HierarchicalLocalSGD(
            o, m, topology=topologies[1], intra_period=period, inter_period=1))
        flat = PeriodicModelAverager(period=period, warmup_steps=0)
        add("torch periodic", plain, after_step=lambda m: flat.average_parameters(m.parameters()))
        if 2 in topologies:
            add("hsgd local 2n", lambda o, m: HierarchicalLocalSGD(
                o, m, topology=topologies[2], intra_period=period // 2, inter_period=4))
            tiers = HierarchicalModelAverager(OrderedDict([(period // 2, comm.size // 2), (2 * period, comm.size)]),
                                              warmup_steps=0)
            add("torch hierarchical", plain, after_step=lambda m: tiers.average_parameters(m.parameters()))
    return OrderedDict((name, build()) for name, build in made.items() if only is None or name in only)


def _horovod(skipped: list):
    """``horovod.torch`` initialized, or None (and why, in ``skipped``)."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        skipped.append(f"Horovod: skipped, horovod.torch does not import here ({exc})")
        return None
    hvd.init()
    return hvd


def _horovod_optimizer(hvd, inner, model, **hsgd_only):
    """Horovod's lines of a training script, with ``hvd`` Horovod's or hsgd's (``hsgd.horovod``,
    whose ``overlap=`` is passed in ``hsgd_only``)."""
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), **hsgd_only)


def _batches(count, per_rank, rank, workload, device="cpu"):
    import torch

    shape = (MLP2M[0],) if workload == "mlp2m" else SAMPLE
    gen = torch.Generator().manual_seed(1000 + rank)  # drawn on the CPU: the same numbers on any device
    return [(torch.randn(per_rank, *shape, generator=gen).to(device),
             torch.randint(0, CLASSES, (per_rank,), generator=gen).to(device)) for _ in range(count)]


def worker(args, across=None):
    """On every rank: each workload, every method; rank 0 returns one row per workload.
    ``across``: the lab's emulated hosts (``lab.bench._host_train``: ``init_gloo``,
    ``LinkMeter``, ``methods`` and ``limits``), the hosts being the nodes; ``None``: one host."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hsgd import Topology

    from ._harness import worker_device
    from .allreduce import _timed

    comm = MPI.COMM_WORLD
    hosts = across is not None
    if hosts:  # the hosts are the nodes
        topologies: Dict[Union[int, str], Topology] = {"hosts": Topology.from_comm(comm)}
    else:
        topologies = {1: Topology.from_comm(comm, ranks_per_node=comm.size)}
        if comm.size % 2 == 0:
            topologies[2] = Topology.from_comm(comm, ranks_per_node=comm.size // 2)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    local_size = next(iter(topologies.values())).local_size
    device, sync, device_name = worker_device(getattr(args, "device", "cpu"), comm)  # the lab's: the CPU
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                          else max(1, len(os.sched_getaffinity(0)) // local_size))
    if hosts:
        across.init_gloo(args, comm, args._port)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args._port}", rank=comm.rank,
                                world_size=comm.size)
    meter = across.LinkMeter(comm) if hosts else None
    rows = []
    for workload in args.workloads:
        per_rank = args.cnn_batch if workload == "cnn" else args.mlp_batch
        skipped: List[str] = []
        batches = _batches(args.batches, per_rank, comm.rank, workload, device)
        only = getattr(args, "methods", None)
        if hosts:
            methods = across.methods(workload, batches, comm, topologies["hosts"], skipped)
        else:
            methods = _methods(workload, batches, comm, topologies, args.period, args.local, skipped,
                               only=None if only is None else {"no comm", "hsgd", *only})  # the tables need both
        names = list(methods)
        times: Dict[str, List[float]] = {name: [] for name in names}
        # per host: (sent, received), summed over the timed repeats
        crossed: Dict[str, Optional[List[Tuple[int, ...]]]] = {name: None for name in names}
        step = 0
        for round_ in range(args.warmup + args.repeats):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                comm.Barrier()
                if meter is not None:
                    meter.start()
                sync()
                start = time.perf_counter()
                for i in range(step, step + args.steps):
                    methods[name].step(i)
                sync()  # a GPU's queued work counts
                seconds = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                moved = meter.stop() if meter is not None else None
                if round_ >= args.warmup:
                    times[name].append(seconds)
                    if moved is not None:
                        crossed[name] = [tuple(a + b for a, b in zip(c, m)) for c, m in
                                         zip(crossed[name] or [(0, 0)] * len(moved), moved)]
            step += args.steps
        average = _timed(comm, methods["hsgd"].opt.averager.average,  # "global": over all ranks
                         argparse.Namespace(repeats=args.repeats * args.steps, warmup=1))
        numel = sum(p.numel() for p in methods["hsgd"].model.parameters())
        for name in names:
            methods[name].close()
        row = {"workload": workload, "ranks": comm.size, "batch": per_rank, "numel": numel,
               "device": device_name,
               "threads": torch.get_num_threads(), "times": times, "average": average, "skipped": skipped}
        if hosts:
            row.update(across.limits(times, crossed, args))
        rows.append(row)
    dist.destroy_process_group()
    for topo in topologies.values():
        topo.close()
    return rows
