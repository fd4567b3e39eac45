"""Under ``mpiexec`` for ``python -m lab.bench race``: every method trained to the target, one after another.

:func:`worker` runs on every rank. Each method (:data:`METHODS`) gets the same MLP (the
trainer's ``mlp``, seeded alike), the same SGD and the same batches (:class:`_Batches`: one
permutation of the training set per epoch, each rank its slice of every global batch); it
trains ``--steps`` steps, and every ``--eval-every`` the clock stops while the ranks score the
test set together (:func:`_accuracy`). The training time is the slowest rank's; what crossed
each host's link is :class:`lab.bench._links.LinkMeter`'s. Rank 0 returns one row per method
and repeat.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._links import LinkMeter, init_gloo, on_hosts

__all__ = ["worker", "METHODS"]

METHODS = ("hsgd fp32", "hsgd fp16", "hsgd powersgd", "hsgd int8", "DDP", "DDP fp16 hook", "DDP powerSGD hook")
FEATURES, CLASSES = 40, 10  # MNIST-1D


class _Batches:
    """Rank ``rank``'s slice of every global batch; a new permutation of the training set each epoch."""

    def __init__(self, x, y, per_rank: int, rank: int, world: int, seed: int = 0):
        self.x, self.y, self.per_rank, self.rank, self.world, self.seed = x, y, per_rank, rank, world, seed
        self.steps_per_epoch = len(x) // (per_rank * world)
        self._epoch, self._order = -1, None

    def __call__(self, step: int):
        import torch

        epoch, at = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + epoch))
        assert self._order is not None  # set just above
        start = (at * self.world + self.rank) * self.per_rank
        index = self._order[start:start + self.per_rank]
        return self.x[index], self.y[index]


def _data(args, comm):
    """The training and test arrays of MNIST-1D (generated once into ``--cache-dir``), as tensors."""
    import h5py
    import torch

    from hsgd.data import ensure_mnist1d

    path = ensure_mnist1d(args.cache_dir, num_samples=int(round(args.samples / 0.8)), comm=comm)
    with h5py.File(path, "r") as f:
        return [torch.from_numpy(f[key][:]) for key in ("x_train", "y_train", "x_test", "y_test")]


def _accuracy(model, x, y, comm) -> float:
    """Test accuracy over every rank's share of the test set (the replicas are the same)."""
    import torch

    with torch.no_grad():
        mine = x[comm.rank::comm.size]
        correct = int((model(mine).argmax(dim=1) == y[comm.rank::comm.size]).sum()) if len(mine) else 0
    return comm.allreduce(correct) / len(x)


def _wrap(method: str, model, inner, topology, args) -> Tuple[Any, Any, Callable[[], None]]:
    """``(network to call, optimizer to step, close)`` of ``method`` around ``model`` and ``inner``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power
    from torch.nn.parallel import DistributedDataParallel

    from hsgd import HierarchicalSGD
    from hsgd.compression import PowerSGD

    if method.startswith("hsgd"):
        name = method.split()[1]
        codec = {"fp32": None, "powersgd": PowerSGD(rank=args.powersgd_rank, start_step=args.start_step)}.get(
            name, name)
        opt = HierarchicalSGD(inner, model, topology=topology, compression=codec)
        return model, opt, opt.close
    # powerSGD_hook waits for its second allreduce inside a callback that runs on one of gloo's two
    # threads: with two buckets in flight both threads wait and the job hangs. So that hook gets one
    # bucket (torch's 25 MB default, asked for explicitly, also caps the first bucket).
    ddp = DistributedDataParallel(model, bucket_cap_mb=25 if method == "DDP powerSGD hook" else None)
    if method == "DDP fp16 hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "DDP powerSGD hook":
        state = power.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                    start_powerSGD_iter=args.start_step, min_compression_rate=2)
        ddp.register_comm_hook(state, power.powerSGD_hook)
    return ddp, inner, lambda: None


def _race(method: str, args, comm, topology, data, meter: Optional[LinkMeter]) -> Dict[str, Any]:
    """Train ``method`` for ``args.steps`` steps; its evaluations, first step at the target, bytes."""
    import torch
    from mpi4py import MPI

    from hsgd._trainer.models import MLP

    x, y, x_test, y_test = data
    torch.manual_seed(0)
    model = MLP(FEATURES, CLASSES, hidden=args.width)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # to zero over the run: the last steps' model is settled, so that the final scores compare
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda t: 1 - t / args.steps)
    net, opt, close = _wrap(method, model, inner, topology, args)
    batches = _Batches(x, y, args.batch, comm.rank, comm.size)
    loss_fn = torch.nn.CrossEntropyLoss()
    evals: List[Tuple[int, float, float]] = []  # (step, training seconds so far, test accuracy)
    reached: Optional[Tuple[int, float]] = None
    trained = 0.0
    comm.Barrier()
    if meter is not None:
        meter.start()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, labels = batches(step - 1)
        opt.zero_grad()
        loss_fn(net(inputs), labels).backward()
        opt.step()
        schedule.step()
        if step % args.eval_every == 0 or step == args.steps:
            trained += time.perf_counter() - start  # the clock stops for the evaluation
            seconds = comm.allreduce(trained, op=MPI.MAX)
            accuracy = _accuracy(model, x_test, y_test, comm)
            evals.append((step, seconds, accuracy))
            if reached is None and accuracy >= args.target:
                reached = (step, seconds)
            start = time.perf_counter()
    crossed = meter.stop() if meter is not None else None
    inter = comm.allreduce(opt.traffic["inter_bytes"]) if hasattr(opt, "traffic") else None
    close()
    return {"method": method, "evals": evals, "reached": reached, "final": evals[-1][2], "crossed": crossed,
            "inter_bytes": inter, "params": sum(p.numel() for p in model.parameters())}


def _first_optimizer_step() -> None:
    """An optimizer's first step imports torch._dynamo (seconds): done once here, untimed."""
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.SGD([p], lr=0.1, momentum=0.9).step()


def worker(args):
    """On every rank: each method, ``--repeats`` times in rotating order; rank 0 returns the rows."""
    import torch
    import torch.distributed
    from mpi4py import MPI

    from hsgd import Topology

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)  # ranks share the cores
    _first_optimizer_step()  # its one-off imports, before any method's clock
    topology = Topology.from_comm(comm, ranks_per_node=None if on_hosts(args) else args.ranks_per_node)
    init_gloo(args, comm, args._port)
    meter = LinkMeter(comm) if on_hosts(args) else None
    data = _data(args, comm)
    rows = []
    methods = list(args.methods)
    for repeat in range(args.repeats):
        shift = repeat % len(methods)
        for method in methods[shift:] + methods[:shift]:
            row = _race(method, args, comm, topology, data, meter)
            rows.append({**row, "repeat": repeat, "ranks": comm.size, "nodes": topology.num_nodes})
    torch.distributed.destroy_process_group()
    topology.close()
    return rows
