"""Starting a benchmark's MPI jobs.

The subcommands that measure on several ranks run ``python -m hsgd.bench`` itself under
``mpiexec`` (:func:`run_workers`): every rank re-parses the same options and calls the
subcommand's ``worker(args)``; rank 0 writes what it returns to a JSON file that the
launching process reads back. The command line, the jobs' environment and the timeout
that kills a job whole are :mod:`hsgd.bench._launcher`'s, the launcher the tests use
too.

``where``: the lab beside the package (``lab.bench``) runs the same jobs across hosts
emulated on this machine; it passes a placement with ``ranks``, ``describe()`` and
``hosts`` (``mpi_command(argv, ranks_per_host)``, ``tcp_env()``, ``hosts[0].address``).
Without one (``None``), every job runs on this host, or wherever the user's ``mpiexec``
places its ranks.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _launcher
from ._harness import Progress
from ._launcher import JobHung, mpi_command, mpi_env

__all__ = ["job", "run_job", "run_workers", "run_per_rank_count", "free_port"]


def run_job(cmd: Sequence[str], env: Dict[str, str], timeout: Optional[float] = None
            ) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end, output captured (:func:`hsgd.bench._launcher.run_job`); after
    ``timeout`` seconds it is killed, ranks included, and ``SystemExit`` raised with its output."""
    try:
        return _launcher.run_job(cmd, env, timeout)
    except JobHung as hung:
        raise SystemExit(f"hsgd.bench: {hung}\n--- stdout ---\n{hung.out[-3000:]}\n"
                         f"--- stderr ---\n{hung.err[-3000:]}") from None


def job(args: Sequence[str], ranks: int, where: Any = None, env: Optional[Dict[str, str]] = None,
        drop: Sequence[str] = (), one_thread: bool = True) -> Tuple[List[str], Dict[str, str]]:
    """The command line and environment (:func:`~hsgd.bench._launcher.mpi_env`, with ``env``,
    ``drop`` and ``one_thread``) of ``python ARGS`` on ``ranks`` ranks of this host or, with
    ``where`` (the lab's emulated hosts), on its hosts (its own rank count), TCP forced between them."""
    if where is None:
        return mpi_command(ranks, args), mpi_env(env, drop=drop, one_thread=one_thread)
    cmd = where.hosts.mpi_command([sys.executable, *args], where.ranks_per_host)
    return cmd, mpi_env({**where.hosts.tcp_env(), **(env or {})}, drop=drop, one_thread=one_thread)


def run_workers(subcommand: str, ranks: int, argv: Sequence[str], timeout: Optional[float] = None,
                drop_env: Sequence[str] = (), where: Any = None, package: str = "hsgd.bench"):
    """``mpiexec -n RANKS python -m PACKAGE SUBCOMMAND ARGV --worker-out FILE``: every rank
    runs the subcommand's ``worker(args)``; returns what rank 0's returned (JSON round trip).
    With ``where``, across its emulated hosts instead (``ranks`` is then its rank count).

    The workers start with :func:`hsgd.faults.protect`: an exception on one
    rank aborts the job instead of leaving the others in a collective, and
    MPI's files are unlinked, so an aborted job leaves nothing behind.
    """
    with tempfile.TemporaryDirectory(prefix="hsgd-bench-") as tmp:
        out = Path(tmp) / "worker.json"
        args = ["-m", package, subcommand, *argv, "--worker-out", str(out)]
        cmd, env = job(args, ranks, where, drop=drop_env)
        ranks = ranks if where is None else where.ranks
        proc = run_job(cmd, env, timeout)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"{package} {subcommand}: the job on {ranks} ranks failed "
                             f"(exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def run_per_rank_count(subcommand: str, args, timeout: Optional[float] = None, gloo: bool = False,
                       drop_env: Sequence[str] = (), where: Any = None) -> list:
    """:func:`run_workers` once for each rank count in ``args.ranks`` (with ``where``: once,
    across its emulated hosts), progress on stderr; the rows the jobs returned, in order.
    ``gloo``: each job gets a free TCP port (``--port``) on which its ranks start
    ``torch.distributed``. The jobs run ``python -m`` the package that parsed ``args``."""
    package = args._package
    rows = []
    counts = args.ranks if where is None else [where.ranks]  # across hosts: one job, its ranks
    with Progress(len(counts), f"{package} {subcommand}", args.progress) as progress:
        for ranks in counts:
            port = ["--port", str(free_port())] if gloo else []
            if gloo and where is not None:  # gloo's store on the first host, reached over its link
                port += ["--master-addr", where.hosts.hosts[0].address]
            rows += run_workers(subcommand, ranks, [*args._argv, *port], timeout=timeout, drop_env=drop_env,
                                where=where, package=package)
            progress.step(f"{ranks} ranks" if where is None else where.describe())
    return rows


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
