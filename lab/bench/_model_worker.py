"""Under ``mpiexec`` for ``python -m lab.bench model``: what the cost model is fitted to and checked against.

:func:`worker` runs on every rank of the jobs :mod:`lab.bench.model` starts; rank 0
returns every repeat's time (the slowest rank's) and hsgd's traffic per average. On this
host, in a job of 2 ranks: the node's calibration (hsgd's node average and ``MPI
Allreduce`` at :data:`CALIBRATION_SIZES`); with ``--validate``, in jobs of 2 and 4 ranks:
the flat ring, ``leader`` and ``sharded`` in the configurations of :data:`VALIDATION`.
Across emulated hosts (:func:`_hosts_worker`): the network (a ``Sendrecv`` ring between
the hosts' first ranks and, from 3 hosts on, a fan, :func:`_fan_times`), then every
strategy on N hosts x 1 and N hosts x k: a ring allreduce of ``Sendrecv``s beside ``MPI
Allreduce``, ``leader``, ``sharded``, a :class:`hsgd.GossipSGD` step and what an
:class:`hsgd.AsyncSGD` step moves through a :class:`hsgd.RemoteMemory`. The timing
itself is :mod:`hsgd.bench.allreduce`'s (``_timed``, ``hsgd_times``, ``mpi_times``).
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

from . import _costs
from ._links import on_hosts

__all__ = ["worker", "CALIBRATION_SIZES", "VALIDATION", "MEASURED", "HOST_MEASURED"]

#: Floats of the two calibration sizes: 4 KiB (latency) and 16 MiB (bandwidth) in float32.
CALIBRATION_SIZES = (1024, 4 << 20)
#: The configurations ``--validate`` measures, by the job's rank count: (nodes, ranks per node).
VALIDATION = {2: ((1, 2), (2, 1)), 4: ((1, 4), (2, 2))}
MEASURED = ("flat ring", "leader", "sharded")  # MPI Allreduce is the flat ring
HOST_MEASURED = _costs.STRATEGIES  # across emulated hosts: every strategy


def _validate_numels(args):
    return [-(-int(s) // 64) * 64 for s in args.validate_sizes]


def worker(args):
    """On every rank: the calibration (2 ranks) and ``--validate``'s configurations for this rank
    count, or (``--job hosts``) the network and the configurations across the emulated hosts;
    rank 0 returns every repeat's time and its traffic per average."""
    import torch
    from mpi4py import MPI

    from .allreduce import hsgd_times, mpi_times

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    if args._job == "hosts":
        return _hosts_worker(comm, args)
    out: Dict[str, Any] = {"ranks": comm.size, "calibration": None, "validation": []}
    if comm.size == 2:
        out["calibration"] = {"sizes": list(CALIBRATION_SIZES),
                              "level1": [hsgd_times(comm, n, args)[0] for n in CALIBRATION_SIZES],
                              "mpi": [mpi_times(comm, n, args) for n in CALIBRATION_SIZES]}
    for nodes, k in (VALIDATION[comm.size] if args.validate and not on_hosts(args) else ()):
        for n in _validate_numels(args):
            out["validation"].append(_measure(comm, n, nodes, k, args, MEASURED, None if nodes == 1 else k))
    return out


def _measure(comm, n, nodes, k, args, strategies, ranks_per_node=None, ring=False) -> dict:
    """Every repeat's time of each of ``strategies`` on ``comm`` (``nodes`` x ``k`` ranks), and
    hsgd's traffic per average; the flat ring is ``MPI_Allreduce``, or with ``ring`` a ring
    (:func:`_ring_times`), and then ``MPI_Allreduce`` too (``"MPI Allreduce"``, not modelled).
    Collective over ``comm``."""
    from .allreduce import hsgd_times, mpi_times

    row = {"nodes": nodes, "ranks_per_node": k, "numel": n, "times": {}, "traffic": {}}
    for name in strategies:
        if name == "flat ring" and ring:
            row["times"][name] = _ring_times(comm, n, args)
        elif name == "flat ring":
            row["times"][name] = mpi_times(comm, n, args)
        elif name in ("leader", "sharded"):
            row["times"][name], row["traffic"][name] = hsgd_times(comm, n, args, ranks_per_node=ranks_per_node,
                                                                  inter_node=name)
        elif name == "gossip":
            row["times"][name] = _gossip_times(comm, n, args)
        else:
            row["times"][name] = _box_times(comm, n, args)
    if ring:
        row["times"]["MPI Allreduce"] = mpi_times(comm, n, args)
    return row


def _ring_times(comm, n, args):
    """Every repeat's slowest-rank seconds of a ring allreduce of ``n`` float32 (the model's
    flat ring: p-1 steps of reduce-scatter, p-1 of allgather, each a ``Sendrecv`` of about
    ``n / p`` to the next rank). ``MPI_Allreduce`` is not one: MPICH folds a party count that
    is not a power of two onto one that is (:mod:`hsgd._transport.sums`). Collective."""
    from .allreduce import _timed

    p, rank = comm.Get_size(), comm.Get_rank()
    buf = np.ones(n, np.float32)
    blocks = np.array_split(buf, p)
    scratch = np.empty(blocks[0].size, np.float32)
    right, left = (rank + 1) % p, (rank - 1) % p

    def ring():
        for step in range(p - 1):  # reduce-scatter: block (rank - step - 1) arrives and is added
            out, into = blocks[(rank - step) % p], blocks[(rank - step - 1) % p]
            comm.Sendrecv(out, right, 0, scratch[:into.size], left, 0)
            into += scratch[:into.size]
        for step in range(p - 1):  # allgather: the finished block (rank + 1 - step) goes around
            comm.Sendrecv(blocks[(rank + 1 - step) % p], right, 1, blocks[(rank - step) % p], left, 1)
    return _timed(comm, ring, args)


def _gossip_times(comm, n, args):
    """Every repeat's slowest-rank seconds per step of :class:`hsgd.GossipSGD` (exponential graph,
    every round sending) on a model of ``n`` float32, learning rate 0. A repeat is one cycle of
    the graph's rounds (each round's peers are another distance away, so its step costs
    another time), divided by the round count: the model's mean over the rounds. The warm-up
    is at least one cycle. Collective."""
    import argparse

    import torch

    from hsgd import GossipSGD, Topology

    from .allreduce import _timed

    weights = torch.nn.Parameter(torch.ones(n))
    weights.grad = torch.zeros(n)
    with Topology.from_comm(comm) as topo, \
            GossipSGD(torch.optim.SGD([weights], lr=0.0), named_parameters=[("w", weights)], topology=topo,
                      graph="exponential", theta=0.0) as opt:
        rounds = len(opt.graph.distances)

        def cycle():
            for _ in range(rounds):
                opt.step()
        cycles = argparse.Namespace(repeats=args.repeats, warmup=max(1, args.warmup))
        return [t / rounds for t in _timed(comm, cycle, cycles)]


def _box_times(comm, n, args):
    """Every repeat's slowest-rank seconds of what an :class:`hsgd.AsyncSGD` step moves: every rank
    accumulates ``n`` float32 into a :class:`hsgd.RemoteMemory` sharded over the nodes' first
    ranks, then reads it back, all ranks at once. Collective."""
    import torch

    from hsgd import RemoteMemory

    from .allreduce import _timed

    with RemoteMemory(comm, n) as mem:
        delta, weights = torch.full((n,), -1e-3), torch.empty(n)

        def update():
            mem.accumulate(0, delta)
            mem.read(0, weights)
        times = _timed(comm, update, args)
        comm.Barrier()  # every rank has stopped before the region is freed
    return times


def _fan_times(comm, n, args) -> dict:
    """Every repeat's slowest-rank seconds of every rank sending ``n`` float32 to every other rank
    at once and receiving as much from each (sends started first, then the receives, waited for
    politely, as gossip's round): ``(p-1) n`` floats each way on every rank's link, streams from
    ``p-1`` senders meeting at each. Collective."""
    from hsgd._core.waits import wait_all

    from .allreduce import _timed

    p, rank = comm.Get_size(), comm.Get_rank()
    send, recv = np.ones(n, np.float32), [np.empty(n, np.float32) for _ in range(p - 1)]

    def fan():
        requests = [comm.Isend(send, (rank + d) % p, d) for d in range(1, p)]
        requests += [comm.Irecv(recv[d - 1], (rank - d) % p, d) for d in range(1, p)]
        wait_all(requests)
    return {"bytes_per_link": 4 * n * (p - 1), "times": _timed(comm, fan, args)}


def _wait_idle(comm, poll: float = 1e-3) -> None:
    """A barrier that sleeps between tests instead of spinning (4 ranks share 2 cores here)."""
    import time

    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


def _hosts_worker(comm, args):
    """Across the emulated hosts (the hosts are the nodes): the network between the hosts' first
    ranks, then (``--validate``) every strategy on N x 1 (those ranks) and N x k (all)."""
    from mpi4py import MPI

    from .allreduce import _timed

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    k, first = node.size, node.rank == 0
    node.Free()
    leaders = comm.Split(0 if first else MPI.UNDEFINED, key=comm.rank)
    out: Dict[str, Any] = {"network": None, "validation": []}
    if first:
        nodes = leaders.size
        times = []
        for n in CALIBRATION_SIZES:
            send, recv = np.ones(n, np.float32), np.empty(n, np.float32)
            right, left = (leaders.rank + 1) % nodes, (leaders.rank - 1) % nodes
            times.append(_timed(leaders, lambda s=send, r=recv, to=right, fro=left: leaders.Sendrecv(
                s, to, 0, r, fro, 0), args))
        out["network"] = {"sizes": list(CALIBRATION_SIZES), "times": times}
        if nodes > 2:  # several senders meet at every link: the many-to-many efficiency
            out["network"]["fan"] = _fan_times(leaders, CALIBRATION_SIZES[-1] // (nodes - 1), args)
        for n in (_validate_numels(args) if args.validate else ()):
            out["validation"].append(_measure(leaders, n, nodes, 1, args, HOST_MEASURED, ring=True))
        leaders.Free()
    _wait_idle(comm)  # the others wait, off the cores the first ranks' TCP needs
    nodes = comm.allreduce(1 if first else 0)
    for n in (_validate_numels(args) if args.validate and k > 1 else ()):
        out["validation"].append(_measure(comm, n, nodes, k, args, HOST_MEASURED, ring=True))
    return out
