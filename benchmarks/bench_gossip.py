"""Gossip with adaptive communication: traffic, wall time and accuracy against sync and every-step gossip.

One command::

    python benchmarks/bench_gossip.py                     # 4 ranks, 30 epochs
    python benchmarks/bench_gossip.py --thetas 0.01 0.03 --epochs 10

Every run is ``mpiexec -n RANKS python -m hsgd.train`` on the default
MNIST-1D run (the CNN, AdamW, every other option at its default), one at a
time: ``--sync sync``, then ``--sync gossip`` with ``--gossip-theta 0``
(every step) and each of ``--thetas``. The table gives the bytes all ranks
sent inside and across nodes over the whole run (the epoch records'
``intra_bytes``/``inter_bytes``; for gossip headers included), the traffic
relative to every-step gossip, the wall time (start-up included) and the
final and best test accuracy. ``--ranks-per-node 2`` (passed through) makes
two virtual nodes, so that some gossip goes "across nodes".
"""

from __future__ import annotations

import argparse
import tempfile

from bench_modes import Runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--thetas", type=float, nargs="+", default=[0.03, 0.1, 0.3])
    p.add_argument("--graph", default="exponential")
    p.add_argument("--cache-dir", default=None, help="where MNIST-1D is generated (default: a temp dir)")
    args, extra = p.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        train = Runs(args.ranks, tmp, args.cache_dir, extra)
        rows = [("sync", *train("--epochs", str(args.epochs), "--sync", "sync"))]
        for theta in [0.0, *args.thetas]:
            epochs, seconds = train("--epochs", str(args.epochs), "--sync", "gossip", "--gossip-graph",
                                    args.graph, "--gossip-theta", str(theta))
            rows.append((f"gossip theta={theta:g}", epochs, seconds))
    every_step = sum(e["intra_bytes"] + e["inter_bytes"] for e in rows[1][1])
    print(f"{args.ranks} ranks, {args.epochs} epochs, MNIST-1D default run, graph {args.graph} "
          f"{' '.join(extra)}\n")
    print("| run | intra MB | inter MB | traffic vs every-step gossip | wall s | final test acc | best test acc |")
    print("|---|---|---|---|---|---|---|")
    for name, epochs, seconds in rows:
        intra, inter = (sum(e[k] for e in epochs) for k in ("intra_bytes", "inter_bytes"))
        print(f"| {name} | {intra / 1e6:.1f} | {inter / 1e6:.1f} | {(intra + inter) / every_step:.3f} | "
              f"{seconds:.0f} | {100 * epochs[-1]['test_acc']:.2f}% | "
              f"{100 * max(e['test_acc'] for e in epochs):.2f}% |")


if __name__ == "__main__":
    main()
