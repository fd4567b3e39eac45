"""What a step pays for a checkpoint every N steps, against none.

One command (each run is ``mpiexec -n RANKS python -m hsgd.train``)::

    python -m lab.bench saves                               # 4 ranks, every 0 (none), 50, 10 steps
    python -m lab.bench saves --every 0 20 5 --repeats 3 --width 4096
    python -m lab.bench saves --hosts 2 --ranks-per-host 2   # as root: across emulated hosts

Every run trains the same model for the same steps with ``--save-every N`` (0: only at
the epochs' ends, outside the timed steps), one run at a time, the settings taking turns
for ``--repeats`` rounds. A step's time is its step record's (``--log-every 1``: the
global batch over rank 0's samples per second), the saves inside it; the table gives the
mean over the run's steps (the first ``--skip`` left out: the first steps compile), its
median over the repeats, what that adds to a step against no saves, and per save: the
gather at the step (``gather_s``: the step waits for it) and the write in the background
(``last_write_s``). Options this benchmark does not know go to ``python -m hsgd.train``.
"""

from __future__ import annotations

import tempfile
from statistics import median

from hsgd.bench._harness import Progress, Result, Table, int_at_least

from ._launch import check_hosts_options, placement
from ._training import Runs, add_run_options

PASSES_ON = True


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=4, help="ranks of every run (4)")
    p.add_argument("--every", type=int_at_least(0), nargs="+", default=[0, 50, 10],
                   help="--save-every values to compare, in steps; 0: no save inside the epochs (0 50 10)")
    p.add_argument("--model", default="mlp", help="--model of the runs (mlp)")
    p.add_argument("--width", type=int_at_least(1), default=4096,
                   help="--width of the model: its size sets the checkpoint's (4096: 0.2M parameters)")
    p.add_argument("--epochs", type=int_at_least(1), default=1, help="epochs of every run (1)")
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="rounds of every setting (3)")
    p.add_argument("--skip", type=int_at_least(0), default=10, help="first steps of a run left out (10)")
    add_run_options(p)


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser)
    if 0 not in args.every:
        parser.error("--every needs 0, the run without saves the others are measured against")


def run(args, extra) -> Result:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, placement(args) as where, \
            Progress(args.warmup + args.repeats * len(args.every), "lab.bench saves", args.progress) as progress:
        ranks = args.ranks if where is None else where.ranks
        common = ["--model", args.model, "--width", str(args.width), "--epochs", str(args.epochs),
                  "--log-every", "1", *extra]
        train = Runs(ranks, tmp, args.cache_dir, common, args.warmup, progress, where=where)
        for repeat in range(args.repeats):
            for every in args.every:
                epochs, _ = train("--save-every", str(every))
                batch, ends = train.config["batch_size"], {e["step"] for e in epochs}
                steps = [s for s in train.steps if s["step"] > args.skip]
                saves = [r for r in train.records if r["event"] == "checkpoint" and r["step"] not in ends]
                rows.append({"every": every, "repeat": repeat, "steps": len(steps),
                             "step_s": sum(batch / s["samples_per_s"] for s in steps) / len(steps),
                             "saves": len(saves), "gather_s": [r["gather_s"] for r in saves],
                             "write_s": [r["last_write_s"] for r in saves if r["last_write_s"] is not None]})
        shape = f"{ranks} ranks on one host" if where is None else where.describe()
    base = median(r["step_s"] for r in rows if r["every"] == 0)
    table = Table(("--save-every", "ms per step", "vs none", "saves per run", "ms per save (step's gather)",
                   "ms per save (background write)"),
                  title=f"{shape}; python -m hsgd.train {' '.join(common)}; medians of {args.repeats} runs")
    for every in args.every:
        mine = [r for r in rows if r["every"] == every]
        step_s = median(r["step_s"] for r in mine)
        gathers = [g for r in mine for g in r["gather_s"]]
        writes = [w for r in mine for w in r["write_s"]]
        table.rows.append([str(every) if every else "none", f"{1e3 * step_s:.2f}",
                           f"{100 * (step_s / base - 1):+.1f}%", str(mine[0]["saves"]),
                           f"{1e3 * median(gathers):.1f}" if gathers else "-",
                           f"{1e3 * median(writes):.1f}" if writes else "-"])
    return Result([table], rows)
