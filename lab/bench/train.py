"""End to end: training steps of hsgd against torch DDP, torch's model averagers and Horovod, across hosts.

``python -m hsgd.bench train`` (in the package) with ``--hosts``: the same jobs across
hosts emulated on this machine (root only), with the bytes on the busiest link and the
wire limit::

    python -m lab.bench train --ranks 2 --workloads mlp --repeats 3
    python -m lab.bench train --hosts 2 --ranks-per-host 2 --link 1gbit --workloads mlp2m   # as root

In each job, for each workload (``mlp``, ``cnn``, ``deep``, ``mlp2m``), every method
trains its own copy of the same model on the same synthetic batches with the same
optimizer; across emulated hosts the methods are hsgd's strategies, DDP, a flat MPI
allreduce and Horovod (when it imports). What each workload, method and column is:
docs/benchmark-methods.md (``train``).
"""

from __future__ import annotations

from hsgd.bench import training_steps as here
from hsgd.bench._harness import Result, Table, median

from ._host_train import worker  # noqa: F401 (what every rank runs)
from ._launch import add_hosts_options, check_hosts_options, run_per_rank_count
from ._links import on_hosts

HOSTS = ("no comm", "hsgd", "hsgd leader", "hsgd sharded", "hsgd fp16", "hsgd overlap", "hsgd overlap 4MB",
         "hsgd overlap sharded 4MB", "DDP", "DDP bucket view", "flat MPI", "Horovod")  # across emulated hosts
_ms, _ratio = here._ms, here._ratio


def add_arguments(p) -> None:
    here.add_arguments(p)
    add_hosts_options(p)


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser)
    if on_hosts(args) and (args.methods is not None or args.device != "cpu"):
        parser.error("arguments --methods and --device: across emulated hosts every method runs, on the CPU "
                     "(the hosts are CPU-only); drop them, or run without --hosts")
    here.check(args, extra, parser)


def run(args, extra) -> Result:
    rows = run_per_rank_count("train", args, timeout=3600, gloo=True, drop_env=["HSGD_RANKS_PER_NODE"])
    return Result(_host_tables(rows, args) if on_hosts(args) else here.tables(rows, args), rows)


def _host_tables(rows, args):
    """Across hosts: one table per workload, a row per method."""
    title = (f"median of {args.repeats} repeats of {args.steps} steps after {args.warmup} warm-up (slowest "
             f"rank), {args.hosts} emulated hosts, ranks {args.ranks_per_host} per host, links {args.link}")
    tables = []
    for r in rows:
        step = {k: median(v) / args.steps for k, v in r["times"].items() if v}
        ddp = step.get("DDP")
        table = Table(["method", "ms per step", "samples/s", "MB per step on the busiest link", "wire limit ms",
                       "of the wire limit", "samples/s / DDP's"],
                      title=f"{r['workload']} ({r['numel'] / 1e6:.2f}M parameters), batch {r['batch']} per rank: "
                            f"{title}",
                      notes=["MB: the larger of sent and received on the busiest host's link (eth0's counters), "
                             "per step; wire limit: the no-communication step plus those bytes over the link rate",
                             *r["skipped"]])
        for name in HOSTS:
            if name not in step:
                continue
            crossed, limit = r["crossed"].get(name), r["limits"].get(name)
            busiest = None if not crossed else max(max(c) for c in crossed) / (args.steps * r["timed_repeats"])
            table.rows.append([name, _ms(step[name]), f"{r['ranks'] * r['batch'] / step[name]:.0f}",
                               "-" if busiest is None else f"{busiest / 1e6:.2f}",
                               "-" if limit is None or name == "no comm" else _ms(limit),
                               "-" if limit is None or name == "no comm" else f"{limit / step[name]:.0%}",
                               _ratio(ddp, step[name])])
        tables.append(table)
    return tables
