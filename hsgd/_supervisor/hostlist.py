"""The hosts a supervised job may run on, and which of them answer now.

Hosts come from a hosts file (one ``host[:ranks]`` per line, ``#`` comments), read again
before every start so that a host added to it joins at the next restart, or from
Slurm's allocation (``SLURM_JOB_NODELIST``, expanded by ``scontrol show hostnames``).
A host *answers* when the job's own launcher starts a process on it within the probe
timeout: ``mpiexec`` (or ``srun``) running ``true`` there, one probe per host, all at
once, so the wait is one timeout however many hosts are gone.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..bench._launcher import kill_tree
from ..errors import InputFileNotFoundError, InputValueError

__all__ = ["Host", "read_hosts_file", "slurm_hosts", "check_resolvable", "probe"]

_LINE = re.compile(r"^([A-Za-z0-9_.\-\[\]:]+?)(?::(\d+))?$")


@dataclass(frozen=True)
class Host:
    """A host by the name its launcher takes, and how many ranks it runs."""
    name: str
    ranks: int


def read_hosts_file(path, ranks_per_host: Optional[int] = None) -> List[Host]:
    """The hosts in ``path``, in order: ``host`` or ``host:ranks`` per line, blank lines and
    ``#`` comments skipped; a line without ``:ranks`` (or every line, with ``ranks_per_host``)
    gets ``ranks_per_host`` (default 1). Raises :class:`~hsgd.errors.InputError` saying which
    line is wrong."""
    path = Path(path)
    if not path.is_file():
        raise InputFileNotFoundError(f"no hosts file {path}: write one host (host or host:ranks) per line")
    hosts: List[Host] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None or (match.group(2) is not None and int(match.group(2)) < 1):
            raise InputValueError(f"{path}:{number}: {raw.strip()!r} is not host or host:ranks (ranks >= 1)")
        ranks = ranks_per_host or int(match.group(2) or 1)
        if any(h.name == match.group(1) for h in hosts):
            raise InputValueError(f"{path}:{number}: host {match.group(1)!r} is listed twice")
        hosts.append(Host(match.group(1), ranks))
    if not hosts:
        raise InputValueError(f"{path} names no host: write one host (host or host:ranks) per line")
    return hosts


def slurm_hosts(env: Dict[str, str], ranks_per_host: Optional[int] = None) -> List[Host]:
    """The nodes of this Slurm allocation, each with ``ranks_per_host`` ranks (default:
    ``SLURM_NTASKS_PER_NODE``, else the first count of ``SLURM_TASKS_PER_NODE``, else 1)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise InputValueError("--slurm outside a Slurm allocation (no SLURM_JOB_NODELIST): run it in a "
                              "batch script, or pass --hosts-file")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or not out.stdout.split():
        raise InputValueError(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
    first = re.match(r"\d+", env.get("SLURM_TASKS_PER_NODE", ""))  # "2(x3),1": 2
    ranks = ranks_per_host or int(env.get("SLURM_NTASKS_PER_NODE") or (first.group(0) if first else 1))
    return [Host(name, ranks) for name in out.stdout.split()]


def check_resolvable(hosts: Sequence[Host], where: str) -> None:
    """Raise :class:`~hsgd.errors.InputValueError` naming the first host whose name does
    not resolve to an address (a typo in ``where``)."""
    for host in hosts:
        try:
            socket.getaddrinfo(host.name, None)
        except (socket.gaierror, UnicodeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise InputValueError(f"unknown host {host.name!r} in {where} ({why}): fix the name, or remove "
                                  "the line") from None


def probe(hosts: Sequence[Host], command, timeout: float, env: Dict[str, str]) -> List[Host]:
    """The hosts, of ``hosts``, on which ``command(host)`` (a launcher starting ``true``
    there) ends with status 0 within ``timeout`` seconds; all probed at once."""
    answered: Dict[str, bool] = {}

    def one(host: Host) -> None:
        proc = subprocess.Popen(command(host), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            answered[host.name] = proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            answered[host.name] = False
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in hosts]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout + 5
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [h for h in hosts if answered.get(h.name)]

