"""Accuracy, wall time and straggler tolerance of the synchronization modes on the default run.

One command::

    python benchmarks/bench_modes.py          # 4 ranks, sync/elastic/async: both tables
    python benchmarks/bench_modes.py --part straggler --ranks 2 --modes sync async
    python benchmarks/bench_modes.py --part balance --batch-size 2048   # extra flags go to hsgd.train

Every run is ``mpiexec -n RANKS python -m hsgd.train --sync MODE`` on the
default MNIST-1D run (the CNN, AdamW, every other option at its default),
one run at a time; the data set is generated once into ``--cache-dir``
before the first timed run.

- ``accuracy``: one ``--epochs`` run per mode: final and best test accuracy,
  wall time (start-up included).
- ``straggler``: per mode, short runs (``--straggler-epochs``) without and
  with ``--straggler LAST:FACTOR`` (the last rank's steps made FACTOR times
  longer by busy-waiting, so the CPU the others get is the same in both),
  alternating, ``--repeats`` times. A rank's pace is its steps per second
  until its last step of an epoch (the epoch records' ``rank_steps_per_s``,
  averaged over the epochs); the table shows the medians over the repeats of
  the other ranks' mean pace and of the straggler's, and the others' pace
  with the straggler relative to without.
- ``balance``: ``--sync sync --straggler 1:FACTOR`` without and with
  ``--balance``, alternating, ``--repeats`` times, ``--straggler-epochs``
  epochs each. Time per epoch is the median of the run's epoch records'
  ``seconds`` (training and evaluation); the table shows its median over the
  repeats, the speed-up, and the batch shares of the last balanced run's last epoch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["all", "accuracy", "straggler", "balance"], default="all")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30, help="epochs of the accuracy runs")
    p.add_argument("--modes", nargs="+", default=["sync", "elastic", "async"])
    p.add_argument("--factor", type=float, default=3.0, help="the straggler's slowdown")
    p.add_argument("--straggler-epochs", type=int, default=3, help="epochs of each straggler run")
    p.add_argument("--repeats", type=int, default=3, help="runs with and without the straggler, per mode")
    p.add_argument("--cache-dir", default=None, help="where MNIST-1D is generated (default: a temp dir)")
    args, extra = p.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        train = Runs(args.ranks, tmp, args.cache_dir, extra)
        print(f"{args.ranks} ranks, MNIST-1D default run {' '.join(extra)}\n")
        if args.part in ("all", "accuracy"):
            accuracy(train, args)
        if args.part in ("all", "straggler"):
            stragglers(train, args)
        if args.part in ("all", "balance"):
            balance(train, args)


class Runs:
    """``runs(*options)``: one ``mpiexec -n RANKS python -m hsgd.train`` run in a fresh run directory
    under ``tmp``; returns its epoch records and wall seconds. Generates the data set first, untimed."""

    def __init__(self, ranks: int, tmp: str, cache_dir=None, extra=()):
        mpiexec = Path(sys.executable).with_name("mpiexec")
        self.launcher = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(ranks), sys.executable,
                         "-m", "hsgd.train"]
        self.tmp, self.extra, self.count = Path(tmp), list(extra), 0
        self.cache = cache_dir or str(self.tmp / "cache")
        self("--epochs", "1")

    def __call__(self, *options):
        self.count += 1
        run_dir = self.tmp / f"run{self.count}"
        start = time.perf_counter()
        out = subprocess.run([*self.launcher, "--cache-dir", self.cache, "--run-dir", str(run_dir),
                              "--progress", "none", *options, *self.extra], capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if out.returncode:
            sys.exit(f"{' '.join(options)} failed:\n{out.stderr[-4000:]}")
        records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        return [r for r in records if r["event"] == "epoch"], seconds


def accuracy(train, args) -> None:
    rows = []
    for mode in args.modes:
        epochs, seconds = train("--epochs", str(args.epochs), "--sync", mode)
        rows.append((mode, epochs[-1]["test_acc"], max(e["test_acc"] for e in epochs), seconds))
    print(f"Accuracy, {args.epochs} epochs, one run per mode\n")
    print("| --sync | final test acc | best test acc | wall s |")
    print("|---|---|---|---|")
    for mode, final, best, seconds in rows:
        print(f"| {mode} | {100 * final:.2f}% | {100 * best:.2f}% | {seconds:.0f} |")
    print()


def stragglers(train, args) -> None:
    slow = args.ranks - 1
    straggler = f"{slow}:{args.factor:g}"
    paces = {(mode, with_straggler): [] for mode in args.modes for with_straggler in (False, True)}
    walls = {key: [] for key in paces}
    for _ in range(args.repeats):
        for mode in args.modes:
            for with_straggler in (False, True):
                options = ["--epochs", str(args.straggler_epochs), "--sync", mode]
                epochs, seconds = train(*options, *(["--straggler", straggler] if with_straggler else []))
                per_rank = [statistics.mean(e["rank_steps_per_s"][r] for e in epochs) for r in range(args.ranks)]
                others = statistics.mean(per_rank[:slow])
                paces[mode, with_straggler].append((others, per_rank[slow]))
                walls[mode, with_straggler].append(seconds)
    print(f"Straggler: rank {slow} made {args.factor:g}x slower, {args.straggler_epochs} epochs per run, "
          f"median of {args.repeats} runs; steps/s per rank\n")
    print("| --sync | others, alone | others, with straggler | ratio | straggler | wall s alone | "
          "wall s with |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes:
        alone = statistics.median(o for o, _ in paces[mode, False])
        slowed = statistics.median(o for o, _ in paces[mode, True])
        own = statistics.median(s for _, s in paces[mode, True])
        print(f"| {mode} | {alone:.1f} | {slowed:.1f} | {slowed / alone:.2f} | {own:.1f} | "
              f"{statistics.median(walls[mode, False]):.0f} | {statistics.median(walls[mode, True]):.0f} |")


def balance(train, args) -> None:
    options = ["--epochs", str(args.straggler_epochs), "--sync", "sync", "--straggler", f"1:{args.factor:g}"]
    per_epoch = {False: [], True: []}
    for _ in range(args.repeats):
        for balanced in (False, True):
            epochs, _ = train(*options, *(["--balance"] if balanced else []))
            per_epoch[balanced].append(statistics.median(e["seconds"] for e in epochs))
            shares = epochs[-1]["batch_shares"]
    without, with_ = (statistics.median(per_epoch[b]) for b in (False, True))
    print(f"Load balancing: --sync sync, rank 1 made {args.factor:g}x slower, {args.straggler_epochs} epochs "
          f"per run, median of {args.repeats} runs each (alternating)\n")
    print("| run | s per epoch (each run) | median | speed-up | batch shares, last epoch |")
    print("|---|---|---|---|---|")
    print(f"| without --balance | {' '.join(f'{t:.2f}' for t in per_epoch[False])} | {without:.2f} | 1.00 | "
          f"equal |")
    print(f"| --balance | {' '.join(f'{t:.2f}' for t in per_epoch[True])} | {with_:.2f} | "
          f"{without / with_:.2f} | {shares} |")
    print()


if __name__ == "__main__":
    main()
