"""Starting a benchmark's MPI jobs: on this host or across emulated hosts.

The subcommands that measure on several ranks run ``python -m hsgd.bench`` itself under
``mpiexec`` (:func:`run_workers`): every rank re-parses the same options and calls the
subcommand's ``worker(args)``; rank 0 writes what it returns to a JSON file that the
launching process reads back. The training benchmarks run ``python -m hsgd.train`` the
same way (:func:`job`, :func:`run_job`). The command line, the jobs' environment and
the timeout that kills a job whole are :mod:`hsgd.hosts._launcher`'s, the launcher the
tests use too. With ``--hosts`` (:func:`add_hosts_options`, :func:`placement`) the jobs
run across hosts emulated on this machine (:class:`hsgd.hosts.EmulatedHosts`), TCP
forced between them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ..hosts import MAX_HOSTS, EmulatedHosts, HostsUnavailable, _launcher, format_rate, parse_rate
from ..hosts._launcher import JobHung, mpi_command, mpi_env
from ._harness import Progress

__all__ = ["job", "run_job", "run_workers", "run_per_rank_count", "free_port", "add_hosts_options",
           "check_hosts_options", "placement", "Placement"]


class Placement(NamedTuple):
    """Where a benchmark's jobs run: ``ranks_per_host[i]`` ranks on each of ``hosts``, emulated
    hosts on this machine (:class:`hsgd.hosts.EmulatedHosts`, TCP between them)."""
    hosts: EmulatedHosts
    ranks_per_host: List[int]

    @property
    def ranks(self) -> int:
        return sum(self.ranks_per_host)

    def describe(self) -> str:
        rates = sorted({format_rate(h.rate) for h in self.hosts.hosts})
        return (f"{len(self.hosts)} emulated hosts ({'+'.join(map(str, self.ranks_per_host))} ranks, "
                f"links {'/'.join(rates)}, TCP)")


def run_job(cmd: Sequence[str], env: Dict[str, str], timeout: Optional[float] = None
            ) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end, output captured (:func:`hsgd.hosts._launcher.run_job`); after
    ``timeout`` seconds it is killed, ranks included, and ``SystemExit`` raised with its output."""
    try:
        return _launcher.run_job(cmd, env, timeout)
    except JobHung as hung:
        raise SystemExit(f"hsgd.bench: {hung}\n--- stdout ---\n{hung.out[-3000:]}\n"
                         f"--- stderr ---\n{hung.err[-3000:]}") from None


def job(args: Sequence[str], ranks: int, where: Optional[Placement] = None, env: Optional[Dict[str, str]] = None,
        drop: Sequence[str] = (), one_thread: bool = True) -> Tuple[List[str], Dict[str, str]]:
    """The command line and environment (:func:`~hsgd.hosts._launcher.mpi_env`, with ``env``,
    ``drop`` and ``one_thread``) of ``python ARGS`` on ``ranks`` ranks of this host or, with
    ``where``, on its emulated hosts (its own rank count), TCP forced between them."""
    if where is None:
        return mpi_command(ranks, args), mpi_env(env, drop=drop, one_thread=one_thread)
    cmd = where.hosts.mpi_command([sys.executable, *args], where.ranks_per_host)
    return cmd, mpi_env({**where.hosts.tcp_env(), **(env or {})}, drop=drop, one_thread=one_thread)


def add_hosts_options(p) -> None:
    """``--hosts``, ``--link``, ``--ranks-per-host``: run the jobs across emulated hosts."""
    group = p.add_argument_group("across hosts emulated on this machine (root only; see python -m hsgd.hosts)")
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
        raise SystemExit(f"hsgd.bench: --hosts: {exc}") from None
    with hosts:
        yield Placement(hosts, args.host_ranks)


def run_workers(subcommand: str, ranks: int, argv: Sequence[str], timeout: Optional[float] = None,
                drop_env: Sequence[str] = (), where: Optional[Placement] = None):
    """``mpiexec -n RANKS python -m hsgd.bench SUBCOMMAND ARGV --worker-out FILE``: every rank
    runs the subcommand's ``worker(args)``; returns what rank 0's returned (JSON round trip).
    With ``where`` (a :class:`Placement`), across its emulated hosts instead (``ranks`` is then
    its rank count), TCP forced between them.

    The workers start with :func:`hsgd.faults.protect`: an exception on one
    rank aborts the job instead of leaving the others in a collective, and
    MPI's files are unlinked, so an aborted job leaves nothing behind.
    """
    with tempfile.TemporaryDirectory(prefix="hsgd-bench-") as tmp:
        out = Path(tmp) / "worker.json"
        args = ["-m", "hsgd.bench", subcommand, *argv, "--worker-out", str(out)]
        cmd, env = job(args, ranks, where, drop=drop_env)
        ranks = ranks if where is None else where.ranks
        proc = run_job(cmd, env, timeout)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"hsgd.bench {subcommand}: the job on {ranks} ranks failed "
                             f"(exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def run_per_rank_count(subcommand: str, args, timeout: Optional[float] = None, gloo: bool = False,
                       drop_env: Sequence[str] = ()) -> list:
    """:func:`run_workers` once for each rank count in ``args.ranks`` (with ``--hosts``: once,
    across the emulated hosts), progress on stderr; the rows the jobs returned, in order.
    ``gloo``: each job gets a free TCP port (``--port``) on which its ranks start
    ``torch.distributed``."""
    rows = []
    with placement(args) as where:
        counts = args.ranks if where is None else [where.ranks]  # --hosts: one job, its ranks
        with Progress(len(counts), f"hsgd.bench {subcommand}", args.progress) as progress:
            for ranks in counts:
                port = ["--port", str(free_port())] if gloo else []
                if gloo and where is not None:  # gloo's store on the first host, reached over its link
                    port += ["--master-addr", where.hosts.hosts[0].address]
                rows += run_workers(subcommand, ranks, [*args._argv, *port], timeout=timeout, drop_env=drop_env,
                                    where=where)
                progress.step(f"{ranks} ranks" if where is None else where.describe())
    return rows


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
