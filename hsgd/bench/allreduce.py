"""Averaging: hsgd's shared-memory average vs MPI Allreduce vs gloo.

One command runs everything (it launches ``mpiexec`` itself for each rank
count)::

    python -m hsgd.bench allreduce                    # 2 and 4 ranks, 1M/10M/25M floats
    python -m hsgd.bench allreduce --ranks 2 --sizes 1e6 --repeats 5

In one MPI job per rank count, side by side: hsgd's average (on one node, and on
virtual nodes of 2), ``comm.Allreduce`` plus a scale, and gloo's ``all_reduce`` plus
a divide; each timing is the slowest rank's after a barrier, medians over
``--repeats``. Each job is ``mpiexec -n RANKS`` on this host (gloo meets on
127.0.0.1). Across hosts emulated on one machine, with the bytes on the busiest link:
``python -m lab.bench allreduce --hosts 2`` from a clone.
What each column is: docs/benchmark-methods.md (``allreduce``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict

from ._harness import Result, Table, add_repeat_options, clock, int_at_least, median, positive_float, repeat
from ._launch import run_per_rank_count

METHODS = ("hsgd", "hsgd 2-level", "MPI", "gloo")
COLUMNS = ("ranks", "floats", "hsgd ms", "hsgd 2-level ms", "MPI ms", "gloo ms", "MPI/hsgd", "gloo/hsgd",
           "copy ms", "add ms")


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(1), nargs="+", default=[2, 4], help="rank counts (2 4)")
    p.add_argument("--sizes", type=positive_float, nargs="+", default=[1e6, 1e7, 2.5e7],
                   help="float32 elements per buffer (1e6 1e7 2.5e7)")
    add_repeat_options(p, repeats=10, warmup=2, what="averages")
    p.add_argument("--port", dest="_port", type=int, default=0, help=argparse.SUPPRESS)  # gloo's, set by run()


def run(args, extra) -> Result:
    rows = run_per_rank_count("allreduce", args, timeout=1800, gloo=True, drop_env=["HSGD_RANKS_PER_NODE"])
    return Result([Table(COLUMNS, [_row(r) for r in rows], title(args))], rows)


def title(args) -> str:
    """The tables' title: the repeats, the warm-up, the cores."""
    return (f"median of {args.repeats} repeats after {args.warmup} warm-up (slowest rank), float32, "
            f"{os.cpu_count()} cores")


def _row(r):
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    med = {k: median(r["times"][k]) for k in r["times"]}
    copy, add = median(r["copy"]), median(r["add"])
    two = ms(med["hsgd 2-level"]) if "hsgd 2-level" in med else "-"
    return [r["ranks"], f"{r['numel'] / 1e6:g}M", ms(med["hsgd"]), two, ms(med["MPI"]), ms(med["gloo"]),
            f"{med['MPI'] / med['hsgd']:.1f}x", f"{med['gloo'] / med['hsgd']:.1f}x", ms(copy), ms(add)]


def _timed(comm, fn, args):
    """Every timed repeat's slowest-rank seconds for ``fn()``, after the warm-up."""
    from mpi4py import MPI

    def once():
        comm.Barrier()  # everyone starts together
        start = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return repeat(once, args.repeats, args.warmup)


def _bandwidth(n, repeats):
    """Single-process seconds of ``a.copy_(b)`` and of ``a.add_(b)``, ``repeats`` times each."""
    import torch
    a, b = torch.ones(n), torch.ones(n)
    return [clock(lambda: a.copy_(b)) for _ in range(repeats)], [clock(lambda: a.add_(b)) for _ in range(repeats)]


def hsgd_times(comm, n, args, ranks_per_node=None, inter_node="leader", compression=None):
    """Every timed repeat's slowest-rank seconds of one hsgd average of ``n`` float32 over ``comm``
    (the buffer is the rank's slot), with virtual nodes of ``ranks_per_node`` (None: physical), and
    this rank's traffic per average (its :class:`~hsgd._core.meter.Meter`). Collective."""
    import torch

    from hsgd import Topology
    from hsgd.hierarchical import HierarchicalAverager
    from hsgd.intra_node import Layout

    with Topology.from_comm(comm, ranks_per_node=ranks_per_node) as topo, \
            HierarchicalAverager(topo, Layout([(torch.float32, n)]), inter_node=inter_node,
                                 compression=compression) as avg:
        avg.own(0).fill_(1.0)
        times = _timed(comm, lambda: avg.average("global"), args)
        averages = args.warmup + args.repeats
        return times, {key: value / averages for key, value in avg.meter.as_dict().items()}


def mpi_times(comm, n, args):
    """Every timed repeat's slowest-rank seconds of ``comm.Allreduce(MPI.IN_PLACE)`` of ``n``
    float32, then a scale by ``1 / size``. Collective."""
    import torch
    from mpi4py import MPI

    buf = torch.ones(n)
    arr = buf.numpy()

    def mpi_average():
        comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
        buf.mul_(1.0 / comm.size)
    return _timed(comm, mpi_average, args)


def gloo_average(comm, n):
    """A callable: gloo's ``all_reduce`` of ``n`` float32, then a divide by the size."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(n)

    def average():
        dist.all_reduce(buf)
        buf.div_(comm.size)
    return average


def worker(args):
    """On every rank: each size, each method; rank 0 returns the rows (every repeat's time)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args._port}",
                            rank=comm.rank, world_size=comm.size)
    results = []
    for n in (int(s) for s in args.sizes):
        row: Dict[str, Any] = {"ranks": comm.size, "numel": n, "times": {}}
        layouts = [("hsgd", None)] + ([("hsgd 2-level", 2)] if comm.size >= 4 else [])
        for name, rpn in layouts:
            row["times"][name], _ = hsgd_times(comm, n, args, ranks_per_node=rpn)
        row["times"]["MPI"] = mpi_times(comm, n, args)
        row["times"]["gloo"] = _timed(comm, gloo_average(comm, n), args)
        if comm.rank == 0:
            row["copy"], row["add"] = _bandwidth(n, args.repeats)
            results.append(row)
    dist.destroy_process_group()
    return results
