"""Large-batch experiment: SGD at 256 vs SGD with linear scaling at 4096 vs LARS at 4096.

One command (each run is ``mpiexec -n RANKS python -m hsgd.train``)::

    python benchmarks/lars_experiment.py                    # 4 ranks, 50 000 samples, 30 epochs
    python benchmarks/lars_experiment.py --epochs 10 --lars-lr 4

All three runs train the MNIST-1D CNN on the same generated data (MNIST-1D with
``--samples`` training samples, test split 1/4 of that) for the same number
of epochs, with warm-up then poly decay (power 2) of the learning rate:

* ``sgd-256``: momentum SGD, global batch 256, lr ``--sgd-lr``, 1 warm-up epoch;
* ``sgd-4096-scaled``: the same at batch 4096 with the linear scaling rule
  (lr x 4096/256) and a 5-epoch warm-up (Goyal et al. 2017);
* ``lars-4096``: LARS (trust coefficient 0.001, weight decay 5e-4) at batch
  4096, lr ``--lars-lr``, 5-epoch warm-up (You et al. 2017).

Prints a markdown table of final and best test accuracy and wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def runs(args):
    base = ["--model", "cnn", "--epochs", str(args.epochs), "--mnist1d-samples", str(args.samples),
            "--schedule", "poly", "--momentum", "0.9", "--progress", "none"]
    return {
        "sgd-256": base + ["--optimizer", "sgd", "--batch-size", "256", "--lr", str(args.sgd_lr),
                           "--warmup-epochs", "1"],
        "sgd-4096-scaled": base + ["--optimizer", "sgd", "--batch-size", "4096", "--lr", str(args.sgd_lr),
                                   "--scale-lr", "--base-batch", "256", "--warmup-epochs", "5"],
        "lars-4096": base + ["--optimizer", "lars", "--batch-size", "4096", "--lr", str(args.lars_lr),
                             "--weight-decay", "5e-4", "--warmup-epochs", "5"],
    }


def run_one(name, train_args, args, workdir: Path):
    run_dir = workdir / name
    mpiexec = Path(sys.executable).with_name("mpiexec")
    cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.ranks), sys.executable,
           "-m", "hsgd.train", *train_args, "--run-dir", str(run_dir), "--cache-dir", args.cache_dir]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [e for e in epochs if e["event"] == "epoch"]
    return {"run": name, "final": epochs[-1]["test_acc"], "best": max(e["test_acc"] for e in epochs),
            "train_loss": epochs[-1]["train_loss"], "seconds": seconds, "cmd": " ".join(cmd[1:])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--samples", type=int, default=50000, help="MNIST-1D training samples")
    p.add_argument("--sgd-lr", type=float, default=0.05, help="SGD lr at batch 256")
    p.add_argument("--lars-lr", type=float, default=10.0, help="LARS global lr at batch 4096")
    p.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "hsgd-cache"))
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, train_args in runs(args).items():
            rows.append(run_one(name, train_args, args, Path(tmp)))
            print(f"{name}: final {100 * rows[-1]['final']:.2f}%", file=sys.stderr, flush=True)
    print(f"MNIST-1D, {args.samples} training samples, CNN, {args.ranks} ranks, {args.epochs} epochs\n")
    print("| run | final test acc | best test acc | final train loss | wall s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {100 * r['final']:.2f}% | {100 * r['best']:.2f}% | "
              f"{r['train_loss']:.4f} | {r['seconds']:.0f} |")
    print("\ncommands:\n" + "\n".join(f"    {r['cmd']}" for r in rows))


if __name__ == "__main__":
    main()
