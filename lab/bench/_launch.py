"""Starting a lab benchmark's MPI jobs: on this host or across emulated hosts.

The jobs start as the package's benchmarks start theirs (:mod:`hsgd.bench._launch`):
the subcommands that measure on several ranks run ``python -m lab.bench`` itself under
``mpiexec`` (:func:`run_workers`), every rank calling the subcommand's ``worker(args)``;
the training benchmarks run ``python -m hsgd.train`` the same way (:func:`job`,
:func:`run_job`). With ``--hosts`` (:func:`add_hosts_options`, :func:`placement`) the
jobs run across hosts emulated on this machine (:class:`lab.hosts.EmulatedHosts`), TCP
forced between them.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Iterator, List, NamedTuple, Optional, Sequence

from hsgd.bench import _launch as here
from hsgd.bench._launch import free_port, job, run_job

from ..hosts import MAX_HOSTS, EmulatedHosts, HostsUnavailable, format_rate, parse_rate

__all__ = ["job", "run_job", "run_workers", "run_per_rank_count", "free_port", "add_hosts_options",
           "check_hosts_options", "placement", "Placement"]


class Placement(NamedTuple):
    """Where a benchmark's jobs run: ``ranks_per_host[i]`` ranks on each of ``hosts``, emulated
    hosts on this machine (:class:`lab.hosts.EmulatedHosts`, TCP between them)."""
    hosts: EmulatedHosts
    ranks_per_host: List[int]

    @property
    def ranks(self) -> int:
        return sum(self.ranks_per_host)

    def describe(self) -> str:
        rates = sorted({format_rate(h.rate) for h in self.hosts.hosts})
        return (f"{len(self.hosts)} emulated hosts ({'+'.join(map(str, self.ranks_per_host))} ranks, "
                f"links {'/'.join(rates)}, TCP)")


def add_hosts_options(p) -> None:
    """``--hosts``, ``--link``, ``--ranks-per-host``: run the jobs across emulated hosts."""
    group = p.add_argument_group("across hosts emulated on this machine (root only; see python -m lab.hosts)")
    group.add_argument("--hosts", type=int, default=0, help="run each job across this many emulated hosts, "
                       "each with its own network stack and a shaped link, TCP between them; 0: on this "
                       "host only (0)")
    group.add_argument("--link", default="1gbit", metavar="RATE[,RATE...]",
                       help="every host's link rate in tc's units, or one per host (1gbit)")
    group.add_argument("--ranks-per-host", default="1", metavar="K[,K...]",
                       help="ranks on every host, or one count per host (1)")
    group.add_argument("--master-addr", dest="_master", default=None, help=argparse.SUPPRESS)  # gloo's, by run


def check_hosts_options(args, parser, min_ranks: int = 1, why: str = "") -> None:
    """``parser.error()`` for bad ``--hosts``/``--link``/``--ranks-per-host`` (fewer than
    ``min_ranks`` ranks in all: ``why`` says why they are needed); sets ``args.link_rates`` and
    ``args.host_ranks`` (lists, one per host) when ``--hosts`` is set."""
    if args.hosts == 0:
        return
    if not 1 <= args.hosts <= MAX_HOSTS:
        parser.error(f"argument --hosts: {args.hosts} is not from 0 to {MAX_HOSTS}")

    def per_host(text: str, what: str) -> List[str]:
        values = text.split(",")
        if len(values) not in (1, args.hosts):
            parser.error(f"argument {what}: {len(values)} values for {args.hosts} hosts: give one, or one per host")
        return values * args.hosts if len(values) == 1 else values

    args.link_rates = per_host(args.link, "--link")
    for rate in args.link_rates:
        try:
            parse_rate(rate)
        except ValueError as exc:
            parser.error(f"argument --link: {exc}")
    try:
        args.host_ranks = [int(k) for k in per_host(args.ranks_per_host, "--ranks-per-host")]
    except ValueError:
        parser.error(f"argument --ranks-per-host: {args.ranks_per_host!r} is not K or K1,K2,...")
    if any(k < 0 for k in args.host_ranks) or sum(args.host_ranks) == 0:
        parser.error("argument --ranks-per-host: counts >= 0, at least one rank in all")
    if sum(args.host_ranks) < min_ranks:
        parser.error(f"argument --ranks-per-host: {min_ranks} ranks or more in all{why}")


@contextlib.contextmanager
def placement(args) -> Iterator[Optional[Placement]]:
    """The emulated hosts of ``--hosts`` (made here, removed on exit), or ``None``: this host."""
    if not getattr(args, "hosts", 0):
        yield None
        return
    try:
        hosts = EmulatedHosts(args.hosts, args.link_rates)
    except HostsUnavailable as exc:
        raise SystemExit(f"lab.bench: --hosts: {exc}") from None
    with hosts:
        yield Placement(hosts, args.host_ranks)


def run_workers(subcommand: str, ranks: int, argv: Sequence[str], timeout: Optional[float] = None,
                drop_env: Sequence[str] = (), where: Optional[Placement] = None):
    """:func:`hsgd.bench._launch.run_workers` of ``python -m lab.bench SUBCOMMAND``: every rank runs
    the subcommand's ``worker(args)``; with ``where``, across its emulated hosts."""
    return here.run_workers(subcommand, ranks, argv, timeout=timeout, drop_env=drop_env, where=where,
                            package="lab.bench")


def run_per_rank_count(subcommand: str, args, timeout: Optional[float] = None, gloo: bool = False,
                       drop_env: Sequence[str] = ()) -> list:
    """:func:`hsgd.bench._launch.run_per_rank_count` across the emulated hosts of ``--hosts``
    (made here, removed after), else once per rank count in ``args.ranks``."""
    with placement(args) as where:
        return here.run_per_rank_count(subcommand, args, timeout=timeout, gloo=gloo, drop_env=drop_env,
                                       where=where)
