"""Large batches: SGD at 256 vs SGD with linear scaling at 4096 vs LARS at 4096.

One command (each run is ``mpiexec -n RANKS python -m hsgd.train``)::

    python -m hsgd.bench lars                         # 4 ranks, 50 000 samples, 30 epochs
    python -m hsgd.bench lars --epochs 10 --lars-lr 4

All runs train the MNIST-1D CNN on the same generated data (MNIST-1D with
``--samples`` training samples, test split 1/4 of that) for the same number
of epochs, with warm-up then poly decay (power 2) of the learning rate:

* ``sgd-256``: momentum SGD, global batch 256, lr ``--sgd-lr``, 1 warm-up epoch;
* ``sgd-4096-scaled``: the same at batch 4096 with the linear scaling rule
  (lr x 4096/256) and a 5-epoch warm-up (Goyal et al. 2017);
* ``lars-4096``: LARS (trust coefficient 0.001, weight decay 5e-4) at batch
  4096, lr ``--lars-lr``, 5-epoch warm-up (You et al. 2017).

One run each (``--runs`` picks some), after ``--warmup`` untimed one-epoch
runs of the first (0 by default: the first run generates the data set
unless ``--cache-dir`` holds it). The table gives final and best test accuracy,
final training loss and wall time (start-up included); the notes give every
run's command.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ._harness import Progress, Result, Table, int_at_least, positive_float
from ._training import Runs

RUNS = ("sgd-256", "sgd-4096-scaled", "lars-4096")
COLUMNS = ("run", "final test acc", "best test acc", "final train loss", "wall s")


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=4, help="ranks of every run (4)")
    p.add_argument("--epochs", type=int_at_least(1), default=30, help="epochs of every run (30)")
    p.add_argument("--samples", type=int_at_least(1), default=50000, help="MNIST-1D training samples (50000)")
    p.add_argument("--sgd-lr", type=positive_float, default=0.05, help="SGD lr at batch 256 (0.05)")
    p.add_argument("--lars-lr", type=positive_float, default=10.0, help="LARS global lr at batch 4096 (10)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="which runs (all three)")
    p.add_argument("--warmup", type=int_at_least(0), default=0, help="untimed one-epoch runs first (0)")
    p.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "hsgd-cache"),
                   help="where MNIST-1D is generated and kept ($TMPDIR/hsgd-cache)")


def train_options(args) -> dict:
    base = ["--model", "cnn", "--epochs", str(args.epochs), "--mnist1d-samples", str(args.samples),
            "--schedule", "poly", "--momentum", "0.9"]
    return {
        "sgd-256": base + ["--optimizer", "sgd", "--batch-size", "256", "--lr", str(args.sgd_lr),
                           "--warmup-epochs", "1"],
        "sgd-4096-scaled": base + ["--optimizer", "sgd", "--batch-size", "4096", "--lr", str(args.sgd_lr),
                                   "--scale-lr", "--base-batch", "256", "--warmup-epochs", "5"],
        "lars-4096": base + ["--optimizer", "lars", "--batch-size", "4096", "--lr", str(args.lars_lr),
                             "--weight-decay", "5e-4", "--warmup-epochs", "5"],
    }


def run(args, extra) -> Result:
    options = train_options(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            Progress(args.warmup + len(args.runs), "hsgd.bench lars", args.progress) as progress:
        train = Runs(args.ranks, tmp, args.cache_dir, warmup=args.warmup, progress=progress,
                     warmup_options=options[args.runs[0]])
        for name in args.runs:
            epochs, seconds = train(*options[name])
            rows.append({"run": name, "final": epochs[-1]["test_acc"], "best": max(e["test_acc"] for e in epochs),
                         "train_loss": epochs[-1]["train_loss"], "seconds": seconds,
                         "cmd": " ".join(train.commands[-1][1:])})
    table = Table(COLUMNS, title=f"MNIST-1D, {args.samples} training samples, CNN, {args.ranks} ranks, "
                  f"{args.epochs} epochs", notes=["commands:", *(f"    {r['cmd']}" for r in rows)])
    for r in rows:
        table.rows.append([r["run"], f"{100 * r['final']:.2f}%", f"{100 * r['best']:.2f}%", f"{r['train_loss']:.4f}",
                           f"{r['seconds']:.0f}"])
    return Result([table], rows)
