"""Hierarchical DiLoCo against synchronous SGD and plain local SGD, at equal steps.

One command (each run is ``mpiexec -n RANKS python -m hsgd.train``)::

    python -m lab.bench diloco                         # 4 ranks as 2 virtual nodes, the gpt workload
    python -m lab.bench diloco --period 4 8 --fragments 4 --epochs 2
    python -m lab.bench diloco --hosts 2 --ranks-per-host 2 --link 1gbit   # as root: across hosts
    python -m lab.bench diloco --methods sync diloco --outer-compression none int8 int4 --png gap.png

Every run trains the same model on the same data for the same number of steps, one
run at a time: ``sync``, ``local H``, ``diloco H`` and ``streaming H/F`` (``--methods``),
DiLoCo's once per ``--outer-compression``, ``--outer-lr`` and ``--outer-momentum`` (a sweep);
options this benchmark does not know go to ``python -m hsgd.train``. The table gives the
final validation loss and the inter-node bytes against ``sync``'s; ``--png`` draws each
DiLoCo run's gap to ``sync`` at every epoch's evaluation against its outer rounds. What
each run and column is: docs/benchmark-methods.md (``diloco``).
"""

from __future__ import annotations

import tempfile
from itertools import product
from pathlib import Path

from hsgd.bench._harness import Progress, Result, Table, int_at_least, positive_float
from hsgd.compression import OUTER_COMPRESSIONS

from ._launch import check_hosts_options, placement
from ._training import Runs, add_run_options

PASSES_ON = True  # options this module does not know go to python -m hsgd.train
METHODS = ("sync", "local", "diloco", "streaming")
WORKLOAD = ("--model", "gpt")  # hsgd.train's defaults for the rest (data: the Python standard library)


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(2), default=4, help="ranks of every run (4)")
    p.add_argument("--ranks-per-node", type=int_at_least(1), default=2, help="virtual node size (2)")
    p.add_argument("--epochs", type=int_at_least(1), default=1, help="epochs of every run (1)")
    p.add_argument("--period", type=int_at_least(1), nargs="+", default=[16],
                   help="global periods H to compare, in steps (16)")
    p.add_argument("--fragments", type=int_at_least(1), default=4, help="streaming DiLoCo's fragments (4)")
    p.add_argument("--delay", type=int_at_least(0), default=1, help="--fragment-sync-delay of the streaming runs (1)")
    p.add_argument("--outer-lr", type=positive_float, nargs="+", default=[0.7],
                   help="DiLoCo's outer lrs, one run per lr and momentum (0.7)")
    p.add_argument("--outer-momentum", type=float, nargs="+", default=[0.9],
                   help="DiLoCo's outer Nesterov momenta, one run per lr and momentum (0.9)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help=f"the runs to make, sync always first ({' '.join(METHODS)})")
    p.add_argument("--outer-compression", nargs="+", default=["none"], choices=OUTER_COMPRESSIONS,
                   help="the pseudo-gradients' compressions of the diloco and streaming runs, one run each (none)")
    p.add_argument("--png", type=Path, default=None, metavar="PATH",
                   help="draw each DiLoCo run's validation loss gap to sync against its outer rounds here")
    add_run_options(p, data="the token data set")


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser, min_ranks=2, why=" (two nodes)")
    if not all(0 < m < 1 for m in args.outer_momentum):
        parser.error(f"--outer-momentum must be in (0, 1) (Nesterov), got {args.outer_momentum}")
    if any(args.delay >= h for h in args.period):
        parser.error(f"--delay {args.delay} must be below every --period {args.period}")
    if args.png is not None and not args.png.parent.is_dir():
        parser.error(f"argument --png: the directory {args.png.parent} does not exist")


def _runs(args):
    """``(name, period or None, trainer options)`` of every run, ``sync`` first."""
    yield "sync", None, ["--sync", "sync"]
    for h in args.period:
        periods = ["--intra-period", "1", "--inter-period", str(h)]
        if "local" in args.methods:
            yield f"local {h}", h, ["--sync", "local", *periods]
        # a sweep names each run's outer lr and momentum; one setting keeps the plain names
        swept = len(args.outer_lr) * len(args.outer_momentum) > 1
        for codec, lr, momentum in product(args.outer_compression, args.outer_lr, args.outer_momentum):
            diloco = ["--sync", "diloco", *periods, "--outer-lr", str(lr),
                      "--outer-momentum", str(momentum), "--outer-compression", codec]
            tag = ("" if codec == "none" else f" {codec}") + (f" lr{lr:g} m{momentum:g}" if swept else "")
            if "diloco" in args.methods:
                yield f"diloco {h}{tag}", h, diloco
            if "streaming" in args.methods:
                yield f"streaming {h}/{args.fragments}{tag}", h, [*diloco, "--fragments", str(args.fragments),
                                                                  "--fragment-sync-delay", str(args.delay)]


def _draw(rows, png: Path) -> None:
    """Each outer-step run's gap to sync at every epoch's evaluation, against its outer rounds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sync = {step: loss for step, loss in rows[0]["curve"]}
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in rows[1:]:
        if r["period"] is None or r["run"].startswith("local"):
            continue
        points = [(step / r["period"], 100 * (loss / sync[step] - 1)) for step, loss in r["curve"] if step in sync]
        ax.plot(*zip(*points), marker="o", label=r["run"])
    ax.axhline(2.0, color="gray", linestyle="--", linewidth=1, label="2% (target)")
    ax.set_xlabel("outer rounds")
    ax.set_ylabel("validation loss above sync (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def run(args, extra) -> Result:
    runs = list(_runs(args))
    rows = []
    with tempfile.TemporaryDirectory() as tmp, placement(args) as where, \
            Progress(args.warmup + len(runs), "lab.bench diloco", args.progress) as progress:
        ranks = args.ranks if where is None else where.ranks
        common = [*WORKLOAD, "--epochs", str(args.epochs), "--log-every", "1", *extra]
        if where is None:
            common += ["--ranks-per-node", str(args.ranks_per_node)]
        train = Runs(ranks, tmp, args.cache_dir, common, args.warmup, progress, where=where)
        for name, period, options in runs:
            epochs, seconds = train(*options)
            last = epochs[-1]
            rows.append({"run": name, "options": options, "period": period, "val_loss": last["test_loss"],
                         "curve": [(e["step"], e["test_loss"]) for e in epochs],
                         "bits_per_byte": last.get("test_bpb"), "steps": last["step"],
                         "inter_bytes": sum(e["inter_bytes"] for e in epochs),
                         "peak_step_bytes": max((s.get("own_inter_bytes", 0) for s in train.steps), default=0),
                         "seconds": seconds, "link_bytes": train.crossed})
        shape = f"{ranks} ranks, nodes of {args.ranks_per_node}" if where is None else where.describe()
    sync = rows[0]
    table = Table(("run", "steps", "val loss", "vs sync", "bits/byte", "inter-node MB", "sync / this",
                   "peak MB per step (rank 0)", "wall s"),
                  title=f"{shape}; {' '.join(common)}; one run each")
    for r in rows:
        ratio = sync["inter_bytes"] / r["inter_bytes"] if r["inter_bytes"] else float("inf")
        bpb = "-" if r["bits_per_byte"] is None else f"{r['bits_per_byte']:.3f}"
        table.rows.append([r["run"], str(r["steps"]), f"{r['val_loss']:.4f}",
                           f"{100 * (r['val_loss'] / sync['val_loss'] - 1):+.2f}%", bpb,
                           f"{r['inter_bytes'] / 1e6:.1f}", f"{ratio:.1f}x", f"{r['peak_step_bytes'] / 1e6:.2f}",
                           f"{r['seconds']:.0f}"])
    if args.png is not None:
        _draw(rows, args.png)
    return Result([table], rows)
