"""Parameter box vs a two-sided parameter server: asynchronous updates per second.

One command runs everything (it launches ``mpiexec`` itself for each rank
count)::

    python -m lab.bench box                          # 2 and 4 ranks, 1M and 10M floats
    python -m lab.bench box --ranks 4 --sizes 1e7 --repeats 3 --seconds 2
    python -m lab.bench box --hosts 2 --ranks-per-host 1 --link 1gbit   # as root: across hosts

In the same MPI job, side by side, for ``--seconds`` per repeat: a server on rank 0
that receives gradients and sends weights back (``PS``), and workers that
``accumulate`` into and ``read`` from a :class:`hsgd.RemoteMemory` held by rank 0
(``box``; also with rank 0 working, and with rank 0 computing). One update is one
worker's exchange with a stand-in gradient. What each column is: docs/benchmark-methods.md (``box``).
"""

from __future__ import annotations

import time

from hsgd.bench._harness import Result, Table, add_repeat_options, int_at_least, median, positive_float, repeat

from ._launch import add_hosts_options, check_hosts_options, run_per_rank_count
from ._links import LinkMeter, link_rates, on_hosts

METHODS = ("PS", "box", "box, all work", "box, owner computes")
COLUMNS = ("ranks", "floats", "PS", "box", "box, all work", "box, owner computes", "box/PS", "all work/PS",
           "owner computes/PS")
HOST_COLUMNS = ("ranks", "floats", "method", "updates/s", "MB/s on the busiest link", "wire limit updates/s",
                "of the wire limit", "method/PS")
STOP = 2  # tag of a worker's last message to the server


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(2, " (a server and a worker)"), nargs="+", default=[2, 4],
                   help="rank counts (2 4)")
    p.add_argument("--sizes", type=positive_float, nargs="+", default=[1e6, 1e7],
                   help="float32 elements (1e6 1e7)")
    add_repeat_options(p, repeats=5, warmup=0, what="rounds of the methods")
    p.add_argument("--seconds", type=positive_float, default=2.0, help="length of one timed run (2)")
    add_hosts_options(p)


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser, min_ranks=2, why=" (a server and a worker)")


def run(args, extra) -> Result:
    rows = run_per_rank_count("box", args, timeout=3600)
    table = Table(COLUMNS, title=f"updates/s summed over workers, median of {args.repeats} runs of "
                  f"{args.seconds:g} s after {args.warmup} warm-up")
    for row in rows:
        med = {m: median(v) for m, v in row["rates"].items()}
        table.rows.append([row["ranks"], f"{row['floats'] / 1e6:g}M", f"{med['PS']:.0f}", f"{med['box']:.0f}",
                           f"{med['box, all work']:.0f}", f"{med['box, owner computes']:.0f}",
                           f"{med['box'] / med['PS']:.1f}x", f"{med['box, all work'] / med['PS']:.1f}x",
                           f"{med['box, owner computes'] / med['PS']:.1f}x"])
    tables = [table]
    if on_hosts(args):
        tables.append(Table(HOST_COLUMNS, [line for row in rows for line in _host_rows(row, args)],
                            title=f"across {args.hosts} emulated hosts, ranks "
                            f"{'+'.join(map(str, args.host_ranks))}, links {args.link}: the busiest link",
                            notes=["MB/s: the larger of sent and received on the busiest host's link (eth0's "
                                   "counters) per second of a run; of the wire limit: that over the link's rate"]))
    return Result(tables, rows)


def _host_rows(row, args):
    rates = link_rates(args)
    if any(rate is None for rate in rates):
        return
    ps = median(row["rates"]["PS"])
    for method in METHODS:
        rate = median(row["rates"][method])
        # per run: the busiest link's bytes per second as a fraction of its rate
        use = median([max(max(sent, received) * 8 / link for (sent, received), link in zip(crossed, rates))
                      / args.seconds for crossed in row["crossed"][method]])
        busiest = median([max(max(sent, received) for sent, received in crossed) / args.seconds
                          for crossed in row["crossed"][method]])
        yield [row["ranks"], f"{row['floats'] / 1e6:g}M", method, f"{rate:.0f}", f"{busiest / 1e6:.1f}",
               f"{rate / use:.0f}" if use > 0 else "-", f"{use:.0%}", f"{rate / ps:.2f}x"]


def _ps(comm, n, seconds):
    """The server keeps a receive posted from every worker and serves whichever completes
    (``Waitany``). (A ``Recv`` from ``MPI.ANY_SOURCE`` hung across three hosts under MPICH with
    UCX over TCP for messages up to 400 KB; Open MPI, and MPICH's OFI netmod, ran it.)"""
    import numpy as np
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    comm.Barrier()  # the server is ready before the first Send
    if rank == 0:
        weights, status = np.zeros(n, np.float32), MPI.Status()
        grads = [np.empty(n, np.float32) for _ in range(size - 1)]
        requests = [comm.Irecv(grads[i], i + 1, MPI.ANY_TAG) for i in range(size - 1)]
        serving = size - 1
        while serving:
            i = MPI.Request.Waitany(requests, status)
            if status.Get_tag() == STOP:
                serving, requests[i] = serving - 1, MPI.REQUEST_NULL
                continue
            weights -= 0.01 * grads[i]
            comm.Send(weights, i + 1, 1)
            requests[i] = comm.Irecv(grads[i], i + 1, MPI.ANY_TAG)
        updates = 0
    else:
        grad, weights, updates = np.ones(n, np.float32), np.empty(n, np.float32), 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            comm.Send(grad, 0, 1)
            comm.Recv(weights, 0, 1)
            updates += 1
        comm.Send(grad, 0, STOP)
    return comm.allreduce(updates) / seconds


def _box(comm, n, seconds, owner="waits"):
    """``owner``: what rank 0 does meanwhile: ``"waits"`` (inside MPI), ``"works"`` (updates too)
    or ``"computes"`` (matrix products, no MPI call)."""
    import torch

    from hsgd import RemoteMemory
    rank = comm.Get_rank()
    with RemoteMemory(comm, n, owners=[0]) as mem:
        delta, weights, updates = torch.full((n,), -0.01), torch.empty(n), 0
        comm.Barrier()  # everyone starts together
        end = time.perf_counter() + seconds
        if rank != 0 or owner == "works":
            while time.perf_counter() < end:
                mem.accumulate(0, delta)
                mem.read(0, weights)
                updates += 1
        elif owner == "computes":
            a = torch.randn(256, 256)
            while time.perf_counter() < end:
                a = torch.tanh(a @ a * 0.01)
        rate = comm.allreduce(updates) / seconds
        comm.Barrier()  # every rank has stopped before the region is freed
    return rate


def worker(args):
    """Under mpiexec: per size, rounds of the methods; rank 0 returns every round's rate (and,
    across emulated hosts, what crossed each host's link in each run)."""
    import torch
    from mpi4py import MPI
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    meter = LinkMeter(comm) if on_hosts(args) else None
    rows = []
    for size in args.sizes:
        n = int(size)
        runs = {"PS": lambda n=n: _ps(comm, n, args.seconds),
                "box": lambda n=n: _box(comm, n, args.seconds, "waits"),
                "box, all work": lambda n=n: _box(comm, n, args.seconds, "works"),
                "box, owner computes": lambda n=n: _box(comm, n, args.seconds, "computes")}

        def one_round(runs=runs):
            got = {}
            for method in METHODS:
                if meter is not None:
                    meter.start()
                got[method] = (runs[method](), meter.stop() if meter is not None else None)
            return got
        rounds = repeat(one_round, args.repeats, args.warmup)
        row = {"ranks": comm.Get_size(), "floats": n, "rates": {m: [r[m][0] for r in rounds] for m in METHODS}}
        if meter is not None:
            row["crossed"] = {m: [r[m][1] for r in rounds] for m in METHODS}
        rows.append(row)
    return rows
