"""Large batches: SGD at 256 vs SGD with linear scaling at 4096 vs LARS at 4096.

One command (each run is ``mpiexec -n RANKS python -m hsgd.train``)::

    python -m lab.bench lars                         # 4 ranks, 50 000 samples
    python -m lab.bench lars --epochs-4096 60 --lars-warmup 10

All runs train the MNIST-1D CNN on the same generated data with warm-up then poly
decay: ``sgd-256``, ``sgd-4096-scaled`` (the linear scaling rule) and ``lars-4096``,
whose defaults are those the search in docs/benchmarks-appendix.md found. LARS gives
biases (1-D tensors) the plain global lr, so a large lr with a small trust coefficient
destabilizes them: keep lr small and raise the coefficient. What each run and column
is: docs/benchmark-methods.md (``lars``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hsgd.bench._harness import Progress, Result, Table, int_at_least, positive_float

from ._training import Runs

RUNS = ("sgd-256", "sgd-4096-scaled", "lars-4096")
COLUMNS = ("run", "epochs", "steps", "final test acc", "best test acc", "final train loss", "wall s")
# The LARS settings found by the search in docs/benchmarks.md ("Large batches").
EPOCHS_4096, LARS_LR, TRUST, LARS_WARMUP, LARS_WD = 30, 0.5, 0.08, 5.0, 0.0
SCALED_WARMUP = 5  # epochs of sgd-4096-scaled's warm-up (Goyal et al.)


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=4, help="ranks of every run (4)")
    p.add_argument("--epochs", type=int_at_least(1), default=30, help="epochs of sgd-256 (30)")
    p.add_argument("--epochs-4096", type=int_at_least(1), default=EPOCHS_4096, metavar="N",
                   help=f"epochs of the batch-4096 runs ({EPOCHS_4096})")
    p.add_argument("--samples", type=int_at_least(1), default=50000, help="MNIST-1D training samples (50000)")
    p.add_argument("--sgd-lr", type=positive_float, default=0.05, help="SGD lr at batch 256 (0.05)")
    p.add_argument("--lars-lr", type=positive_float, default=LARS_LR, metavar="LR",
                   help=f"LARS global lr at batch 4096 ({LARS_LR:g})")
    p.add_argument("--trust-coefficient", type=positive_float, default=TRUST, metavar="ETA",
                   help=f"LARS trust coefficient eta ({TRUST:g})")
    p.add_argument("--lars-warmup", type=positive_float, default=LARS_WARMUP, metavar="EPOCHS",
                   help=f"LARS warm-up epochs ({LARS_WARMUP:g})")
    p.add_argument("--lars-weight-decay", type=float, default=LARS_WD, metavar="WD",
                   help=f"LARS weight decay ({LARS_WD:g})")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="which runs (all three)")
    p.add_argument("--warmup", type=int_at_least(0), default=0, help="untimed one-epoch runs first (0)")
    p.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "hsgd-cache"),
                   help="where MNIST-1D is generated and kept ($TMPDIR/hsgd-cache)")


def check(args, extra, parser) -> None:
    """parser.error() on warm-ups that do not fit in their runs (before anything is launched)."""
    if "lars-4096" in args.runs and args.lars_warmup >= args.epochs_4096:
        parser.error(f"argument --lars-warmup: {args.lars_warmup:g} warm-up epochs do not fit in "
                     f"--epochs-4096 {args.epochs_4096}: use fewer, or more epochs")
    if "sgd-4096-scaled" in args.runs and SCALED_WARMUP >= args.epochs_4096:
        parser.error(f"argument --epochs-4096: sgd-4096-scaled warms up for {SCALED_WARMUP} epochs; "
                     f"use more than {SCALED_WARMUP}")
    if args.lars_weight_decay < 0:
        parser.error(f"argument --lars-weight-decay: {args.lars_weight_decay:g} is negative: use 0 or more")


def train_options(args) -> dict:
    base = ["--model", "cnn", "--mnist1d-samples", str(args.samples), "--schedule", "poly", "--momentum", "0.9"]
    large = base + ["--epochs", str(args.epochs_4096), "--batch-size", "4096"]
    return {
        "sgd-256": base + ["--epochs", str(args.epochs), "--optimizer", "sgd", "--batch-size", "256",
                           "--lr", str(args.sgd_lr), "--warmup-epochs", "1"],
        "sgd-4096-scaled": large + ["--optimizer", "sgd", "--lr", str(args.sgd_lr), "--scale-lr",
                                    "--base-batch", "256", "--warmup-epochs", str(SCALED_WARMUP)],
        "lars-4096": large + ["--optimizer", "lars", "--lr", f"{args.lars_lr:g}",
                              "--trust-coefficient", f"{args.trust_coefficient:g}",
                              "--weight-decay", f"{args.lars_weight_decay:g}",
                              "--warmup-epochs", f"{args.lars_warmup:g}"],
    }


def run(args, extra) -> Result:
    options = train_options(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            Progress(args.warmup + len(args.runs), "lab.bench lars", args.progress) as progress:
        train = Runs(args.ranks, tmp, args.cache_dir, warmup=args.warmup, progress=progress,
                     warmup_options=options[args.runs[0]])
        for name in args.runs:
            epochs, seconds = train(*options[name])
            rows.append({"run": name, "epochs": len(epochs), "steps": epochs[-1]["step"],
                         "final": epochs[-1]["test_acc"], "best": max(e["test_acc"] for e in epochs),
                         "train_loss": epochs[-1]["train_loss"], "seconds": seconds,
                         "cmd": " ".join(train.commands[-1][1:])})
    table = Table(COLUMNS, title=f"MNIST-1D, {args.samples} training samples, CNN, {args.ranks} ranks "
                  "(steps: optimizer steps, one gradient allreduce each)",
                  notes=["commands:", *(f"    {r['cmd']}" for r in rows)])
    for r in rows:
        table.rows.append([r["run"], str(r["epochs"]), str(r["steps"]), f"{100 * r['final']:.2f}%",
                           f"{100 * r['best']:.2f}%", f"{r['train_loss']:.4f}", f"{r['seconds']:.0f}"])
    return Result([table], rows)
