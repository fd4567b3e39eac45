"""Gossip with adaptive communication: traffic, wall time and accuracy against sync and every-step gossip.

One command::

    python -m hsgd.bench gossip                       # 4 ranks, 30 epochs
    python -m hsgd.bench gossip --thetas 0.01 0.03 --epochs 10

Every run is ``mpiexec -n RANKS python -m hsgd.train`` on the default
MNIST-1D run (the CNN, AdamW, every other option at its default), one at a
time, after ``--warmup`` untimed one-epoch runs (the first generates the
data set): ``--sync sync``, then ``--sync gossip`` with ``--gossip-theta 0``
(every step) and each of ``--thetas``. The table gives the bytes all ranks
sent inside and across nodes over the whole run (the epoch records'
``intra_bytes``/``inter_bytes``; for gossip headers included), the traffic
relative to every-step gossip, the wall time (start-up included) and the
final and best test accuracy. Options this command does not know go to
``hsgd.train``: ``--ranks-per-node 2`` makes two virtual nodes, so that some
gossip goes "across nodes".
"""

from __future__ import annotations

import tempfile

from ._harness import Progress, Result, Table, int_at_least
from ._training import Runs

PASSES_ON = True  # options this module does not know go to python -m hsgd.train
COLUMNS = ("run", "intra MB", "inter MB", "traffic vs every-step gossip", "wall s", "final test acc",
           "best test acc")


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(2, " (gossip needs peers)"), default=4, help="ranks of every run (4)")
    p.add_argument("--epochs", type=int_at_least(1), default=30, help="epochs of every run (30)")
    p.add_argument("--thetas", type=float, nargs="*", default=[0.03, 0.1, 0.3],
                   help="--gossip-theta values besides 0 (0.03 0.1 0.3)")
    p.add_argument("--graph", default="exponential", help="--gossip-graph (exponential)")
    p.add_argument("--warmup", type=int_at_least(0), default=1,
                   help="untimed one-epoch runs first; the first generates the data set (1)")
    p.add_argument("--cache-dir", default=None, help="where MNIST-1D is generated (default: a temp dir)")


def run(args, extra) -> Result:
    runs = []
    with tempfile.TemporaryDirectory() as tmp, \
            Progress(args.warmup + 2 + len(args.thetas), "hsgd.bench gossip", args.progress) as progress:
        train = Runs(args.ranks, tmp, args.cache_dir, extra, args.warmup, progress)
        runs.append(("sync", *train("--epochs", str(args.epochs), "--sync", "sync")))
        for theta in [0.0, *args.thetas]:
            epochs, seconds = train("--epochs", str(args.epochs), "--sync", "gossip", "--gossip-graph",
                                    args.graph, "--gossip-theta", str(theta))
            runs.append((f"gossip theta={theta:g}", epochs, seconds))
    every_step = sum(e["intra_bytes"] + e["inter_bytes"] for e in runs[1][1])
    table = Table(COLUMNS, title=f"{args.ranks} ranks, {args.epochs} epochs, MNIST-1D default run, graph "
                  f"{args.graph} {' '.join(extra)}")
    raw = []
    for name, epochs, seconds in runs:
        intra, inter = (sum(e[k] for e in epochs) for k in ("intra_bytes", "inter_bytes"))
        final, best = epochs[-1]["test_acc"], max(e["test_acc"] for e in epochs)
        table.rows.append([name, f"{intra / 1e6:.1f}", f"{inter / 1e6:.1f}", f"{(intra + inter) / every_step:.3f}",
                           f"{seconds:.0f}", f"{100 * final:.2f}%", f"{100 * best:.2f}%"])
        raw.append({"run": name, "intra_bytes": intra, "inter_bytes": inter, "seconds": seconds,
                    "final_test_acc": final, "best_test_acc": best, "epochs": epochs})
    return Result([table], raw)
