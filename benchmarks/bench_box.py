"""Parameter box vs a two-sided parameter server: asynchronous updates per second.

One command runs everything (it launches ``mpiexec`` itself for each rank
count)::

    python benchmarks/bench_box.py                      # 2 and 4 ranks, 1M and 10M floats
    python benchmarks/bench_box.py --ranks 4 --sizes 1e7 --repeats 3 --seconds 2

For every rank count and model size, in the same MPI job, side by side, each
for ``--seconds`` per repeat. One *update* is what an asynchronous worker
does per step, with a stand-in gradient (no model compute, so the figures
measure the exchange itself):

* ``PS``: rank 0 is a server: it ``Recv``s a gradient from any worker, applies
  it (``W -= lr * g``) and ``Send``s the weights back; ranks 1.. are workers;
* ``box``: the same workers, rank 0 only holds ``W_g`` in a
  :class:`hsgd.RemoteMemory` and runs no code; a worker's update is
  ``accumulate(-lr * g)`` then ``read(W_g)`` (what :class:`hsgd.AsyncSGD` does);
* ``box, all work``: as ``box``, but rank 0 works too (the design: the
  owner of a shard is also a worker).

Reported: updates per second summed over workers, median over ``--repeats``,
and the ratio box / PS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("PS", "box", "box, all work")
STOP = 2  # tag of a worker's last message to the server


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7], help="float32 elements")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0, help="length of one timed run")
    p.add_argument("--json", type=Path, default=None, help="also write raw rates here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _ps(comm, n, seconds):
    import numpy as np
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    comm.Barrier()
    if rank == 0:
        weights, grad, status, stopped = np.zeros(n, np.float32), np.empty(n, np.float32), MPI.Status(), 0
        while stopped < size - 1:
            comm.Recv(grad, MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if status.Get_tag() == STOP:
                stopped += 1
                continue
            weights -= 0.01 * grad
            comm.Send(weights, status.Get_source(), 1)
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


def _box(comm, n, seconds, owner_works):
    import torch

    from hsgd import RemoteMemory
    rank = comm.Get_rank()
    with RemoteMemory(comm, n, owners=[0]) as mem:
        delta, weights, updates = torch.full((n,), -0.01), torch.empty(n), 0
        comm.Barrier()
        if rank != 0 or owner_works:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                mem.accumulate(0, delta)
                mem.read(0, weights)
                updates += 1
        rate = comm.allreduce(updates) / seconds
        comm.Barrier()
    return rate


def worker(args):
    import torch
    from mpi4py import MPI
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rows = []
    for size in args.sizes:
        n = int(size)
        rates = {m: [] for m in METHODS}
        for _ in range(args.repeats):
            rates["PS"].append(_ps(comm, n, args.seconds))
            rates["box"].append(_box(comm, n, args.seconds, owner_works=False))
            rates["box, all work"].append(_box(comm, n, args.seconds, owner_works=True))
        rows.append({"ranks": comm.Get_size(), "floats": n, "rates": rates})
    if comm.Get_rank() == 0:
        print("BENCH " + json.dumps(rows), flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    mpiexec = Path(sys.executable).with_name("mpiexec")
    rows = []
    for ranks in args.ranks:
        cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(ranks), sys.executable,
               __file__, "--worker", "--sizes", *map(str, args.sizes), "--repeats", str(args.repeats),
               "--seconds", str(args.seconds)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        line = [x for x in out.stdout.splitlines() if x.startswith("BENCH ")]
        if out.returncode != 0 or not line:
            sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
        rows += json.loads(line[0][6:])
    print(f"updates/s summed over workers, median of {args.repeats} runs of {args.seconds:g} s\n")
    print("| ranks | floats | PS | box | box, all work | box/PS | all work/PS |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        med = {m: statistics.median(v) for m, v in row["rates"].items()}
        print(f"| {row['ranks']} | {row['floats'] / 1e6:g}M | {med['PS']:.0f} | {med['box']:.0f} | "
              f"{med['box, all work']:.0f} | {med['box'] / med['PS']:.1f}x | "
              f"{med['box, all work'] / med['PS']:.1f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
