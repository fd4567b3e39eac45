"""End to end: training steps of hsgd against torch DDP, torch's model averagers and Horovod.

One command (it launches ``mpiexec`` itself, one job per rank count)::

    python -m hsgd.bench train                          # 2 and 4 ranks, both workloads
    python -m hsgd.bench train --ranks 2 --workloads mlp --repeats 3

In each job, for each workload, every method trains its own copy of the
same model (same seed, so the same start) on the same synthetic batches
(``--batches`` per rank, drawn once, cycled) with the same per-rank batch
and the same optimizer (SGD, lr 0.01, momentum 0.9). Every rank runs torch
with one thread (the launcher sets ``OMP_NUM_THREADS=1``, as for the other
benchmarks); the JSON records it.

Workloads: ``mlp``, communication-bound: the MNIST-1D MLP widened to
2 950 hidden units (8.85M parameters), ``--mlp-batch`` 32 samples per rank;
``cnn``, compute-bound: the trainer's default model (the MNIST-1D CNN, 5K
parameters), ``--cnn-batch`` 128 samples per rank; and, when asked for,
``deep``, communication-bound in many tensors: 8 hidden layers of 1024
(7.4M parameters in 18 tensors, so that backward yields gradients
throughout and ``overlap=True`` has something to overlap), ``--mlp-batch``.

Methods, synchronous (gradients averaged every step):

* ``no comm``: the inner optimizer alone, no communication (the floor);
* ``hsgd``: :class:`hsgd.HierarchicalSGD` on one node (every rank here);
* ``hsgd overlap``: the same with ``overlap=True`` (buckets averaged during
  backward, default ``bucket_cap_mb``);
* ``hsgd leader 2n`` / ``hsgd sharded 2n``: the same on 2 virtual nodes of
  ranks/2, with each inter-node strategy (even rank counts), and
  ``hsgd overlap sharded 2n``;
* ``DDP`` / ``DDP bucket view``: ``torch.nn.parallel.DistributedDataParallel``
  on gloo, default and with ``gradient_as_bucket_view=True``;
* ``Horovod``: ``hvd.DistributedOptimizer``, when ``horovod.torch`` imports
  (it is no dependency of hsgd; the table says when it was skipped).

Local SGD (parameters averaged every few steps), ``--period P``:

* ``hsgd local``: :class:`hsgd.HierarchicalLocalSGD` on one node, every P steps,
  against ``torch periodic``: torch's ``PeriodicModelAverager(P)``;
* ``hsgd local 2n``: on 2 virtual nodes, in the node every P/2 steps and over
  all ranks every 2P, against ``torch hierarchical``: torch's
  ``HierarchicalModelAverager({P/2: ranks/2, 2P: ranks})`` (the same periods).

Each repeat runs ``--steps`` steps of every method in turn (the order rotates
from repeat to repeat, so a drift of the machine's speed hits every method
alike), after ``--warmup`` untimed rounds; a time is the slowest rank's,
after a barrier. Tables show medians over ``--repeats``: milliseconds per
step, samples/s (all ranks), and the ratios. The last table is issue 13's
overhead measure: hsgd's step time minus the no-communication step time,
over the time of a bare average of the same buffer (hsgd's own averager,
timed like ``python -m hsgd.bench allreduce``) in the same job.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import OrderedDict

from ._harness import Result, Table, add_repeat_options, int_at_least, median
from ._launch import run_per_rank_count

WORKLOADS = ("mlp", "cnn", "deep")
DEFAULT_WORKLOADS = ("mlp", "cnn")
DEEP_LAYERS, DEEP_WIDTH = 8, 1024  # 'deep': 8 hidden layers of 1024, 7.4M parameters in 18 tensors
SYNC = ("no comm", "hsgd", "hsgd overlap", "hsgd leader 2n", "hsgd sharded 2n", "hsgd overlap sharded 2n",
        "DDP", "DDP bucket view", "Horovod")
LOCAL = ("hsgd local", "torch periodic", "hsgd local 2n", "torch hierarchical")
MLP_HIDDEN = 2950  # 40*2950 + 2950*2950 + 2950*10 weights: 8.85M parameters with the biases
SAMPLE, CLASSES = (40,), 10  # MNIST-1D


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(1), nargs="+", default=[2, 4], help="rank counts (2 4)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(DEFAULT_WORKLOADS),
                   help="mlp (communication-bound), cnn (compute-bound) (both)")
    p.add_argument("--steps", type=int_at_least(1), default=10, help="steps per method per repeat (10)")
    add_repeat_options(p, repeats=7, warmup=1, what="rounds of every method")
    p.add_argument("--mlp-batch", type=int_at_least(1), default=32, help="samples per rank, mlp and deep (32)")
    p.add_argument("--cnn-batch", type=int_at_least(1), default=128, help="samples per rank, cnn (128)")
    p.add_argument("--batches", type=int_at_least(1), default=4, help="distinct batches per rank, cycled (4)")
    p.add_argument("--period", type=int_at_least(2), default=4,
                   help="local SGD period P; even (the 2-node runs average in the node every P/2) (4)")
    p.add_argument("--no-local", dest="local", action="store_false", help="skip the local-SGD methods")
    p.add_argument("--port", dest="_port", type=int, default=0, help=argparse.SUPPRESS)  # gloo's, set by run()


def check(args, extra, parser) -> None:
    if args.period % 2:
        parser.error(f"argument --period: {args.period} is odd; the 2-node local SGD averages in the "
                     f"node every P/2 steps: use an even period such as {args.period + 1}")


def run(args, extra) -> Result:
    rows = run_per_rank_count("train", args, timeout=3600, gloo=True, drop_env=["HSGD_RANKS_PER_NODE"])
    return Result(_tables(rows, args), rows)


# --- tables -------------------------------------------------------------------------------
def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def _tables(rows, args):
    title = (f"median of {args.repeats} repeats of {args.steps} steps after {args.warmup} warm-up "
             f"(slowest rank), {os.cpu_count()} cores; cells: ms per step")
    skipped = sorted({note for r in rows for note in r["skipped"]})
    tables = []
    for workload in WORKLOADS:
        mine = [r for r in rows if r["workload"] == workload]
        if not mine:
            continue
        step = {id(r): {k: (median(v) / args.steps if v else None) for k, v in r["times"].items()} for r in mine}
        sync = Table(["ranks", "batch/rank", *SYNC, "hsgd samples/s", "DDP/hsgd", "DDP bucket view/hsgd",
                      "hsgd/hsgd overlap"],
                     title=f"{workload}, synchronous SGD: {title}",
                     notes=["DDP/hsgd: DDP's time per step over hsgd's (one node), i.e. hsgd's samples/s "
                            "over DDP's; hsgd/hsgd overlap: the gain of overlap=True (above 1: faster)",
                            *skipped])
        for r in mine:
            t = step[id(r)]
            rate = r["ranks"] * r["batch"] / t["hsgd"]
            sync.rows.append([r["ranks"], r["batch"], *(_ms(t.get(m)) for m in SYNC), f"{rate:.0f}",
                              _ratio(t.get("DDP"), t["hsgd"]), _ratio(t.get("DDP bucket view"), t["hsgd"]),
                              _ratio(t["hsgd"], t.get("hsgd overlap"))])
        tables.append(sync)
        if args.local:
            local = Table(["ranks", *LOCAL, "torch/hsgd", "torch/hsgd 2n"],
                          title=f"{workload}, local SGD, period {args.period} (2n: {args.period // 2} in the "
                          f"node, {2 * args.period} over all): {title}")
            for r in mine:
                t = step[id(r)]
                local.rows.append([r["ranks"], *(_ms(t.get(m)) for m in LOCAL),
                                   _ratio(t.get("torch periodic"), t.get("hsgd local")),
                                   _ratio(t.get("torch hierarchical"), t.get("hsgd local 2n"))])
            tables.append(local)
        overhead = Table(["ranks", "floats", "no comm ms", "hsgd ms", "overhead ms", "bare average ms",
                          "overhead / average"],
                         title=f"{workload}: hsgd's step overhead over the bare average of the same buffer",
                         notes=["overhead: hsgd's step minus the no-communication step (medians); bare "
                                "average: one HierarchicalAverager.average() of the gradient slot, median of "
                                "the same number of averages as steps timed"])
        for r in mine:
            t = step[id(r)]
            extra = t["hsgd"] - t["no comm"]
            avg = median(r["average"])
            overhead.rows.append([r["ranks"], f"{r['numel'] / 1e6:.2f}M", _ms(t["no comm"]), _ms(t["hsgd"]),
                                  _ms(extra), _ms(avg), _ratio(extra, avg)])
        tables.append(overhead)
    return tables


# --- under mpiexec ------------------------------------------------------------------------
def _model(workload: str):
    import torch

    from hsgd._trainer.models import MLP, build_model

    torch.manual_seed(0)
    if workload == "mlp":
        return MLP(SAMPLE[0], CLASSES, hidden=MLP_HIDDEN)
    if workload == "deep":
        widths = [SAMPLE[0]] + [DEEP_WIDTH] * DEEP_LAYERS
        layers = [m for a, b in zip(widths, widths[1:]) for m in (torch.nn.Linear(a, b), torch.nn.ReLU())]
        return torch.nn.Sequential(*layers, torch.nn.Linear(DEEP_WIDTH, CLASSES))
    return build_model("cnn", SAMPLE, CLASSES)


class _Method:
    """One method's model, optimizer and wrapper; ``step(i)`` trains on batch ``i``."""

    def __init__(self, workload, batches, wrap, after_step=None, model_wrap=None):
        import torch

        self.model = _model(workload)
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


def _methods(workload, batches, comm, topologies, period, local: bool, skipped: list):
    """The methods in order (the same on every rank; building them is collective)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager,
    )
    from torch.nn.parallel import DistributedDataParallel

    from hsgd import HierarchicalLocalSGD, HierarchicalSGD

    plain = lambda inner, model: inner  # noqa: E731
    made = OrderedDict()
    made["no comm"] = _Method(workload, batches, plain)
    made["hsgd"] = _Method(workload, batches, lambda o, m: HierarchicalSGD(o, m, topology=topologies[1]))
    made["hsgd overlap"] = _Method(workload, batches, lambda o, m: HierarchicalSGD(
        o, m, topology=topologies[1], overlap=True))
    if 2 in topologies:
        for how in ("leader", "sharded"):
            made[f"hsgd {how} 2n"] = _Method(workload, batches, lambda o, m, how=how: HierarchicalSGD(
                o, m, topology=topologies[2], inter_node=how))
        made["hsgd overlap sharded 2n"] = _Method(workload, batches, lambda o, m: HierarchicalSGD(
            o, m, topology=topologies[2], inter_node="sharded", overlap=True))
    for name, view in (("DDP", False), ("DDP bucket view", True)):
        made[name] = _Method(workload, batches, plain, model_wrap=lambda m, view=view: DistributedDataParallel(
            m, gradient_as_bucket_view=view))
    horovod = _horovod(skipped)
    if horovod is not None:
        made["Horovod"] = _Method(workload, batches, lambda o, m: _horovod_optimizer(horovod, o, m))
    if local:
        made["hsgd local"] = _Method(workload, batches, lambda o, m: HierarchicalLocalSGD(
            o, m, topology=topologies[1], intra_period=period, inter_period=1))
        flat = PeriodicModelAverager(period=period, warmup_steps=0)
        made["torch periodic"] = _Method(workload, batches, plain,
                                         after_step=lambda m: flat.average_parameters(m.parameters()))
        if 2 in topologies:
            made["hsgd local 2n"] = _Method(workload, batches, lambda o, m: HierarchicalLocalSGD(
                o, m, topology=topologies[2], intra_period=period // 2, inter_period=4))
            tiers = HierarchicalModelAverager(OrderedDict([(period // 2, comm.size // 2), (2 * period, comm.size)]),
                                              warmup_steps=0)
            made["torch hierarchical"] = _Method(workload, batches, plain,
                                                 after_step=lambda m: tiers.average_parameters(m.parameters()))
    return made


def _horovod(skipped: list):
    """``horovod.torch`` initialized, or None (and why, in ``skipped``)."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        skipped.append(f"Horovod: skipped, horovod.torch does not import here ({exc})")
        return None
    hvd.init()
    return hvd


def _horovod_optimizer(hvd, inner, model):
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())


def _batches(count, per_rank, rank):
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(per_rank, *SAMPLE, generator=gen), torch.randint(0, CLASSES, (per_rank,), generator=gen))
            for _ in range(count)]


def worker(args):
    """On every rank: each workload, every method; rank 0 returns one row per workload."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hsgd import Topology

    from .allreduce import _timed

    comm = MPI.COMM_WORLD
    topologies = {1: Topology.from_comm(comm, ranks_per_node=comm.size)}
    if comm.size % 2 == 0:
        topologies[2] = Topology.from_comm(comm, ranks_per_node=comm.size // 2)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                          else max(1, len(os.sched_getaffinity(0)) // topologies[1].local_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args._port}", rank=comm.rank,
                            world_size=comm.size)
    rows = []
    for workload in args.workloads:
        per_rank = args.cnn_batch if workload == "cnn" else args.mlp_batch
        skipped = []
        methods = _methods(workload, _batches(args.batches, per_rank, comm.rank), comm, topologies,
                           args.period, args.local, skipped)
        names = list(methods)
        times = {name: [] for name in names}
        step = 0
        for round_ in range(args.warmup + args.repeats):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                comm.Barrier()
                start = time.perf_counter()
                for i in range(step, step + args.steps):
                    methods[name].step(i)
                seconds = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                if round_ >= args.warmup:
                    times[name].append(seconds)
            step += args.steps
        average = _timed(comm, methods["hsgd"].opt.averager.average,  # "global": over all ranks
                         argparse.Namespace(repeats=args.repeats * args.steps, warmup=1))
        numel = sum(p.numel() for p in methods["hsgd"].model.parameters())
        for name in names:
            methods[name].close()
        rows.append({"workload": workload, "ranks": comm.size, "batch": per_rank, "numel": numel,
                     "threads": torch.get_num_threads(), "times": times, "average": average,
                     "skipped": skipped})
    dist.destroy_process_group()
    for topo in topologies.values():
        topo.close()
    return rows
