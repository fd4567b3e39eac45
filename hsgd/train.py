"""Train a model with HierarchicalSGD: the main job.

Launch::

    mpiexec -n 4 python -m hsgd.train
    mpiexec -n 4 python -m hsgd.train --steps 300 --ranks-per-node 2 --inter-node sharded

This first version trains a small MLP on a synthetic regression task (a fixed
random teacher network, 16 inputs, 3 outputs, label noise 0.1) so that the
averaging path runs end to end; every rank draws its own shard of each global
batch. Rank 0 prints the loss every ``--log-every`` steps and the final test
MSE next to the noise floor (the MSE of the teacher itself).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from . import HierarchicalSGD, Topology

logger = logging.getLogger("hsgd.train")

NOISE = 0.1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hsgd.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--batch-size", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--inter-node", choices=["leader", "sharded"], default="leader")
    p.add_argument("--average", choices=["gradients", "parameters"], default="gradients")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="virtual node size (default: physical nodes)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "log_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be positive, got {args.lr}")
    return args


def teacher_data(n: int, gen: torch.Generator):
    torch.manual_seed(12345)  # the teacher is the same on every rank
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    x = torch.randn(n, 16, generator=gen)
    with torch.no_grad():
        y = teacher(x) + NOISE * torch.randn(n, 3, generator=gen)
    return x, y


def main(argv=None) -> int:
    args = parse_args(argv)
    topo = Topology.from_comm(ranks_per_node=args.ranks_per_node)
    is_main = topo.rank == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format=f"[rank {topo.rank}] %(message)s")
    if args.batch_size % topo.size:
        if is_main:
            logger.error("--batch-size %d must be a multiple of the %d ranks", args.batch_size, topo.size)
        return 2
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), model,
                          topology=topo, inter_node=args.inter_node, average=args.average)
    logger.info("%s", opt)
    gen = torch.Generator().manual_seed(args.seed + 1000 * topo.rank)  # each rank its own shard
    local = args.batch_size // topo.size
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = teacher_data(local, gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if is_main and (step % args.log_every == 0 or step == args.steps - 1):
            logger.info("step %4d  loss %.4f", step, loss.item())
    x, y = teacher_data(4096, torch.Generator().manual_seed(999))
    with torch.no_grad():
        test_mse = torch.nn.functional.mse_loss(model(x), y).item()
    logger.info("test MSE %.4f (noise floor %.4f), %.1f s", test_mse, NOISE ** 2,
                time.perf_counter() - start)
    opt.close()
    topo.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
