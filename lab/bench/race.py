"""A race to a test accuracy: hsgd's compressions against torch DDP's communication hooks, across emulated hosts.

One command (one job; every rank runs every method, one after another)::

    python -m lab.bench race --hosts 2 --ranks-per-host 2 --link 100mbit             # as root
    python -m lab.bench race --hosts 3 --link 100mbit,1gbit,1gbit
    python -m lab.bench race --ranks 4 --ranks-per-node 2 --steps 20                 # this host, virtual nodes
    python -m lab.bench race --join a.json b.json          # one table of runs that raced some methods each

Every method trains the same MLP on MNIST-1D (hidden width 1400: 2.0M parameters, 8 MB of
gradients a step, so that the links bound the steps) from the same weights, on the same
batches, with the same SGD, for ``--steps`` steps, scoring the test set every
``--eval-every``: hsgd (``HierarchicalSGD``, the hosts as nodes) in fp32, fp16, powersgd and
int8, and torch DDP on gloo, plain, with ``fp16_compress_hook`` and with ``powerSGD_hook`` at
the same rank and start. The table: the training time to the first score at or above
``--target`` (the scoring not counted) and its steps, the bytes on the busiest link, and the
score after the last step. What each column is: docs/benchmark-methods.md (``race``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hsgd._trainer.config import default_cache_dir
from hsgd.bench._harness import Result, Table, int_at_least, median, positive_float

from ._launch import add_hosts_options, check_hosts_options, run_per_rank_count
from ._links import link_rates, on_hosts, wire_limit
from ._race_worker import METHODS, worker  # noqa: F401 (worker: what every rank runs)


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(2), default=4, help="ranks on this host, without --hosts (4)")
    p.add_argument("--ranks-per-node", type=int_at_least(1), default=2,
                   help="virtual node size on this host, without --hosts (2)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), metavar="METHOD",
                   help=f"which to race, of: {', '.join(repr(m) for m in METHODS)} (all)")
    p.add_argument("--steps", type=int_at_least(1), default=200, help="steps of every method (200)")
    p.add_argument("--eval-every", type=int_at_least(1), default=25, help="score the test set every N steps (25)")
    p.add_argument("--target", type=positive_float, default=0.7, help="the test accuracy to reach (0.7)")
    p.add_argument("--repeats", type=int_at_least(1), default=1,
                   help="runs of every method, in rotating order; the table shows medians (1)")
    p.add_argument("--batch", type=int_at_least(1), default=64, help="samples per rank per step (64)")
    p.add_argument("--lr", type=positive_float, default=0.2,
                   help="SGD's learning rate (momentum 0.9), decayed linearly to 0 over the steps (0.2)")
    p.add_argument("--width", type=int_at_least(1), default=1400,
                   help="the MLP's hidden units: 1400 gives 2.0M parameters (1400)")
    p.add_argument("--samples", type=int_at_least(1), default=40000, help="MNIST-1D training samples (40000)")
    # 32: of 4, 16 and 32, the one rank at which PowerSGD ends this race within 0.5 points of
    # uncompressed hsgd (docs/compression.md); the trainer's default stays PowerSGD's own, 4
    p.add_argument("--powersgd-rank", type=int_at_least(1), default=32, help="PowerSGD's rank, both (32)")
    p.add_argument("--start-step", type=int_at_least(2), default=10,
                   help="PowerSGD's uncompressed steps first, both (DDP's hook needs 2 or more) (10)")
    p.add_argument("--cache-dir", default=default_cache_dir(), help="where MNIST-1D is generated once "
                   "(hsgd.train's default)")
    p.add_argument("--port", dest="_port", type=int, default=0, help=argparse.SUPPRESS)  # gloo's, set by run()
    p.add_argument("--join", nargs="+", type=Path, default=None, metavar="JSON",
                   help="run nothing: one table of the rows (of --methods) in earlier runs' --json files, run "
                        "with the same settings but --methods and --repeats (a grid split over several runs)")
    add_hosts_options(p)


# what may differ between the runs that --join puts in one table; PowerSGD's settings may differ
# between runs that contribute no PowerSGD row
_PER_RUN = ("methods", "repeats", "json", "progress", "join", "_port", "_master")
_POWERSGD = (("powersgd_rank", "start_step"), ("hsgd powersgd", "DDP powerSGD hook"))


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser, min_ranks=2, why=" (two nodes)")
    if not args.target < 1:
        parser.error(f"argument --target: {args.target} is a test accuracy: use a fraction below 1")
    args.ranks = [args.ranks]  # one job: run_per_rank_count runs one per count
    if args.join:
        records = []
        for path in args.join:
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                parser.error(f"argument --join: {path}: {exc}")
            if records[-1].get("subcommand") != "race":
                parser.error(f"argument --join: {path} is not the --json of a race")
        for r in records:  # the rows of --methods (default: all)
            r["raw"] = [row for row in r["raw"] if row["method"] in args.methods]
        settings = [{k: v for k, v in r["settings"].items() if k not in _PER_RUN
                     and (k not in _POWERSGD[0] or any(row["method"] in _POWERSGD[1] for row in r["raw"]))}
                    for r in records]
        every = {k: v for s in settings for k, v in s.items()}
        differ = sorted(k for k in every if any(s.get(k, every[k]) != every[k] for s in settings))
        if differ:
            parser.error(f"argument --join: the runs differ in {', '.join(differ)}: join runs of the same settings")
        vars(args).update(every)
        args.rows = [row for r in records for row in r["raw"]]
        args.methods = [m for m in METHODS if any(row["method"] == m for row in args.rows)]
        if not args.rows:
            parser.error("argument --join: the files hold no row of --methods")


def run(args, extra) -> Result:
    rows = args.rows if args.join else run_per_rank_count("race", args, timeout=7200, gloo=True,
                                                             drop_env=["HSGD_RANKS_PER_NODE"])
    return Result([_table(rows, args)], rows)


def _busiest(row, steps: int):
    """Bytes per step on the busiest link (the larger of sent and received), or ``None``."""
    if not row["crossed"]:
        return None
    return max(max(sent, received) for sent, received in row["crossed"]) / steps


def _table(rows, args) -> Table:
    by = {m: [r for r in rows if r["method"] == m] for m in args.methods}
    first = rows[0]
    runs = sorted({len(r) for r in by.values() if r})  # repeats of each method (--join: may differ)
    where = (f"{args.hosts} emulated hosts, ranks {args.ranks_per_host} per host, links {args.link}"
             if on_hosts(args) else f"{first['ranks']} ranks on this host as {first['nodes']} nodes")
    title = (f"MNIST-1D MLP ({first['params'] / 1e6:.2f}M parameters), batch {args.batch} per rank, SGD lr {args.lr} "
             f"to 0, "
             f"{args.steps} steps, target test accuracy {args.target}; "
             + (f"PowerSGD rank {args.powersgd_rank} from step {args.start_step}; "
                if any(m in _POWERSGD[1] for m in by if by[m]) else "")
             + f"{where}; median of "
             + (f"{runs[0]}" if len(runs) == 1 else f"{runs[0]} to {runs[-1]} runs of a method")
             + (" (smallest-largest)" if runs[-1] > 1 else ""))
    table = Table(["method", "steps to target", "s to target", "DDP's s / this", "s per step",
                   "MB per step, busiest link", "bytes vs hsgd fp32", "link s per step", "final test acc",
                   "vs hsgd fp32 (points)"], title=title,
                  notes=["s: training time of the slowest rank, the scoring of the test set not counted; a "
                         "method that did not reach the target shows '-'. MB: the larger of sent and received "
                         "on the busiest host's link (eth0's counters: TCP/IP headers included, the scoring's "
                         "few bytes too), per step; link s: each host's bytes over its link's rate, the "
                         "slowest host's. With repeats a cell is their median (smallest-largest, where they "
                         "differ); the ratios and points are of the medians"
                         + ("" if on_hosts(args) else "; on this host: no links, hsgd's inter-node bytes")])
    stats = {m: _stats(r, args) for m, r in by.items() if r}
    mid = {m: {k: _mid(v) for k, v in s.items()} for m, s in stats.items()}  # the medians
    base, ddp = mid.get("hsgd fp32"), mid.get("DDP")
    for method, s in stats.items():
        m = mid[method]
        table.rows.append([
            method, _fmt(s["steps"], "{:.0f}"), _fmt(s["seconds"], "{:.1f}"),
            "-" if ddp is None or None in (ddp["seconds"], m["seconds"]) else f"{ddp['seconds'] / m['seconds']:.1f}x",
            _fmt(s["per_step"], "{:.3f}"), _fmt(s["bytes"], "{:.2f}", 1e-6),
            "-" if base is None or None in (base["bytes"], m["bytes"]) else f"{m['bytes'] / base['bytes']:.1%}",
            _fmt(s["link"], "{:.3f}"), _fmt(s["final"], "{:.2%}"),
            "-" if base is None else f"{100 * (m['final'] - base['final']):+.2f}"])
    return table


def _stats(rows, args) -> dict:
    """A method's repeats: the lists of each measure (``None``: not measured, or a repeat that
    did not reach the target)."""
    reached = [r["reached"] for r in rows]
    done = [r for r in reached if r is not None]
    traffic = [_busiest(r, args.steps) for r in rows]
    wire = [wire_limit(r["crossed"], link_rates(args), 0.0, args.steps) if on_hosts(args) else None for r in rows]
    if traffic[0] is None and rows[0]["inter_bytes"] is not None:  # on this host: hsgd's own count
        traffic = [r["inter_bytes"] / r["ranks"] / args.steps for r in rows]
    return {"steps": [s for s, _ in done] if len(done) == len(rows) else None,
            "seconds": [t for _, t in done] if len(done) == len(rows) else None,
            "per_step": [r["evals"][-1][1] / args.steps for r in rows],
            "bytes": None if traffic[0] is None else traffic,
            "link": wire if None not in wire else None,
            "final": [r["final"] for r in rows]}


def _mid(values):
    return None if values is None else median(values)


def _fmt(values, form: str, scale: float = 1.0) -> str:
    """The median of ``values`` times ``scale`` in ``form``, and their range where it shows
    (``median (min-max)``); ``-`` for ``None``."""
    if values is None:
        return "-"
    low, high = form.format(scale * min(values)), form.format(scale * max(values))
    return form.format(scale * median(values)) + ("" if low == high else f" ({low}-{high})")
