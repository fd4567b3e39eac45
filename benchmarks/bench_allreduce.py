"""Averaging benchmark: hsgd's shared-memory average vs MPI Allreduce vs gloo.

One command runs everything (it launches ``mpiexec`` itself for each rank
count)::

    python benchmarks/bench_allreduce.py                   # 2 and 4 ranks, 1M/10M/25M floats
    python benchmarks/bench_allreduce.py --ranks 2 --sizes 1e6 --repeats 5

For every rank count and buffer size, in the same MPI job, side by side:

* ``hsgd``: :class:`hsgd.hierarchical.HierarchicalAverager` on one node (the
  buffer is the rank's slot in the shared window, as gradients are in training);
* ``hsgd 2-level``: the same with virtual nodes of 2 ranks (4 ranks only),
  so the inter-node MPI allreduce runs too;
* ``MPI``: ``comm.Allreduce(MPI.IN_PLACE, buf)`` then ``buf *= 1/size``;
* ``gloo``: ``torch.distributed.all_reduce`` (gloo over loopback) then ``div_``.

Each timing is the slowest rank's time for one average, after a barrier; the
table shows the median over ``--repeats`` and the ratios to hsgd. Rank 0
also measures single-process memory bandwidth (copy and add of one buffer of
the same size) as the physical floor. Torch uses one thread per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("hsgd", "hsgd 2-level", "MPI", "gloo")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 2.5e7],
                   help="float32 elements per buffer")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="also write raw medians here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def timed(comm, fn, repeats, warmup):
    """Median over repeats of the slowest rank's time for fn()."""
    from mpi4py import MPI
    times = []
    for i in range(warmup + repeats):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def bandwidth(n, repeats):
    import torch
    a, b = torch.ones(n), torch.ones(n)
    copy = statistics.median(_clock(lambda: a.copy_(b)) for _ in range(repeats))
    add = statistics.median(_clock(lambda: a.add_(b)) for _ in range(repeats))
    return copy, add


def _clock(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def worker(args):
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hsgd import Topology
    from hsgd.hierarchical import HierarchicalAverager
    from hsgd.intra_node import Layout

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=comm.rank, world_size=comm.size)
    results = []
    for n in (int(s) for s in args.sizes):
        row = {"ranks": comm.size, "numel": n}
        layouts = [("hsgd", None)] + ([("hsgd 2-level", 2)] if comm.size >= 4 else [])
        for name, rpn in layouts:
            with Topology.from_comm(comm, ranks_per_node=rpn) as topo, \
                    HierarchicalAverager(topo, Layout([(torch.float32, n)])) as avg:
                avg.own(0).fill_(1.0)
                row[name] = timed(comm, lambda: avg.average("global"), args.repeats, args.warmup)
        buf = torch.ones(n)
        arr = buf.numpy()

        def mpi_average(buf=buf, arr=arr):
            comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
            buf.mul_(1.0 / comm.size)

        def gloo_average(buf=buf):
            dist.all_reduce(buf)
            buf.div_(comm.size)
        row["MPI"] = timed(comm, mpi_average, args.repeats, args.warmup)
        row["gloo"] = timed(comm, gloo_average, args.repeats, args.warmup)
        if comm.rank == 0:
            row["copy"], row["add"] = bandwidth(n, args.repeats)
            results.append(row)
    dist.destroy_process_group()
    if comm.rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, ranks):
    mpiexec = Path(sys.executable).with_name("mpiexec")
    cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(ranks), sys.executable,
           __file__, "--worker", "--port", str(free_port()), "--repeats", str(args.repeats),
           "--warmup", str(args.warmup), "--sizes", *map(str, args.sizes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HSGD_RANKS_PER_NODE", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"benchmark on {ranks} ranks failed:\n{proc.stdout}\n{proc.stderr}")


def table(rows):
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    out = ["| ranks | floats | hsgd ms | hsgd 2-level ms | MPI ms | gloo ms | MPI/hsgd | gloo/hsgd "
           "| copy ms | add ms |", "|" + "---|" * 10]
    for r in rows:
        two = ms(r["hsgd 2-level"]) if "hsgd 2-level" in r else "-"
        out.append(f"| {r['ranks']} | {r['numel'] / 1e6:g}M | {ms(r['hsgd'])} | {two} | {ms(r['MPI'])} "
                   f"| {ms(r['gloo'])} | {r['MPI'] / r['hsgd']:.1f}x | {r['gloo'] / r['hsgd']:.1f}x "
                   f"| {ms(r['copy'])} | {ms(r['add'])} |")
    return "\n".join(out)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    rows = []
    for ranks in args.ranks:
        rows += launch(args, ranks)
    print(f"median of {args.repeats} repeats (slowest rank), float32, {os.cpu_count()} cores")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
