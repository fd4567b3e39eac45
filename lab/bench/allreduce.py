"""Averaging: hsgd's shared-memory average vs MPI Allreduce vs gloo, here or across emulated hosts.

``python -m hsgd.bench allreduce`` (in the package) with ``--hosts``: the same job across
hosts emulated on this machine (root only), with the bytes on the busiest link::

    python -m lab.bench allreduce --ranks 2 --sizes 1e6 --repeats 5
    python -m lab.bench allreduce --hosts 2 --ranks-per-host 2 --link 1gbit --sizes 1e6 2e6 --repeats 5   # as root

In one MPI job per rank count, side by side: hsgd's average (on one node, and on
virtual nodes of 2), ``comm.Allreduce`` plus a scale, and gloo's ``all_reduce`` plus
a divide; each timing is the slowest rank's after a barrier, medians over
``--repeats``. Across emulated hosts each time comes with the bytes on the busiest
link and its wire limit. What each column is: docs/benchmark-methods.md (``allreduce``).
"""

from __future__ import annotations

from hsgd.bench import allreduce as here
from hsgd.bench._harness import Result, Table, median
from hsgd.bench.allreduce import _timed, hsgd_times, mpi_times  # noqa: F401 (the model's workers use them)

from ._launch import add_hosts_options, check_hosts_options, run_per_rank_count
from ._links import LinkMeter, init_gloo, link_rates, on_hosts, wire_limit

HOST_METHODS = ("hsgd", "hsgd sharded", "hsgd fp16", "MPI", "gloo")  # across emulated hosts
HOST_COLUMNS = ("ranks", "floats", "method", "ms", "MB on the busiest link", "wire limit ms", "of the wire limit",
                "MPI/method")


def add_arguments(p) -> None:
    here.add_arguments(p)
    add_hosts_options(p)


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser)


def run(args, extra) -> Result:
    rows = run_per_rank_count("allreduce", args, timeout=1800, gloo=True, drop_env=["HSGD_RANKS_PER_NODE"])
    if not on_hosts(args):
        return Result([Table(here.COLUMNS, [here._row(r) for r in rows], here.title(args))], rows)
    title = (here.title(args) +
             f", {args.hosts} emulated hosts, ranks {'+'.join(map(str, args.host_ranks))}, links {args.link}")
    table = Table(HOST_COLUMNS, [line for r in rows for line in _host_rows(r, args)], title)
    table.notes = ["MB: the larger of sent and received on the busiest host's link (eth0's counters) per "
                   "average; wire limit: those bytes over the link rate"]
    return Result([table], rows)


def _host_rows(r, args):
    rates = link_rates(args)
    flat = median(r["times"]["MPI"])
    for name in HOST_METHODS:
        t = median(r["times"][name])
        crossed = r["crossed"][name]
        busiest = max(max(sent, received) for sent, received in crossed) / r["averages"]
        limit = wire_limit(crossed, rates, 0.0, r["averages"])
        yield [r["ranks"], f"{r['numel'] / 1e6:g}M", name, f"{t * 1e3:.1f}", f"{busiest / 1e6:.2f}",
               "-" if limit is None else f"{limit * 1e3:.1f}", "-" if limit is None else f"{limit / t:.0%}",
               f"{flat / t:.2f}x"]


def worker(args):
    """On every rank: on this host, :func:`hsgd.bench.allreduce.worker`; across emulated hosts,
    each size, each method with what crossed the links; rank 0 returns the rows."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    if not on_hosts(args):
        return here.worker(args)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    init_gloo(args, comm, args._port)
    results = [_host_worker(comm, int(s), args) for s in args.sizes]
    dist.destroy_process_group()
    return results if comm.rank == 0 else []


def _host_worker(comm, n, args):
    """Across emulated hosts (the hosts are the nodes): every method's times and the bytes that
    crossed each host's link during its warm-up and timed averages. Collective."""
    meter = LinkMeter(comm)
    row = {"ranks": comm.size, "numel": n, "times": {}, "crossed": {}, "averages": args.warmup + args.repeats}
    runs = {"hsgd": lambda: hsgd_times(comm, n, args)[0],
            "hsgd sharded": lambda: hsgd_times(comm, n, args, inter_node="sharded")[0],
            "hsgd fp16": lambda: hsgd_times(comm, n, args, compression="fp16")[0],
            "MPI": lambda: mpi_times(comm, n, args),
            "gloo": lambda: _timed(comm, here.gloo_average(comm, n), args)}
    for name in HOST_METHODS:
        comm.Barrier()
        meter.start()
        row["times"][name] = runs[name]()
        row["crossed"][name] = meter.stop()
    return row
