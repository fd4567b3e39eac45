"""What the stall inspector costs a normal step: HierarchicalSGD with it on and off, side by side.

One command::

    mpiexec -n 4 python benchmarks/bench_stall.py
    mpiexec -n 4 python benchmarks/bench_stall.py --params 25000000 --steps 20

Two ``HierarchicalSGD`` wrappers over copies of one MLP, one with the
inspector (``stall_timeout=60``: a 16-byte write to the board before each
step, a watchdog thread) and one without (``stall_timeout=0``), take turns:
``--steps`` training steps each (forward, backward, averaging, SGD update,
on a fixed batch), ``--repeats`` times. The table gives rank 0's median
step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

from hsgd import HierarchicalSGD


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=1_000_000, help="parameters of the MLP (about)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    width = max(8, int((args.params / 2) ** 0.5))
    runs = {}
    for timeout in (0.0, 60.0):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
        opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=1e-3), model, stall_timeout=timeout)
        runs[timeout] = (model, opt, [])
    x = torch.randn(args.batch, width)
    for _ in range(args.repeats):
        for model, opt, times in runs.values():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            times.append((time.perf_counter() - start) / args.steps)
    if comm.Get_rank() == 0:
        params = sum(p.numel() for p in runs[0.0][0].parameters())
        off, on = (statistics.median(runs[t][2]) for t in (0.0, 60.0))
        print(f"{comm.Get_size()} ranks, MLP of {params} parameters, batch {args.batch}, {args.steps} steps "
              f"x {args.repeats} repeats, alternating; rank 0's median step time\n")
        print("| stall inspector | ms per step (each repeat) | median | on / off |")
        print("|---|---|---|---|")
        for name, t, med in (("off (stall_timeout=0)", 0.0, off), ("on (stall_timeout=60)", 60.0, on)):
            each = " ".join(f"{1e3 * v:.2f}" for v in runs[t][2])
            print(f"| {name} | {each} | {1e3 * med:.3f} | {med / off:.3f} |")
    for _, opt, _ in runs.values():
        opt.close()


if __name__ == "__main__":
    main()
