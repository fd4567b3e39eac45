"""A cost model for clusters we cannot run here: predicted communication time per step.

::

    python -m lab.bench model                        # 1..4096 nodes x 1..128 ranks, two models
    python -m lab.bench model --params 2.56e7 --nodes 64 256 --ranks-per-node 8 \
        --latency 1.5e-6 --bandwidth 25e9 --png model.png
    python -m lab.bench model --validate             # predicted vs measured on this machine
    python -m lab.bench model --validate --hosts 2 --ranks-per-host 2 --link 1gbit   # as root: across hosts

For every model size and every ``--nodes`` x ``--ranks-per-node``, the alpha-beta model
of :mod:`lab.bench._costs` predicts one step's communication for a flat ring, hsgd's
``leader`` and ``sharded``, gossip and the parameter box, on the network ``--latency``
and ``--bandwidth`` and this machine's speed inside a node (fitted at the start unless
given). ``--validate`` measures them here beside the predictions; across emulated hosts
the network is measured too. docs/benchmark-methods.md (``model``, the formulas).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Dict, Union

from hsgd.bench._harness import (
    Progress,
    Result,
    Table,
    add_repeat_options,
    int_at_least,
    median,
    non_negative_float,
    positive_float,
)

from . import _costs
from ._launch import add_hosts_options, check_hosts_options, placement, run_workers
from ._links import link_rates, on_hosts
from ._model_worker import HOST_MEASURED, MEASURED, worker  # noqa: F401 (worker: what every rank runs)

#: The largest single inter-node sum (``hsgd.inter_node.CHUNK_BYTES``, which imports MPI).
CHUNK_BYTES = 4 << 20
STYLES = ("o-", "s-", "x--", "^-", "d-")  # one per strategy; sharded dashed over leader, often equal
#: The node's parameters, measured here unless given (``--intra-latency`` ...).
HERE = ("intra_latency", "intra_bandwidth", "local_latency", "local_bandwidth")
COLUMNS = ("params", "nodes", "ranks/node", "ranks", *(f"{s} ms" for s in _costs.STRATEGIES), "fastest sync")
VALIDATION_COLUMNS = ("nodes x ranks/node", "floats", "strategy", "predicted ms", "measured ms", "error",
                      "bytes as modelled")


def add_arguments(p) -> None:
    p.add_argument("--params", type=positive_float, nargs="+", default=[2.56e7, 5210],
                   help="model sizes in elements (2.56e7: ResNet-50; 5210: the trainer's CNN)")
    p.add_argument("--dtype-bytes", type=int_at_least(1), default=4, help="bytes per element (4)")
    p.add_argument("--nodes", type=int_at_least(1), nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096],
                   help="node counts (1 4 16 64 256 1024 4096)")
    p.add_argument("--ranks-per-node", type=int_at_least(1), nargs="+", default=[1, 8, 32, 128],
                   help="ranks per node (1 8 32 128)")
    p.add_argument("--latency", type=positive_float, default=2e-6,
                   help="network latency, s (2e-6; with --hosts: measured across them)")
    p.add_argument("--bandwidth", type=positive_float, default=12.5e9,
                   help="network bandwidth per node and direction, bytes/s (12.5e9: 100 Gb/s; with --hosts: "
                        "measured across them)")
    p.add_argument("--stream-bandwidth", type=positive_float, default=None,
                   help="bytes/s one rank can drive through the NIC (default: --bandwidth)")
    p.add_argument("--memory-bandwidth", type=positive_float, default=None,
                   help="a node's memory bandwidth, bytes/s, shared by its ranks in level 1 (default: no cap)")
    p.add_argument("--fan-efficiency", type=_fraction("the link's bandwidth"), default=1.0,
                   help="fraction of the bandwidth a node's link delivers where several nodes' streams meet "
                        "at it (all-to-all); 1 (with --hosts 3 or more: measured across them)")
    p.add_argument("--gossip-rate", type=_fraction("the rounds"), default=1.0,
                   help="fraction of gossip rounds in which a rank sends its model (1: every step)")
    p.add_argument("--intra-latency", type=non_negative_float, default=None,
                   help="latency of one round of a level-1 fence, s (default: measured here)")
    p.add_argument("--intra-bandwidth", type=positive_float, default=None,
                   help="one rank's slot-to-slot copy rate in level 1, bytes/s (default: measured here)")
    p.add_argument("--local-latency", type=non_negative_float, default=None,
                   help="latency of an MPI message inside a node, s (default: measured here)")
    p.add_argument("--local-bandwidth", type=positive_float, default=None,
                   help="MPI bandwidth between two ranks of a node, bytes/s (default: measured here)")
    p.add_argument("--validate", action="store_true",
                   help="also measure 1x2, 1x4, 2x1, 2x2 (nodes x ranks) here, or with --hosts N x 1 and N x k "
                        "across the hosts, and compare with the model")
    p.add_argument("--validate-sizes", type=positive_float, nargs="+", default=[1e5, 2e6],
                   help="float32 elements of --validate's buffers, rounded up to a multiple of 64 (1e5 2e6)")
    p.add_argument("--png", type=Path, default=None, metavar="PATH", help="also draw the predictions here")
    add_repeat_options(p, repeats=10, warmup=2, what="averages of each measurement")
    add_hosts_options(p)
    p.add_argument("--job", dest="_job", choices=["here", "hosts"], default="here", help=argparse.SUPPRESS)


def _fraction(of: str):
    """An argparse type: a number in (0, 1], a fraction ``of`` something."""
    def parse(text: str) -> float:
        value = positive_float(text)
        if value > 1:
            raise argparse.ArgumentTypeError(f"{text} is a fraction of {of}: use a number in (0, 1]")
        return value
    return parse


def check(args, extra, parser) -> None:
    check_hosts_options(args, parser)
    if args.hosts:
        if args.hosts < 2:
            parser.error("argument --hosts: the network is measured between hosts: use 2 or more")
        if len(set(args.host_ranks)) != 1:
            parser.error(f"argument --ranks-per-host: the model has the same ranks on every node; got "
                         f"{args.ranks_per_host}: give one count")
    if args.png is None:
        return
    if not args.png.parent.is_dir():
        parser.error(f"argument --png: the directory {args.png.parent} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("argument --png: drawing needs matplotlib: pip install matplotlib (or 'hsgd[train]')")


def run(args, extra) -> Result:
    hosts = on_hosts(args)
    measure = hosts or args.validate or None in (args.intra_latency, args.intra_bandwidth, args.local_latency,
                                                 args.local_bandwidth)
    jobs = [2, 4] if args.validate and not hosts else [2] if measure else []
    measured: Dict[Union[int, str], Any] = {}  # the workers' JSON, by ranks or "hosts"
    network = None
    steps = len(jobs) + hosts + 1 + (args.png is not None)
    with Progress(steps, "lab.bench model", args.progress) as progress:
        for ranks in jobs:  # on this host: the node's parameters (and --validate's configurations)
            measured[ranks] = run_workers("model", ranks, args._argv, timeout=1800,
                                          drop_env=["HSGD_RANKS_PER_NODE"])
            progress.step(f"{ranks} ranks measured")
        if hosts:
            with placement(args) as where:
                assert where is not None  # on_hosts(args)
                measured["hosts"] = run_workers("model", where.ranks, [*args._argv, "--job", "hosts"],
                                                timeout=3600, drop_env=["HSGD_RANKS_PER_NODE"], where=where)
                progress.step(where.describe())
            network = _fit_network(measured["hosts"]["network"], args)
        here = _fit_here(measured[2]["calibration"]) if measure else None
        machine = _machine(args, here, network)
        predictions = _predict(args, machine)
        progress.step(f"{len(predictions)} configurations predicted")
        if args.png is not None:
            _draw(args, predictions, args.png, machine)
            progress.step(f"drew {args.png}")
    tables = [_grid_table(args, predictions, machine, network), _machine_table(args, machine, here, network)]
    raw = {"machine": machine.as_dict(), "here": here, "network": network, "predictions": predictions,
           "network_calibration": measured["hosts"]["network"] if hosts else None,
           "calibration": measured[2]["calibration"] if measure else None, "validation": None}
    if args.validate:
        if hosts:
            rows = measured["hosts"]["validation"]
            tables.append(_validation_table(args, rows, machine, HOST_MEASURED, _hosts_title(args, network)))
        else:
            rows = [r for ranks in jobs for r in measured[ranks]["validation"]]
            tables.append(_validation_table(args, rows, _this_machine(here), MEASURED, (
                "Predicted vs measured on this machine (network = MPI over shared memory, as fitted)")))
        raw["validation"] = rows
    return Result(tables, raw)


# --- this machine's parameters ------------------------------------------------------------------

def _fit(nbytes, times):
    """``(intercept s, bytes/s)`` of ``t = a + bytes / rate`` through two (bytes, medians); the
    intercept is kept in ``[0, t_small]`` and the rate positive, whatever the noise."""
    (n1, n2), (t1, t2) = nbytes, [median(t) for t in times]
    slope = (t2 - t1) / (n2 - n1)
    a = min(max(t1 - slope * n1, 0.0), t1)
    return a, n2 / (t2 - a) if t2 > a else n2 / t2


def _fit_here(calibration) -> dict:
    """Level 1 (hsgd's node average on 2 ranks: 2 fences + n bytes) and MPI's shared-memory
    transport (Allreduce on 2 ranks: 2 alpha + n bytes), from the calibration job."""
    nbytes = [4 * n for n in calibration["sizes"]]
    a_s, b_s = _fit(nbytes, calibration["level1"])
    a_m, b_m = _fit(nbytes, calibration["mpi"])
    return {"intra_latency": a_s / 2, "intra_bandwidth": b_s, "local_latency": a_m / 2, "local_bandwidth": b_m}


def _fit_network(calibration, args) -> dict:
    """``alpha`` and ``B`` of the links between the emulated hosts (one stream each way per link),
    ``B`` as a fraction of the slowest link's rate, and (3 hosts or more) ``eta``: what the fan's
    median took at ``alpha`` and ``B``, over what it took (at most 1)."""
    latency, bandwidth = _fit([4 * n for n in calibration["sizes"]], calibration["times"])
    rate = min(link_rates(args), key=lambda r: float("inf") if r is None else r)
    fan = calibration.get("fan")
    eta = None if fan is None else min(1.0, (latency + fan["bytes_per_link"] / bandwidth) / median(fan["times"]))
    return {"latency": latency, "bandwidth": bandwidth, "link_bytes_per_s": None if rate is None else rate / 8,
            "fan_efficiency": eta}


def _machine(args, here, network=None) -> _costs.Machine:
    """The cluster: the network as given, or as measured across emulated hosts; inside a node, as
    given or as measured here."""
    node = {key: here[key] if getattr(args, key) is None else getattr(args, key) for key in HERE}
    latency, bandwidth = (args.latency, args.bandwidth) if network is None else (
        network["latency"], network["bandwidth"])
    fan = args.fan_efficiency if network is None or network["fan_efficiency"] is None else network["fan_efficiency"]
    return _costs.Machine(latency=latency, bandwidth=bandwidth, **node,
                          stream_bandwidth=args.stream_bandwidth, memory_bandwidth=args.memory_bandwidth,
                          gossip_rate=args.gossip_rate, fan_efficiency=fan)


def _this_machine(here) -> _costs.Machine:
    """This host as the model sees it: the network is MPI over shared memory."""
    return _costs.Machine(latency=here["local_latency"], bandwidth=here["local_bandwidth"], **here)


# --- predictions --------------------------------------------------------------------------------

def _predict(args, machine):
    out = []
    for params in args.params:
        nbytes = params * args.dtype_bytes
        for nodes in args.nodes:
            for k in args.ranks_per_node:
                out.append({"params": params, "nbytes": nbytes, "nodes": nodes, "ranks_per_node": k,
                            "seconds": _costs.predict(nbytes, nodes, k, machine)})
    return out


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    for bound, form in ((100, "{:,.0f}"), (10, "{:.1f}"), (1, "{:.2f}")):
        if ms >= bound:
            return form.format(ms)
    return f"{ms:.3f}"


def _count(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def _fastest(seconds: dict) -> str:
    sync = {name: seconds[name] for name in MEASURED}
    best = min(sync.values())
    return " = ".join(name for name, s in sync.items() if math.isclose(s, best, rel_tol=1e-9))


def _grid_table(args, predictions, machine, network) -> Table:
    rows = [[_count(p["params"]), p["nodes"], p["ranks_per_node"], p["nodes"] * p["ranks_per_node"],
             *(_ms(s) for s in p["seconds"].values()), _fastest(p["seconds"])] for p in predictions]
    stream = "" if args.stream_bandwidth is None else f", {args.stream_bandwidth / 1e9:g} GB/s per rank"
    where = "" if network is None else f" (measured across {args.hosts} emulated hosts, links {args.link})"
    return Table(COLUMNS, rows, title=(
        f"Predicted communication per step (alpha-beta model, lab/bench/_costs.py): network "
        f"{machine.latency * 1e6:.3g} us, {_rate(machine.bandwidth)} per node{where}{stream}; "
        f"{args.dtype_bytes}-byte elements; a gossiping rank sends its model in "
        f"{'every round' if args.gossip_rate == 1 else f'{args.gossip_rate:g} of the rounds'}"),
        notes=["'fastest sync': among the exact synchronous averages (flat ring, leader, sharded); gossip "
               "and the box are asynchronous and average less per step. The flat ring's 2(p-1) latency "
               "terms are an upper bound: MPI switches to log2(p)-step algorithms at large p."])


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.3g} MB/s"


def _machine_table(args, machine, here, network) -> Table:
    level1 = "fit here: hsgd's node average, 2 ranks, 4 KiB and 16 MiB"
    mpi = "fit here: MPI Allreduce, 2 ranks, 4 KiB and 16 MiB"
    if network is None:
        rows = [["network latency", f"{machine.latency * 1e6:g} us", "--latency"],
                ["network bandwidth per node", _rate(machine.bandwidth), "--bandwidth"]]
    else:
        fit = f"fit across {args.hosts} emulated hosts: Sendrecv between their first ranks, 4 KiB and 16 MiB"
        link = network["link_bytes_per_s"]
        share = "" if link is None else f" ({network['bandwidth'] / link:.0%} of the link's {_rate(link)})"
        rows = [["network latency", f"{machine.latency * 1e6:.1f} us", fit],
                ["network bandwidth per node", _rate(machine.bandwidth) + share, fit]]
    if network is None or network["fan_efficiency"] is None:
        rows.append(["many-to-many efficiency (eta)", f"{machine.fan_efficiency:.0%}", "--fan-efficiency"])
    else:
        rows.append(["many-to-many efficiency (eta)", f"{machine.fan_efficiency:.0%}",
                     f"fit across {args.hosts} emulated hosts: every first rank sends 16 MiB / {args.hosts - 1} "
                     f"to each other one at once, against the time at the latency and bandwidth above"])
    for key, name, unit, fit in (
            ("intra_latency", "level-1 fence latency, per barrier round", "us", level1),
            ("intra_bandwidth", "level-1 copy bandwidth, per rank", "GB/s", level1),
            ("local_latency", "MPI latency inside a node", "us", mpi),
            ("local_bandwidth", "MPI bandwidth inside a node", "GB/s", mpi)):
        value = getattr(machine, key) * (1e6 if unit == "us" else 1e-9)
        given = getattr(args, key) is not None
        source = f"--{key.replace('_', '-')}" if given else fit
        if given and here is not None:
            source += f" (measured here: {here[key] * (1e6 if unit == 'us' else 1e-9):.2f} {unit})"
        rows.append([name, f"{value:.2f} {unit}", source])
    return Table(("parameter", "value", "from"), rows, title=(
        f"The model's parameters (measurements: median of {args.repeats} after {args.warmup} warm-up; "
        "--validate here takes this machine's MPI figures as its network)"))


# --- validation ---------------------------------------------------------------------------------

def _validation_table(args, rows, machine, strategies, title) -> Table:
    table = Table(VALIDATION_COLUMNS, title=(
        f"{title}; slowest rank, median of {args.repeats} after {args.warmup} warm-up (gossip: per step "
        "of a cycle of the graph's rounds)"))
    errors = []
    for row in rows:
        nodes, k, n = row["nodes"], row["ranks_per_node"], row["numel"]
        predicted = _costs.predict(4 * n, nodes, k, machine)
        row["predicted"] = {name: predicted[name] for name in strategies}
        for name in strategies:
            times = row["times"][name]
            pred, meas = predicted[name], median(times)
            errors.append(abs(pred / meas - 1))
            table.rows.append([f"{nodes} x {k}", f"{n:,}", name, _ms(pred), _ms(meas),
                               f"{100 * (pred / meas - 1):+.0f}%", _bytes_match(row, name)])
        if "MPI Allreduce" in row["times"]:  # measured beside the ring, not a strategy of the model
            table.rows.append([f"{nodes} x {k}", f"{n:,}", "MPI Allreduce", "-",
                               _ms(median(row["times"]["MPI Allreduce"])), "-", "-"])
    table.notes = [f"error = predicted / measured - 1; median |error| {100 * median(errors):.0f}%, "
                   f"largest {100 * max(errors):.0f}%."]
    if not on_hosts(args):
        table.notes[0] += " 1 x 2 is the calibration's configuration (other sizes)."
    return table


def _hosts_title(args, network) -> str:
    return (f"Predicted vs measured across {args.hosts} emulated hosts (links {args.link}, TCP; the network "
            f"as fitted: {network['latency'] * 1e6:.0f} us, {_rate(network['bandwidth'])})")


def _bytes_match(row, name) -> str:
    """Whether hsgd counted the model's bytes, up to the rounding of one byte per chunk."""
    if name not in ("leader", "sharded"):
        return "-"
    expected = _costs.bytes_per_rank(name, 4 * row["numel"], row["nodes"], row["ranks_per_node"])
    counted = {key: round(value) for key, value in row["traffic"][name].items()}
    slack = -(-4 * row["numel"] // CHUNK_BYTES)
    same = all(abs(counted[key] - expected[key]) <= slack for key in expected)
    return "yes" if same else f"no: hsgd counted {counted}, model {expected}"


# --- the picture --------------------------------------------------------------------------------

def _draw(args, predictions, path: Path, machine) -> None:
    from hsgd._trainer.plots import new_figure

    fig = new_figure()
    sizes, ks = list(dict.fromkeys(args.params)), list(dict.fromkeys(args.ranks_per_node))
    fig.set_size_inches(2.8 * len(ks) + 1, 2.4 * len(sizes) + 0.6)
    axes = fig.subplots(len(sizes), len(ks), squeeze=False, sharex=True)
    for i, params in enumerate(sizes):
        for j, k in enumerate(ks):
            ax, mine = axes[i][j], [p for p in predictions if p["params"] == params and p["ranks_per_node"] == k]
            for name, style in zip(_costs.STRATEGIES, STYLES):
                pts = [(p["nodes"], 1e3 * p["seconds"][name]) for p in mine if p["seconds"][name] > 0]
                if pts:
                    ax.plot(*zip(*pts), style, ms=3, label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{_count(params)} params, {k} rank{'s' if k > 1 else ''} per node", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.set_ylabel("ms per step")
            if i == len(sizes) - 1:
                ax.set_xlabel("nodes")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Predicted communication per step: {machine.latency * 1e6:.3g} us, "
                 f"{_rate(machine.bandwidth)} per node", fontsize=10)
    fig.savefig(path, dpi=100)
