"""What a lost host costs under ``python -m hsgd.run``: the seconds lost, split, and the accuracy.

One command (as root: hosts emulated on this machine)::

    python -m lab.bench restart                          # 3 hosts x 2 ranks, 1gbit, the default run
    python -m lab.bench restart --faults 4 --save-every 30s
    python -m lab.bench restart --epochs 5               # options it does not know go to hsgd.train

A run without a fault first, then ``--faults`` runs in which one host, picked at random,
dies at a random time of the training, in turn each way: ``killed`` (its processes killed,
then its link taken down: the kernel may close their connections first) and ``silent``
(its link down first: no word reaches the others, as in a power loss); it answers no
probe. Every run is the supervisor's, on the same hosts. From the times the
supervisor's output lines arrive and the run's records, the seconds from the fault to the
moment the new job is back at the step the old one had reached split into: detection
(to the first line the failure printed, a stall report included), the end of the old job, the probe, the new
job's start-up (launch to ready, the checkpoint not loaded), loading, and the steps
redone. The target: at most a fresh job's start-up (the run without fault's) plus the
old job's time since its last checkpoint, plus 5 s. docs/reliability.md.
"""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List

from hsgd.bench._harness import Progress, Result, Table, int_at_least, positive_float
from hsgd.bench._launcher import mpi_env
from hsgd.data import ensure_mnist1d

from ..hosts import EmulatedHosts, HostsUnavailable

PASSES_ON = True
TARGET_SLACK_S = 5.0
FAULTS = ("killed", "silent")  # in turn


def add_arguments(p) -> None:
    p.add_argument("--hosts", type=int_at_least(2), default=3, help="emulated hosts (3)")
    p.add_argument("--ranks-per-host", type=int_at_least(1), default=2, help="ranks on every host (2)")
    p.add_argument("--link", default="1gbit", help="every host's link rate (1gbit)")
    p.add_argument("--faults", type=int_at_least(1), default=1, help="runs with a fault, one host each (1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the hosts and times picked (0)")
    p.add_argument("--probe-timeout", type=positive_float, default=3.0, help="the supervisor's (3)")
    p.add_argument("--cache-dir", default=None, help="where MNIST-1D is built (default: a temp dir)")


class _Lines(threading.Thread):
    """The supervisor's stderr, each line with the wall time it arrived, echoed as it comes."""

    def __init__(self, stream, echo: bool):
        super().__init__(daemon=True)
        self.stream, self.echo, self.lines = stream, echo, []

    def run(self) -> None:
        for line in self.stream:
            self.lines.append((time.time(), line.rstrip("\n")))
            if self.echo:
                sys.stderr.write(line)

    def first(self, text: str, after: float = 0.0):
        return next((t for t, line in self.lines if t >= after and text in line), None)


def _records(run: Path) -> List[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _supervised(hosts, tmp: Path, name: str, trainer: List[str], args, fault=None) -> tuple:
    """One supervised run (``fault``: ``(host, seconds after the first step, "killed" or "silent")``); its
    lines and records."""
    run = tmp / name
    hosts_file = tmp / f"{name}.hosts"
    hosts_file.write_text("".join(f"{h.address}:{args.ranks_per_host}\n" for h in hosts.hosts))
    cmd = [sys.executable, "-m", "hsgd.run", "--hosts-file", str(hosts_file), "--max-restarts", "1",
           "--probe-timeout", str(args.probe_timeout), "--launcher-args", shlex.join(hosts.launcher_options()),
           "--", *trainer, "--run-dir", str(run)]
    proc = subprocess.Popen(cmd, env=mpi_env({**hosts.tcp_env(), "TMPDIR": str(tmp)}), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = _Lines(proc.stderr, args.progress == "lines")
    lines.start()
    killed = None
    if fault is not None:
        host, after, kind = fault
        while not ((run / "metrics.jsonl").exists() and any(r["event"] == "step" for r in _records(run))):
            time.sleep(0.05)
        time.sleep(after)
        killed = time.time()
        if kind == "silent":
            hosts.set_link(host, up=False)
        hosts.kill_host(host)
        hosts.set_link(host, up=False)
    proc.wait()
    lines.join(10)
    if fault is not None:
        hosts.set_link(fault[0], up=True)
    if proc.returncode:
        sys.exit(f"lab.bench restart: the supervised run ended with {proc.returncode}:\n"
                 + "\n".join(line for _, line in lines.lines[-40:]))
    return lines, _records(run), killed


def _split(lines: _Lines, records: List[dict], killed: float) -> dict:
    """The seconds from ``killed`` to the new job's catching up, by phase."""
    old_steps = [r for r in records if r["event"] == "step" and r["wall"] <= killed]
    at_kill = old_steps[-1]["step"] if old_steps else 0
    ended = lines.first("the job ended with status", killed)
    detected = next((t for t, line in lines.lines if killed <= t <= ended
                     and (not line.startswith("[rank ") or "hsgd stall:" in line)), ended)
    restarted = lines.first("restart 1 of", killed)
    launched = lines.first("starting", restarted)
    start = [r for r in records if r["event"] == "start"][-1]
    # the fault can land after the old job's last step (in its final save or scoring): then the new
    # job has no step to reach, and it is back once it has started
    back = next((r for r in records if r["event"] == "step" and r["wall"] > start["wall"] and r["step"] >= at_kill),
                start)
    first = next(r for r in records if r["event"] == "start")  # no checkpoint yet: all of it is redone
    saved = next((r for r in records if r["event"] == "checkpoint" and r["step"] == start["resumed"]
                  and r["wall"] < killed), first)
    ready = start["wall"] - start["load_s"]
    return {"at_step": at_kill, "from_step": start["resumed"] or 0, "detect": detected - killed,
            "end": ended - detected, "probe": restarted - ended, "startup": ready - launched,
            "load": start["load_s"], "redo": back["wall"] - start["wall"], "lost": back["wall"] - killed,
            "since_save": killed - saved["wall"], "world": start["world_size"],
            "recorded_lost": next(r for r in records if r["event"] == "restart").get("seconds_lost")}


def run(args, extra) -> Result:
    rng = random.Random(args.seed)
    trainer = ["--log-every", "1", "--progress", "lines", *extra]
    rows = []
    try:
        hosts = EmulatedHosts(args.hosts, args.link)
    except HostsUnavailable as exc:
        raise SystemExit(f"lab.bench restart: {exc}") from None
    with hosts, tempfile.TemporaryDirectory() as tmp, \
            Progress(1 + args.faults, "lab.bench restart", args.progress) as progress:
        cache = args.cache_dir or str(Path(tmp) / "cache")
        trainer = ["--cache-dir", cache, *trainer]
        if "--data" not in extra:  # built here, so that no run's start-up pays for it
            samples = int(extra[extra.index("--mnist1d-samples") + 1]) if "--mnist1d-samples" in extra else 40000
            ensure_mnist1d(cache, num_samples=int(round(samples / 0.8)))
        _, base, _ = _supervised(hosts, Path(tmp), "whole", trainer, args)
        progress.step("without a fault")
        steps = [r for r in base if r["event"] == "step"]
        fresh = next(r for r in base if r["event"] == "start")["startup_s"]
        training = steps[-1]["wall"] - steps[0]["wall"]
        base_acc = [r for r in base if r["event"] == "epoch"][-1]["test_acc"]
        for i in range(args.faults):
            host, after, kind = rng.randrange(args.hosts), rng.uniform(0.1, 0.8) * training, FAULTS[i % 2]
            lines, records, killed = _supervised(hosts, Path(tmp), f"fault{i}", trainer, args, (host, after, kind))
            row = {"fault": kind, "host": hosts.hosts[host].name, **_split(lines, records, killed),
                   "acc": [r for r in records if r["event"] == "epoch"][-1]["test_acc"], "base_acc": base_acc,
                   "fresh_startup": fresh}
            row["target"] = fresh + row["since_save"] + TARGET_SLACK_S
            rows.append(row)
            progress.step(f"fault {i + 1}")
    shape = f"{args.hosts} emulated hosts x {args.ranks_per_host} ranks, links {args.link}, MPICH"
    table = Table(("fault", "host", "at step", "from checkpoint", "detection s", "old job's end s", "probe s",
                   "new job's start-up s", "loading s", "steps redone s", "lost s", "target s", "met",
                   "final test acc %", "without fault %"),
                  title=f"{shape}; python -m hsgd.run -- {' '.join(trainer)}; a fresh job's start-up {fresh:.1f} s",
                  notes=["target: a fresh job's start-up + the old job's seconds since its last checkpoint + "
                         f"{TARGET_SLACK_S:g} s; 'lost': from the kill to the new job's step record at the step "
                         "the old one had reached"])
    for r in rows:
        table.rows.append([r["fault"], r["host"], str(r["at_step"]), str(r["from_step"]), f"{r['detect']:.2f}",
                           f"{r['end']:.2f}", f"{r['probe']:.2f}", f"{r['startup']:.2f}", f"{r['load']:.2f}",
                           f"{r['redo']:.2f}",
                           f"{r['lost']:.1f}", f"{r['target']:.1f}", "yes" if r["lost"] <= r["target"] else "no",
                           f"{100 * r['acc']:.2f}", f"{100 * r['base_acc']:.2f}"])
    return Result([table], rows)
