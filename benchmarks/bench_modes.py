"""Accuracy and wall time of the synchronization modes on the default trainer run.

One command::

    python benchmarks/bench_modes.py                       # 4 ranks, sync/elastic/async, 30 epochs
    python benchmarks/bench_modes.py --ranks 2 --epochs 5 --modes sync async

Runs ``mpiexec -n RANKS python -m hsgd.train --sync MODE`` (MNIST-1D, the
default CNN and AdamW, every other option at its default) once per mode, one
after the other, and prints the final and best test accuracy and the wall
time of each run (including start-up and the data set, generated once into
``--cache-dir`` before the first timed run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--modes", nargs="+", default=["sync", "elastic", "async"])
    p.add_argument("--cache-dir", default=None, help="where MNIST-1D is generated (default: a temp dir)")
    args, extra = p.parse_known_args(argv)
    mpiexec = Path(sys.executable).with_name("mpiexec")
    launcher = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.ranks), sys.executable,
                "-m", "hsgd.train"]
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache_dir or str(Path(tmp) / "cache")
        warm = subprocess.run([*launcher, "--cache-dir", cache, "--epochs", "1", "--run-dir",
                               str(Path(tmp) / "warm"), "--progress", "none"], capture_output=True, text=True)
        if warm.returncode:
            sys.exit(f"the warm-up run failed:\n{warm.stderr[-4000:]}")
        rows = []
        for mode in args.modes:
            run = Path(tmp) / mode
            start = time.perf_counter()
            out = subprocess.run([*launcher, "--cache-dir", cache, "--epochs", str(args.epochs), "--sync", mode,
                                  "--run-dir", str(run), "--progress", "none", *extra],
                                 capture_output=True, text=True)
            seconds = time.perf_counter() - start
            if out.returncode:
                sys.exit(f"--sync {mode} failed:\n{out.stderr[-4000:]}")
            epochs = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                      if r["event"] == "epoch"]
            rows.append((mode, epochs[-1]["test_acc"], max(e["test_acc"] for e in epochs), seconds))
    print(f"{args.ranks} ranks, {args.epochs} epochs, MNIST-1D default run {' '.join(extra)}\n")
    print("| --sync | final test acc | best test acc | wall s |")
    print("|---|---|---|---|")
    for mode, final, best, seconds in rows:
        print(f"| {mode} | {100 * final:.2f}% | {100 * best:.2f}% | {seconds:.0f} |")


if __name__ == "__main__":
    main()
