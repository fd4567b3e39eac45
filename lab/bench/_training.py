"""Training runs for the benchmarks that measure ``python -m hsgd.train`` (modes, gossip, lars).

:class:`Runs` starts one ``mpiexec -n RANKS python -m hsgd.train`` at a time,
each in a fresh run directory, and returns its epoch records (the
``"event": "epoch"`` lines of ``metrics.jsonl``) and its wall seconds,
start-up included. ``warmup`` untimed one-epoch runs come first; the first
generates the data set into the cache directory, so no timed run pays for it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from hsgd.bench._harness import int_at_least

from ._launch import add_hosts_options, job, run_job

__all__ = ["Runs", "add_run_options"]


def add_run_options(p, data: str = "MNIST-1D") -> None:
    """The options every training benchmark shares: ``--warmup``, ``--cache-dir`` (where
    ``data`` is built) and those of the emulated hosts."""
    p.add_argument("--warmup", type=int_at_least(0), default=1,
                   help=f"untimed one-epoch runs first; the first builds {data} (1)")
    p.add_argument("--cache-dir", default=None, help=f"where {data} is built (default: a temp dir)")
    add_hosts_options(p)


class Runs:
    """``runs(*options)``: one training run with ``options`` (and ``extra``, the options the
    benchmark passes on); returns (epoch records, wall seconds). ``warmup`` runs of
    ``warmup_options --epochs 1`` come first, untimed. ``progress``: a
    :class:`~hsgd.bench._harness.Progress` stepped after each run, warm-up included;
    ``commands``: every run's command line; ``crossed``: across emulated hosts, what each host
    sent and received over its link during the last run (``[(sent, received), ...]``, the
    whole job: start-up, training, evaluation), else ``None``; ``steps``: the last run's step
    records (``records``: all of them; ``config``: its ``config.json``)."""

    def __init__(self, ranks: int, tmp: str, cache_dir: Optional[str] = None, extra: Sequence[str] = (),
                 warmup: int = 1, progress=None, warmup_options: Sequence[str] = (), where=None):
        self.ranks, self.tmp, self.extra, self.count = ranks, Path(tmp), list(extra), 0
        self.where = where  # a Placement: across its emulated hosts instead (ranks: its own)
        self.cache = cache_dir or str(self.tmp / "cache")
        self.progress = progress
        self.commands: List[List[str]] = []
        self.crossed: Optional[List[Tuple[int, int]]] = None  # per host: (sent, received) of the last run
        self.steps: List[dict] = []
        self.records: List[dict] = []  # every record of the last run, and its config.json
        self.config: dict = {}
        for _ in range(warmup):
            self(*warmup_options, "--epochs", "1")

    def __call__(self, *options: str) -> Tuple[List[dict], float]:
        self.count += 1
        run_dir = self.tmp / f"run{self.count}"
        args = ["-m", "hsgd.train", "--cache-dir", self.cache, "--run-dir", str(run_dir), "--progress", "none",
                *options, *self.extra]
        cmd, env = job(args, self.ranks, self.where, one_thread=False)
        before = None if self.where is None else self.where.hosts.counters()
        start = time.perf_counter()
        out = run_job(cmd, env)
        seconds = time.perf_counter() - start
        if before is not None:
            self.crossed = [(c["sent"], c["received"]) for c in self.where.hosts.crossed(before)]
        if out.returncode:
            sys.exit(f"lab.bench: {' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
        self.commands.append(cmd)
        if self.progress is not None:
            self.progress.step(" ".join(options))
        self.records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        self.config = json.loads((run_dir / "config.json").read_text())
        self.steps = [r for r in self.records if r["event"] == "step"]
        return [r for r in self.records if r["event"] == "epoch"], seconds
