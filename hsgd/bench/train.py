"""End to end: training steps of hsgd against torch DDP, torch's model averagers and Horovod.

One command (it launches ``mpiexec`` itself, one job per rank count)::

    python -m hsgd.bench train                          # 2 and 4 ranks, both workloads
    python -m hsgd.bench train --ranks 2 --workloads mlp --repeats 3
    python -m hsgd.bench train --hosts 2 --ranks-per-host 2 --link 1gbit --workloads mlp2m   # as root

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
throughout and ``overlap=True`` has something to overlap), ``--mlp-batch``;
and ``mlp2m``, the MLP 1000-1000-1000-10 of issue 23 (2.0M parameters, 8 MB
of gradients, inputs of 1000 features), ``--mlp-batch``.

Across emulated hosts (``--hosts``, one job, the hosts are the nodes), the
methods are those that cross the links: ``no comm``; ``hsgd`` with its
defaults; ``hsgd leader`` and ``hsgd sharded``; ``hsgd fp16`` (the default
strategy, ``compression="fp16"``); ``hsgd overlap`` (default
``bucket_cap_mb``, 25), ``hsgd overlap 4MB`` and ``hsgd overlap sharded 4MB``
(``bucket_cap_mb=4``: on a link, smaller buckets start crossing earlier in
backward); ``DDP`` and ``DDP
bucket view`` (gloo over the hosts' ``eth0``); ``flat MPI``: one
``MPI_Allreduce`` of all gradients over every rank, then the step; and
``Horovod`` when it imports. Next to each time: the megabytes that crossed
the busiest host's link per step (its ``eth0`` counters, read inside the
hosts), the wire limit (those bytes over ``--link``'s rate, plus the step
without communication) and the fraction of it the step reached, and the
samples/s relative to DDP's.

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
from ._launch import add_hosts_options, check_hosts_options, run_per_rank_count
from ._links import LinkMeter, init_gloo, link_rates, on_hosts, wire_limit

WORKLOADS = ("mlp", "cnn", "deep", "mlp2m")
DEFAULT_WORKLOADS = ("mlp", "cnn")
DEEP_LAYERS, DEEP_WIDTH = 8, 1024  # 'deep': 8 hidden layers of 1024, 7.4M parameters in 18 tensors
SYNC = ("no comm", "hsgd", "hsgd overlap", "hsgd leader 2n", "hsgd sharded 2n", "hsgd overlap sharded 2n",
        "DDP", "DDP bucket view", "Horovod")
HOSTS = ("no comm", "hsgd", "hsgd leader", "hsgd sharded", "hsgd fp16", "hsgd overlap", "hsgd overlap 4MB",
         "hsgd overlap sharded 4MB", "DDP", "DDP bucket view", "flat MPI", "Horovod")  # across emulated hosts
MLP2M = (1000, 1000, 1000, 10)  # 'mlp2m': issue 23's MLP, 2.0M parameters
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
    add_hosts_options(p)


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser)
    if args.period % 2:
        parser.error(f"argument --period: {args.period} is odd; the 2-node local SGD averages in the "
                     f"node every P/2 steps: use an even period such as {args.period + 1}")


def run(args, extra) -> Result:
    rows = run_per_rank_count("train", args, timeout=3600, gloo=True, drop_env=["HSGD_RANKS_PER_NODE"])
    return Result(_host_tables(rows, args) if on_hosts(args) else _tables(rows, args), rows)


# --- tables -------------------------------------------------------------------------------
def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def _host_tables(rows, args):
    """Across hosts: one table per workload, a row per method."""
    title = (f"median of {args.repeats} repeats of {args.steps} steps after {args.warmup} warm-up (slowest "
             f"rank), {args.hosts} emulated hosts, ranks {args.ranks_per_host} per host, links {args.link}")
    tables = []
    for r in rows:
        step = {k: median(v) / args.steps for k, v in r["times"].items() if v}
        ddp = step.get("DDP")
        table = Table(["method", "ms per step", "samples/s", "MB per step on the busiest link", "wire limit ms",
                       "of the wire limit", "samples/s / DDP's"],
                      title=f"{r['workload']} ({r['numel'] / 1e6:.2f}M parameters), batch {r['batch']} per rank: "
                            f"{title}",
                      notes=["MB: the larger of sent and received on the busiest host's link (eth0's counters), "
                             "per step; wire limit: the no-communication step plus those bytes over the link rate",
                             *r["skipped"]])
        for name in HOSTS:
            if name not in step:
                continue
            crossed, limit = r["crossed"].get(name), r["limits"].get(name)
            busiest = None if not crossed else max(max(c) for c in crossed) / (args.steps * r["timed_repeats"])
            table.rows.append([name, _ms(step[name]), f"{r['ranks'] * r['batch'] / step[name]:.0f}",
                               "-" if busiest is None else f"{busiest / 1e6:.2f}",
                               "-" if limit is None or name == "no comm" else _ms(limit),
                               "-" if limit is None or name == "no comm" else f"{limit / step[name]:.0%}",
                               _ratio(ddp, step[name])])
        tables.append(table)
    return tables


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


def _host_methods(workload, batches, comm, topology, skipped: list):
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


def _batches(count, per_rank, rank, workload):
    import torch

    shape = (MLP2M[0],) if workload == "mlp2m" else SAMPLE
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(per_rank, *shape, generator=gen), torch.randint(0, CLASSES, (per_rank,), generator=gen))
            for _ in range(count)]


def worker(args):
    """On every rank: each workload, every method; rank 0 returns one row per workload."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hsgd import Topology

    from .allreduce import _timed

    comm = MPI.COMM_WORLD
    hosts = on_hosts(args)
    if hosts:  # the hosts are the nodes
        topologies = {"hosts": Topology.from_comm(comm)}
    else:
        topologies = {1: Topology.from_comm(comm, ranks_per_node=comm.size)}
        if comm.size % 2 == 0:
            topologies[2] = Topology.from_comm(comm, ranks_per_node=comm.size // 2)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    local_size = next(iter(topologies.values())).local_size
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                          else max(1, len(os.sched_getaffinity(0)) // local_size))
    init_gloo(args, comm, args._port)
    meter = LinkMeter(comm) if hosts else None
    rows = []
    for workload in args.workloads:
        per_rank = args.cnn_batch if workload == "cnn" else args.mlp_batch
        skipped = []
        batches = _batches(args.batches, per_rank, comm.rank, workload)
        if hosts:
            methods = _host_methods(workload, batches, comm, topologies["hosts"], skipped)
        else:
            methods = _methods(workload, batches, comm, topologies, args.period, args.local, skipped)
        names = list(methods)
        times = {name: [] for name in names}
        crossed = {name: None for name in names}  # per host: (sent, received), summed over the timed repeats
        step = 0
        for round_ in range(args.warmup + args.repeats):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                comm.Barrier()
                if meter is not None:
                    meter.start()
                start = time.perf_counter()
                for i in range(step, step + args.steps):
                    methods[name].step(i)
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
               "threads": torch.get_num_threads(), "times": times, "average": average, "skipped": skipped}
        if hosts:
            floor = median(times["no comm"]) / args.steps
            total = args.steps * args.repeats  # the steps the counters covered
            row.update(crossed=crossed, timed_repeats=args.repeats,
                       limits={n: wire_limit(c, link_rates(args), floor, total) for n, c in crossed.items()})
        rows.append(row)
    dist.destroy_process_group()
    for topo in topologies.values():
        topo.close()
    return rows
