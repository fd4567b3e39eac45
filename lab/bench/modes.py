"""Accuracy, wall time and straggler tolerance of the synchronization modes on the default run.

One command::

    python -m lab.bench modes            # 4 ranks, sync/elastic/async: every part
    python -m lab.bench modes --part straggler --ranks 2 --modes sync async
    python -m lab.bench modes --part balance --batch-size 2048   # unknown options go to hsgd.train
    python -m lab.bench modes --part accuracy --hosts 2 --ranks-per-host 2   # as root: across hosts

Every run is ``mpiexec -n RANKS python -m hsgd.train --sync MODE`` on the default
MNIST-1D run, one at a time. ``accuracy``: one run per mode; ``straggler``: short runs
without and with one rank slowed by ``--straggler``; ``balance``: ``--sync sync`` with a
straggler, without and with ``--balance``. What each column is: docs/benchmark-methods.md (``modes``).
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Dict, List

from hsgd.bench._harness import Progress, Result, Table, int_at_least, median, positive_float

from ._launch import check_hosts_options, placement
from ._training import Runs, add_run_options

PASSES_ON = True  # options this module does not know go to python -m hsgd.train
PARTS = ("accuracy", "straggler", "balance")


def add_arguments(p) -> None:
    p.add_argument("--part", choices=["all", *PARTS], default="all", help="which table (all)")
    p.add_argument("--ranks", type=int_at_least(2, " (a straggler and another rank)"), default=4,
                   help="ranks of every run (4)")
    p.add_argument("--epochs", type=int_at_least(1), default=30, help="epochs of the accuracy runs (30)")
    p.add_argument("--modes", nargs="+", default=["sync", "elastic", "async"], help="--sync modes (sync elastic async)")
    p.add_argument("--factor", type=positive_float, default=3.0, help="the straggler's slowdown (3)")
    p.add_argument("--straggler-epochs", type=int_at_least(1), default=3, help="epochs of each straggler run (3)")
    p.add_argument("--repeats", type=int_at_least(1), default=3,
                   help="runs with and without the straggler, per mode (3)")
    add_run_options(p)


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser, min_ranks=2, why=" (a straggler and another rank)")


def run(args, extra) -> Result:
    parts = PARTS if args.part == "all" else (args.part,)
    count = {"accuracy": len(args.modes), "straggler": 2 * len(args.modes) * args.repeats,
             "balance": 2 * args.repeats}
    tables, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp, placement(args) as where, \
            Progress(args.warmup + sum(count[p] for p in parts), "lab.bench modes", args.progress) as progress:
        ranks = args.ranks if where is None else where.ranks
        train = Runs(ranks, tmp, args.cache_dir, extra, args.warmup, progress, where=where)
        for part in parts:
            table, raw[part] = PART_RUNS[part](train, args)
            tables.append(table)
        ranks = f"{ranks} ranks" if where is None else where.describe()
    tables[0].title = f"{ranks}, MNIST-1D default run {' '.join(extra)}\n\n{tables[0].title}"
    return Result(tables, raw)


def accuracy(train, args):
    rows = []
    for mode in args.modes:
        epochs, seconds = train("--epochs", str(args.epochs), "--sync", mode)
        rows.append({"mode": mode, "final": epochs[-1]["test_acc"], "best": max(e["test_acc"] for e in epochs),
                     "seconds": seconds})
    table = Table(("--sync", "final test acc", "best test acc", "wall s"),
                  title=f"Accuracy, {args.epochs} epochs, one run per mode")
    for r in rows:
        table.rows.append([r["mode"], f"{100 * r['final']:.2f}%", f"{100 * r['best']:.2f}%", f"{r['seconds']:.0f}"])
    return table, rows


def stragglers(train, args):
    slow = args.ranks - 1
    straggler = f"{slow}:{args.factor:g}"
    runs = []
    for _ in range(args.repeats):
        for mode in args.modes:
            for with_straggler in (False, True):
                options = ["--epochs", str(args.straggler_epochs), "--sync", mode]
                epochs, seconds = train(*options, *(["--straggler", straggler] if with_straggler else []))
                per_rank = [statistics.mean(e["rank_steps_per_s"][r] for e in epochs) for r in range(args.ranks)]
                runs.append({"mode": mode, "straggler": with_straggler, "others": statistics.mean(per_rank[:slow]),
                             "slow": per_rank[slow], "seconds": seconds})
    table = Table(("--sync", "others, alone", "others, with straggler", "ratio", "straggler", "wall s alone",
                   "wall s with"),
                  title=f"Straggler: rank {slow} made {args.factor:g}x slower, {args.straggler_epochs} epochs per "
                        f"run, median of {args.repeats} runs; steps/s per rank")
    for mode in args.modes:
        alone = [r for r in runs if r["mode"] == mode and not r["straggler"]]
        slowed = [r for r in runs if r["mode"] == mode and r["straggler"]]
        others, with_ = median(r["others"] for r in alone), median(r["others"] for r in slowed)
        table.rows.append([mode, f"{others:.1f}", f"{with_:.1f}", f"{with_ / others:.2f}",
                           f"{median(r['slow'] for r in slowed):.1f}", f"{median(r['seconds'] for r in alone):.0f}",
                           f"{median(r['seconds'] for r in slowed):.0f}"])
    return table, runs


def balance(train, args):
    options = ["--epochs", str(args.straggler_epochs), "--sync", "sync", "--straggler", f"1:{args.factor:g}"]
    per_epoch: Dict[bool, List[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for balanced in (False, True):
            epochs, _ = train(*options, *(["--balance"] if balanced else []))
            per_epoch[balanced].append(median(e["seconds"] for e in epochs))
            shares = epochs[-1]["batch_shares"]
    without, with_ = (median(per_epoch[b]) for b in (False, True))
    table = Table(("run", "s per epoch (each run)", "median", "speed-up", "batch shares, last epoch"),
                  title=f"Load balancing: --sync sync, rank 1 made {args.factor:g}x slower, {args.straggler_epochs} "
                        f"epochs per run, median of {args.repeats} runs each (alternating)")
    table.rows.append(["without --balance", " ".join(f"{t:.2f}" for t in per_epoch[False]), f"{without:.2f}",
                       "1.00", "equal"])
    table.rows.append(["--balance", " ".join(f"{t:.2f}" for t in per_epoch[True]), f"{with_:.2f}",
                       f"{without / with_:.2f}", str(shares)])
    return table, {"seconds_per_epoch": {"without": per_epoch[False], "with": per_epoch[True]},
                   "batch_shares": shares}


PART_RUNS = {"accuracy": accuracy, "straggler": stragglers, "balance": balance}
