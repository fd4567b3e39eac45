"""End to end: training steps of hsgd against torch DDP, torch's model averagers and Horovod.

One command (it launches ``mpiexec`` itself, one job per rank count)::

    python -m hsgd.bench train                          # 2 and 4 ranks, both workloads
    python -m hsgd.bench train --ranks 2 --workloads mlp --repeats 3

In each job, for each workload (``mlp``, ``cnn``, ``deep``, ``mlp2m``), every method
trains its own copy of the same model on the same synthetic batches with the same
optimizer: hsgd's synchronous and local-SGD modes beside DDP, torch's model averagers,
``hsgd.horovod``'s DistributedOptimizer and Horovod (when it imports). Medians over
``--repeats`` of the slowest rank's time per step, with the methods' order rotating between
repeats (what each column is: docs/benchmark-methods.md). Each job runs on this host (gloo meets on 127.0.0.1); across
emulated hosts, with the wire limit: ``python -m lab.bench train --hosts 2`` from a clone.
"""

from __future__ import annotations

import argparse
import os

from ._harness import Result, Table, add_repeat_options, check_device, int_at_least, median
from ._launch import run_per_rank_count
from ._train_worker import worker  # noqa: F401 (what every rank runs)

WORKLOADS = ("mlp", "cnn", "deep", "mlp2m")
DEFAULT_WORKLOADS = ("mlp", "cnn")
SYNC = ("no comm", "hsgd", "hsgd overlap", "hsgd leader 2n", "hsgd sharded 2n", "hsgd overlap sharded 2n",
        "DDP", "DDP bucket view", "hsgd.horovod", "hsgd.horovod overlap", "Horovod")
LOCAL = ("hsgd local", "torch periodic", "hsgd local 2n", "torch hierarchical")


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int_at_least(1), nargs="+", default=[2, 4], help="rank counts (2 4)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(DEFAULT_WORKLOADS),
                   help="mlp (communication-bound), cnn (compute-bound) (both)")
    p.add_argument("--steps", type=int_at_least(1), default=10, help="steps per method per repeat (10)")
    add_repeat_options(p, repeats=7, warmup=1, what="rounds of every method")
    p.add_argument("--mlp-batch", type=int_at_least(1), default=32, help="samples per rank, mlp and deep (32)")
    p.add_argument("--cnn-batch", type=int_at_least(1), default=128, help="samples per rank, cnn (128)")
    p.add_argument("--batches", type=int_at_least(1), default=4, help="distinct batches per rank, cycled (4)")
    p.add_argument("--period", type=int_at_least(2), default=4,
                   help="local SGD period P; even (the 2-node runs average in the node every P/2) (4)")
    p.add_argument("--no-local", dest="local", action="store_false", help="skip the local-SGD methods")
    p.add_argument("--methods", nargs="+", choices=[*SYNC, *LOCAL], default=None, metavar="METHOD",
                   help="time these methods only; 'no comm' and 'hsgd' always run (the overhead table "
                        f"needs them): {', '.join(repr(m) for m in (*SYNC, *LOCAL))} (all)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where models and batches live: cpu, or cuda (each rank's GPU: its index on its host "
                        "modulo the GPUs; DDP stays on gloo, which takes CUDA tensors) (cpu)")
    p.add_argument("--port", dest="_port", type=int, default=0, help=argparse.SUPPRESS)  # gloo's, set by run()


def check(args, extra, parser) -> None:
    check_device(args, parser, "use --device cpu")
    if args.period % 2:
        parser.error(f"argument --period: {args.period} is odd; the 2-node local SGD averages in the "
                     f"node every P/2 steps: use an even period such as {args.period + 1}")


def run(args, extra) -> Result:
    rows = run_per_rank_count("train", args, timeout=3600, gloo=True, drop_env=["HSGD_RANKS_PER_NODE"])
    return Result(tables(rows, args), rows)


# --- tables -------------------------------------------------------------------------------
def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def tables(rows, args):
    """On one host: per workload, a table of the synchronous methods, of local SGD, of the overhead."""
    where = rows[0].get("device", "CPU") if rows else "CPU"
    title = (f"median of {args.repeats} repeats of {args.steps} steps after {args.warmup} warm-up "
             f"(slowest rank), {os.cpu_count()} cores, {where}; cells: ms per step")
    skipped = sorted({note for r in rows for note in r["skipped"]})
    tables = []
    for workload in WORKLOADS:
        mine = [r for r in rows if r["workload"] == workload]
        if not mine:
            continue
        step = {id(r): {k: (median(v) / args.steps if v else None) for k, v in r["times"].items()} for r in mine}
        sync = Table(["ranks", "batch/rank", *SYNC, "hsgd samples/s", "DDP/hsgd", "DDP bucket view/hsgd",
                      "hsgd/hsgd overlap", "hsgd.horovod/hsgd", "hsgd.horovod overlap/hsgd overlap"],
                     title=f"{workload}, synchronous SGD: {title}",
                     notes=["DDP/hsgd: DDP's time per step over hsgd's (one node), i.e. hsgd's samples/s "
                            "over DDP's; hsgd/hsgd overlap: the gain of overlap=True (above 1: faster); "
                            "hsgd.horovod/hsgd: hvd.DistributedOptimizer (import hsgd.horovod as hvd) over "
                            "HierarchicalSGD, with the same overlap (1.00x: no cost)", *skipped])
        for r in mine:
            t = step[id(r)]
            rate = r["ranks"] * r["batch"] / t["hsgd"]
            sync.rows.append([r["ranks"], r["batch"], *(_ms(t.get(m)) for m in SYNC), f"{rate:.0f}",
                              _ratio(t.get("DDP"), t["hsgd"]), _ratio(t.get("DDP bucket view"), t["hsgd"]),
                              _ratio(t["hsgd"], t.get("hsgd overlap")), _ratio(t.get("hsgd.horovod"), t["hsgd"]),
                              _ratio(t.get("hsgd.horovod overlap"), t.get("hsgd overlap"))])
        tables.append(sync)
        if args.local:
            local = Table(["ranks", *LOCAL, "torch/hsgd", "torch/hsgd 2n"],
                          title=f"{workload}, local SGD, period {args.period} (2n: {args.period // 2} in the "
                          f"node, {2 * args.period} over all): {title}")
            for r in mine:
                t = step[id(r)]
                local.rows.append([r["ranks"], *(_ms(t.get(m)) for m in LOCAL),
                                   _ratio(t.get("torch periodic"), t.get("hsgd local")),
                                   _ratio(t.get("torch hierarchical"), t.get("hsgd local 2n"))])
            tables.append(local)
        overhead = Table(["ranks", "floats", "no comm ms", "hsgd ms", "overhead ms", "bare average ms",
                          "overhead / average"],
                         title=f"{workload}: hsgd's step overhead over the bare average of the same buffer",
                         notes=["overhead: hsgd's step minus the no-communication step (medians); bare "
                                "average: one HierarchicalAverager.average() of the gradient slot, median of "
                                "the same number of averages as steps timed"])
        for r in mine:
            t = step[id(r)]
            hsgd_s, bare_s = t["hsgd"], t["no comm"]
            assert hsgd_s is not None and bare_s is not None  # both run in every overhead job
            extra = hsgd_s - bare_s
            avg = median(r["average"])
            overhead.rows.append([r["ranks"], f"{r['numel'] / 1e6:.2f}M", _ms(t["no comm"]), _ms(t["hsgd"]),
                                  _ms(extra), _ms(avg), _ratio(extra, avg)])
        tables.append(overhead)
    return tables
