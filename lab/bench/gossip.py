"""Gossip with adaptive communication: traffic, wall time and accuracy against sync and every-step gossip.

One command::

    python -m lab.bench gossip                       # 4 ranks, 30 epochs
    python -m lab.bench gossip --thetas 0.01 0.03 --epochs 10
    python -m lab.bench gossip --hosts 2 --ranks-per-host 2 --link 100mbit,1gbit --sync-balance \
        --epochs 3 --model mlp --width 1000        # as root: across emulated hosts, a wide MLP

Every run is ``mpiexec -n RANKS python -m hsgd.train`` on the default MNIST-1D run,
one at a time: ``--sync sync``, then ``--sync gossip`` every step and at each of
``--thetas``. Options this command does not know go to ``hsgd.train``. What each
column is, and the wire limit across hosts: docs/benchmark-methods.md (``gossip``).
"""

from __future__ import annotations

import tempfile

from hsgd.bench._harness import Progress, Result, Table, int_at_least

from ._launch import check_hosts_options, placement
from ._links import link_rates, wire_limit
from ._training import Runs, add_run_options

PASSES_ON = True  # options this module does not know go to python -m hsgd.train
COLUMNS = ("run", "intra MB", "inter MB", "traffic vs every-step gossip", "wall s", "train s",
           "train time vs every-step gossip", "final test acc", "best test acc")
WIRE_COLUMNS = ("MB on the busiest link", "wire limit s", "of the wire limit")  # across hosts
FLOOR = "no communication (theta=inf)"


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(2, " (gossip needs peers)"), default=4, help="ranks of every run (4)")
    p.add_argument("--epochs", type=int_at_least(1), default=30, help="epochs of every run (30)")
    p.add_argument("--thetas", type=float, nargs="*", default=[0.03, 0.1, 0.3],
                   help="--gossip-theta values besides 0 (0.03 0.1 0.3)")
    p.add_argument("--graph", default="exponential", help="--gossip-graph (exponential)")
    p.add_argument("--sync-balance", action="store_true",
                   help="also a --sync sync --balance run (load balancing against gossip)")
    add_run_options(p)


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser, min_ranks=2, why=" (gossip needs peers)")
    if "--balance" in extra:
        parser.error("--balance would go to every run, gossip included, which cannot balance: "
                     "use --sync-balance for a --sync sync --balance run")


def run(args, extra) -> Result:
    runs = []
    count = args.warmup + 2 + len(args.thetas) + args.sync_balance + bool(args.hosts)
    with tempfile.TemporaryDirectory() as tmp, placement(args) as where, \
            Progress(count, "lab.bench gossip", args.progress) as progress:
        ranks = args.ranks if where is None else where.ranks
        train = Runs(ranks, tmp, args.cache_dir, extra, args.warmup, progress, where=where)
        epoch_options = ["--epochs", str(args.epochs)]
        gossip = ["--sync", "gossip", "--gossip-graph", args.graph]

        def measure(name, *options):
            runs.append((name, *train(*epoch_options, *options), train.crossed))
        if where is not None:
            measure(FLOOR, *gossip, "--gossip-theta", "inf")
        measure("sync", "--sync", "sync")
        if args.sync_balance:
            measure("sync --balance", "--sync", "sync", "--balance")
        for theta in [0.0, *args.thetas]:
            measure(f"gossip theta={theta:g}", *gossip, "--gossip-theta", str(theta))
        setting = f"{ranks} ranks" if where is None else where.describe()
    reference = next(epochs for name, epochs, _, _ in runs if name == "gossip theta=0")
    every_step = sum(e["intra_bytes"] + e["inter_bytes"] for e in reference)
    every_step_s = sum(e["seconds"] for e in reference)
    wire = any(name == FLOOR for name, *_ in runs)
    if wire:
        floor_s, floor_crossed = next((sum(e["seconds"] for e in epochs), crossed)
                                      for name, epochs, _, crossed in runs if name == FLOOR)
    table = Table(COLUMNS + (WIRE_COLUMNS if wire else ()),
                  title=f"{setting}, {args.epochs} epochs, MNIST-1D, graph {args.graph} {' '.join(extra)}")
    table.notes = ["train s: the epoch records' seconds summed (training and evaluation); wall s: the whole "
                   "job, start-up included"]
    if wire:
        table.notes.append(
            "MB on the busiest link: the larger of sent and received on the busiest host's link over the whole "
            "job (its byte counters); wire limit: the no-communication run's train s (its evaluations' "
            "consensus included) plus the bytes beyond that run's over the link's rate; of the wire limit: "
            "the limit / train s")
    raw = []
    for name, epochs, seconds, crossed in runs:
        intra, inter = (sum(e[k] for e in epochs) for k in ("intra_bytes", "inter_bytes"))
        final, best = epochs[-1]["test_acc"], max(e["test_acc"] for e in epochs)
        train_s = sum(e["seconds"] for e in epochs)
        row = [name, f"{intra / 1e6:.1f}", f"{inter / 1e6:.1f}", f"{(intra + inter) / every_step:.3f}",
               f"{seconds:.0f}", f"{train_s:.1f}", f"{train_s / every_step_s:.2f}",
               f"{100 * final:.2f}%", f"{100 * best:.2f}%"]
        record = {"run": name, "intra_bytes": intra, "inter_bytes": inter, "seconds": seconds,
                  "train_seconds": train_s, "final_test_acc": final, "best_test_acc": best, "epochs": epochs}
        if wire:
            assert crossed is not None and floor_crossed is not None  # runs across hosts count their links
            beyond = [tuple(max(0, a - b) for a, b in zip(run, base)) for run, base in zip(crossed, floor_crossed)]
            limit = wire_limit(beyond, link_rates(args), floor_s, 1)
            busiest = max(max(pair) for pair in crossed)
            row += [f"{busiest / 1e6:.1f}", "-" if limit is None else f"{limit:.1f}",
                    "-" if limit is None else f"{limit / train_s:.0%}"]
            record.update(crossed=crossed, wire_limit_seconds=limit)
        table.rows.append(row)
        raw.append(record)
    return Result([table], raw)
