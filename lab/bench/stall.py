"""What the stall inspector costs a normal step: HierarchicalSGD with it on and off, side by side.

One command (it launches ``mpiexec -n RANKS`` itself)::

    python -m lab.bench stall                        # 4 ranks, an MLP of 1M parameters
    python -m lab.bench stall --params 25000000 --steps 20
    python -m lab.bench stall --hosts 2 --ranks-per-host 1 --link 1gbit --params 2000000   # as root

Two ``HierarchicalSGD`` wrappers over copies of one MLP, one with the
inspector (``stall_timeout=60``: a store into the rank's own slot of the
board before each synchronization, a watchdog thread, and across hosts a
progress thread that serves the board) and one without (``stall_timeout=0``), take turns:
``--steps`` training steps each (forward, backward, averaging, SGD update,
on a fixed batch), ``--repeats`` times after ``--warmup`` untimed turns.
The table gives rank 0's median step time of each and their ratio.
"""

from __future__ import annotations

import time

from hsgd.bench._harness import Progress, Result, Table, add_repeat_options, int_at_least, median, repeat

from ._launch import add_hosts_options, check_hosts_options, placement, run_workers

COLUMNS = ("stall inspector", "ms per step (each repeat)", "median", "on / off")
TIMEOUTS = {"off (stall_timeout=0)": 0.0, "on (stall_timeout=60)": 60.0}


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=4, help="ranks of the job (4)")
    p.add_argument("--params", type=int_at_least(1), default=1_000_000, help="parameters of the MLP, about (1000000)")
    p.add_argument("--steps", type=int_at_least(1), default=100, help="steps per turn (100)")
    add_repeat_options(p, repeats=7, warmup=0, what="turns of each wrapper")
    p.add_argument("--batch", type=int_at_least(1), default=32, help="samples in the fixed batch (32)")
    add_hosts_options(p)


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser)


def run(args, extra) -> Result:
    with Progress(1, "lab.bench stall", args.progress) as progress, placement(args) as where:
        raw = run_workers("stall", args.ranks, args._argv, where=where)
        raw["where"] = "this host" if where is None else where.describe()
        progress.step(raw["where"])
    off = median(raw["seconds_per_step"]["off (stall_timeout=0)"])
    table = Table(COLUMNS, title=f"{raw['ranks']} ranks on {raw['where']}, MLP of {raw['params']} parameters, "
                  f"batch {args.batch}, "
                  f"{args.steps} steps x {args.repeats} repeats after {args.warmup} warm-up, alternating; "
                  "rank 0's median step time")
    for name, times in raw["seconds_per_step"].items():
        each = " ".join(f"{1e3 * v:.2f}" for v in times)
        table.rows.append([name, each, f"{1e3 * median(times):.3f}", f"{median(times) / off:.3f}"])
    return Result([table], raw)


def worker(args):
    """On every rank: the two wrappers take turns; rank 0 returns its seconds per step of each turn."""
    import torch
    from mpi4py import MPI

    from hsgd import HierarchicalSGD
    from hsgd.faults import StallSettings

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    width = max(8, int((args.params / 2) ** 0.5))
    runs = {}
    for name, timeout in TIMEOUTS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
        opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=1e-3), model,
                              stall=StallSettings(timeout=timeout))
        runs[name] = (model, opt)
    x = torch.randn(args.batch, width)

    def turn(model, opt):
        comm.Barrier()  # both wrappers start their turn with every rank ready
        start = time.perf_counter()
        for _ in range(args.steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return (time.perf_counter() - start) / args.steps

    rounds = repeat(lambda: {name: turn(*run) for name, run in runs.items()}, args.repeats, args.warmup)
    params = sum(p.numel() for p in runs["off (stall_timeout=0)"][0].parameters())
    for _, opt in runs.values():
        opt.close()
    return {"ranks": comm.Get_size(), "params": params,
            "seconds_per_step": {name: [r[name] for r in rounds] for name in runs}}
