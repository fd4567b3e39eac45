"""Staging: the copies of a GPU's gradients into the shared slot and back, against the copy floor.

hsgd averages in host memory (MPI shared-memory windows). Gradients on a GPU are staged:
before each average every gradient is copied into its place in the rank's slot
(``gather``, device to host), and after it the average is copied back (``scatter``, host to
device). One command (it launches ``mpiexec`` itself, one job per rank count)::

    python -m hsgd.bench staging --device cuda                 # 1 and 2 ranks on each GPU's host
    python -m hsgd.bench staging --device cpu --ranks 2        # staged CPU tensors (zero_copy=False)

For each workload of ``python -m hsgd.bench train`` (its models, their tensors as they are),
a :class:`~hsgd.HierarchicalSGD` on the device times its binding's ``gather()`` and
``scatter()`` with every rank at once (the ranks of a host share its link to the GPU), the
slowest rank's time after a barrier, synchronized with the device at both ends. The floor
is the same bytes moved as one contiguous copy each way, timed the same way (every rank at
once): into and out of pageable memory (what a shared-memory window is) and, on a GPU,
page-locked memory (``pin_memory=True``). The table gives the staging time over each floor
(1.00x: staging is as fast as one flat copy each way). What each column is:
docs/benchmark-methods.md (``staging``).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Dict, List

from ._harness import Result, Table, add_repeat_options, check_device, int_at_least, median, repeat, worker_device

WORKLOADS = ("mlp", "cnn", "deep", "mlp2m")
COLUMNS = ("device", "ranks", "workload", "MB", "tensors", "gather ms", "scatter ms", "staging ms",
           "floor pageable ms", "floor pinned ms", "staging / pageable floor", "staging / pinned floor",
           "D2H pageable GB/s", "H2D pageable GB/s", "D2H pinned GB/s", "H2D pinned GB/s")


def add_arguments(p) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda",
                   help="where the model lives: cuda (GPU local_rank %% count) or cpu (staged with "
                        "zero_copy=False) (cuda)")
    p.add_argument("--ranks", type=int_at_least(1), nargs="+", default=[1, 2], help="rank counts (1 2)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["mlp", "deep"],
                   help="the models of 'hsgd.bench train' (mlp deep)")
    add_repeat_options(p, repeats=20, warmup=3, what="copies of each kind")


def check(args, extra, parser) -> None:
    check_device(args, parser, "measure CPU staging with --device cpu")


def run(args, extra) -> Result:
    from ._launch import run_per_rank_count

    rows = run_per_rank_count("staging", args, timeout=1800, drop_env=["HSGD_RANKS_PER_NODE"])
    notes = sorted({f"the slot is not page-locked: {r['why not page-locked']}" for r in rows
                    if not r["slot page-locked"]})
    return Result([Table(COLUMNS, [_row(r) for r in rows], _title(args, rows), notes)], rows)


def _title(args, rows) -> str:
    where = rows[0]["device_name"] if rows else args.device
    return (f"median of {args.repeats} repeats after {args.warmup} warm-up (slowest rank, all ranks at once), "
            f"float32, {where}, {os.cpu_count()} cores")


def _row(r) -> List[Any]:
    med = {k: median(v) for k, v in r["times"].items()}
    mb = r["bytes"] / 1e6
    staging = med["gather"] + med["scatter"]
    ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
    gbs = lambda s: f"{r['bytes'] / s / 1e9:.1f}"  # noqa: E731  (per rank; every rank copies at once)
    pageable = med["d2h pageable"] + med["h2d pageable"]
    pinned = med["d2h pinned"] + med["h2d pinned"] if "d2h pinned" in med else None
    return [r["device"], r["ranks"], r["workload"], f"{mb:.1f}", r["tensors"], ms(med["gather"]),
            ms(med["scatter"]), ms(staging), ms(pageable), "-" if pinned is None else ms(pinned),
            f"{staging / pageable:.2f}x", "-" if pinned is None else f"{staging / pinned:.2f}x",
            gbs(med["d2h pageable"]), gbs(med["h2d pageable"]),
            "-" if pinned is None else gbs(med["d2h pinned"]), "-" if pinned is None else gbs(med["h2d pinned"])]


def _timed(comm, fn: Callable[[], Any], sync: Callable[[], None], args) -> List[float]:
    """Every timed repeat's slowest-rank seconds of ``fn()``, every rank at once, ``sync()``
    (the device's queue drained) before the clock starts and before it stops."""
    from mpi4py import MPI

    def once():
        sync()
        comm.Barrier()
        start = time.perf_counter()
        fn()
        sync()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return repeat(once, args.repeats, args.warmup)


def _floors(comm, nbytes: int, device, sync, args) -> Dict[str, List[float]]:
    """One contiguous copy of ``nbytes`` each way between ``device`` and pageable host memory
    and, on a GPU, page-locked memory: every repeat's slowest-rank seconds."""
    import torch

    n = nbytes // 4
    source = torch.ones(n, device=device)
    times = {}
    kinds = [("pageable", False)] + ([("pinned", True)] if device.type == "cuda" else [])
    for kind, pinned in kinds:
        host = torch.ones(n, pin_memory=pinned)
        times[f"d2h {kind}"] = _timed(comm, functools.partial(host.copy_, source), sync, args)
        times[f"h2d {kind}"] = _timed(comm, functools.partial(source.copy_, host), sync, args)
    return times


def worker(args) -> List[Dict[str, Any]]:
    """On every rank: each workload's staging and its floors; rank 0 returns one row each."""
    import torch
    from mpi4py import MPI

    from hsgd import HierarchicalSGD, Topology

    from ._train_worker import _model

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    topo = Topology.from_comm(comm)  # the host's ranks: one node per host
    device, sync, name = worker_device(args.device, comm)
    rows = []
    for workload in args.workloads:
        model = _model(workload).to(device)
        opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.0), model, topology=topo,
                              zero_copy=False)  # CUDA tensors are staged anyway; CPU ones too, here
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        binding = opt.engine.binding
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        times = {"gather": _timed(comm, binding.gather, sync, args),
                 "scatter": _timed(comm, binding.scatter, sync, args),
                 **_floors(comm, nbytes, device, sync, args)}
        opt.close()
        pinned = binding.staging.pinned if device.type == "cuda" else "not on a GPU"
        rows.append({"device": args.device, "device_name": name, "ranks": comm.size, "workload": workload,
                     "bytes": nbytes, "tensors": len(list(model.parameters())), "times": times,
                     "runs": len(binding.staging.runs), "slot page-locked": pinned is None,
                     "why not page-locked": pinned})
    topo.close()
    return rows
