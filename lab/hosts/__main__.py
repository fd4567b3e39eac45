"""``python -m lab.hosts``: run an MPI program across hosts emulated on this machine (root only).

    python -m lab.hosts run --hosts 2 --ranks-per-host 2 --link 1gbit -- python -m hsgd.train --epochs 1
    python -m lab.hosts clean

``run`` makes the hosts (:class:`lab.hosts.EmulatedHosts`), starts the
program under ``mpiexec`` with its ranks spread over them and TCP forced
between them, prints what every host sent and received over its link, and
removes the hosts, whatever happens; its exit status is the job's.
``clean`` removes what earlier runs left, if their owner and guard both died.
Bad options print one ``error:`` line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import List, Optional, Sequence

from hsgd.bench._launcher import mpi_flavour, root_env

from . import MAX_HOSTS, EmulatedHosts, HostsError, HostsUnavailable, format_rate, parse_rate
from ._net import STATE_ROOT, stale_runs, teardown

__all__ = ["main"]


def _counts(text: str) -> List[int]:
    try:
        counts = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid ranks per host {text!r}: write K or K1,K2,...") from None
    if any(k < 0 for k in counts) or sum(counts) == 0:
        raise argparse.ArgumentTypeError(f"invalid ranks per host {text!r}: counts >= 0, at least one rank")
    return counts


def _links(text: str) -> List[Optional[str]]:
    links: List[Optional[str]] = list(text.split(","))
    for link in links:
        try:
            parse_rate(link)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return links


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab.hosts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run an MPI program across emulated hosts",
                         description="Run PROGRAM under mpiexec with its ranks on emulated hosts.")
    run.add_argument("--hosts", type=int, default=2, help=f"how many hosts, 1 to {MAX_HOSTS} (default 2)")
    run.add_argument("--ranks-per-host", type=_counts, default=[1], metavar="K[,K...]",
                     help="ranks on every host, or one count per host (default 1)")
    run.add_argument("--link", type=_links, default=["1gbit"], metavar="RATE[,RATE...]",
                     help="every host's link rate, or one per host, in tc's units (1gbit, 100mbit; "
                          "'none': unshaped); default 1gbit")
    run.add_argument("--mpiexec", default=None, help="the MPICH or Open MPI mpiexec to use "
                     "(default: the one next to this Python, else PATH's)")
    run.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]: what every rank runs")
    sub.add_parser("clean", help="remove what earlier runs left behind",
                   description=f"Remove the hosts of runs under {STATE_ROOT} whose owner process is gone.")
    return parser


def _spread(values: Sequence, count: int, what: str, parser) -> list:
    if len(values) == 1:
        return list(values) * count
    if len(values) != count:
        parser.error(f"argument {what}: {len(values)} values for {count} hosts: give one, or one per host")
    return list(values)


def _run(args, parser) -> int:
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("no program to run: put it after --, e.g. -- python -m hsgd.train --epochs 1")
    if not 1 <= args.hosts <= MAX_HOSTS:
        parser.error(f"argument --hosts: {args.hosts} is not from 1 to {MAX_HOSTS}")
    counts = _spread(args.ranks_per_host, args.hosts, "--ranks-per-host", parser)
    links = _spread(args.link, args.hosts, "--link", parser)
    try:
        hosts = EmulatedHosts(args.hosts, links)
    except HostsUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with hosts:
        cmd = hosts.mpi_command(program, counts, launcher=args.mpiexec)
        tcp = hosts.tcp_env(args.mpiexec)
        env = {**os.environ, **tcp, **root_env(mpi_flavour(args.mpiexec))}  # Open MPI, as root
        forced = " ".join(f"{k}={v}" for k, v in tcp.items())
        print(f"lab.hosts: {len(hosts)} hosts, ranks {'+'.join(map(str, counts))}, TCP forced ({forced})",
              file=sys.stderr)
        for host in hosts.hosts:
            print(f"lab.hosts:   {host.name}  {host.address}  link {format_rate(host.rate)}", file=sys.stderr)
        before = hosts.counters()
        code = subprocess.run(cmd, env=env).returncode
        for host, moved in zip(hosts.hosts, hosts.crossed(before)):
            print(f"lab.hosts: {host.name} sent {moved['sent'] / 1e6:.1f} MB, received "
                  f"{moved['received'] / 1e6:.1f} MB over its link", file=sys.stderr)
    return code


def _clean() -> int:
    failed = []
    for state in stale_runs():
        left = teardown(state)
        print(f"lab.hosts: run {state['id']}: " + (f"could not remove {', '.join(left)}" if left else "removed"))
        failed += left
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args, parser) if args.command == "run" else _clean()
    except (HostsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
