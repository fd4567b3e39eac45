"""Time each round of GossipSGD's exponential graph apart: the slowest rank, per round.

The round-by-round figures in docs/benchmarks.md (the cost model against emulated links,
gossip at 2 hosts x 2 ranks) come from this script, run across emulated hosts (root):

    python -m lab.hosts run --hosts 2 --ranks-per-host 2 --link 1gbit -- \\
        python lab/scripts/gossip_rounds.py 4e6 9

Arguments: FLOATS (the model's float32 elements), REPEATS (timed cycles of the graph's
rounds, after one untimed). Every rank sends in every round (theta 0), learning rate 0; a
barrier before each round, so each round starts from an idle link.
"""

import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from hsgd import GossipSGD, Topology

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
n = int(float(sys.argv[1]))
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
weights = torch.nn.Parameter(torch.ones(n))
weights.grad = torch.zeros(n)
with Topology.from_comm(comm) as topo, \
        GossipSGD(torch.optim.SGD([weights], lr=0.0), named_parameters=[("w", weights)], topology=topo,
                  graph="exponential", theta=0.0) as opt:
    distances = opt.graph.distances
    times = [[] for _ in distances]
    for rep in range(reps + 1):
        for r in range(len(distances)):
            comm.Barrier()
            t = time.perf_counter()
            opt.step()
            t = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            if rep:
                times[r].append(t * 1e3)
    if comm.rank == 0:
        for r, d in enumerate(distances):
            print(f"round {r} (distance {d}): median {np.median(times[r]):.1f} ms, "
                  f"every repeat: {' '.join(f'{t:.0f}' for t in times[r])}")
