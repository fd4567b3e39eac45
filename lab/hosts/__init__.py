"""Hosts on one machine: a real TCP network between "nodes", for tests and benchmarks.

On one machine MPI carries "inter-node" bytes through shared memory unless the nodes
are real hosts with their own network stacks. :class:`EmulatedHosts` makes them out
of Linux namespaces (root only): each host has its own network namespace, hostname and
address, and reaches the others through a shaped link and a bridge
(:mod:`lab.hosts._net`); MPI starts ranks on them with TCP forced between hosts
(:mod:`lab.hosts._mpi`), through :mod:`hsgd.bench._launcher`, the launcher that
``hsgd.bench`` and the tests use too. docs/hosts.md. Example (as root)::

    >>> with EmulatedHosts(2, link="1gbit") as hosts:
    ...     cmd = hosts.mpi_command(["python", "-m", "hsgd.train", "--epochs", "1"], ranks_per_host=2)
    ...     before = hosts.counters()
    ...     subprocess.run(cmd, env={**os.environ, **hosts.tcp_env()}, check=True)
    ...     print(hosts.crossed(before))     # bytes each host sent and received
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

from hsgd.bench._launcher import mpi_flavour, mpiexec

from . import _net
from ._mpi import down_marker, launch_command, launcher_options, tcp_env, write_rsh
from ._net import HostsError, HostsUnavailable, format_rate, missing_capability, parse_rate

__all__ = ["EmulatedHosts", "Host", "HostsError", "HostsUnavailable", "parse_rate", "format_rate",
           "missing_capability", "MAX_HOSTS"]

MAX_HOSTS = 200


@dataclass(frozen=True)
class Host:
    """One emulated host: its hostname, address, network namespace, link rate (bits/s or
    ``None``: unshaped) and the outer end of its link (whose counters :meth:`EmulatedHosts.counters` reads)."""
    name: str
    address: str
    netns: str
    rate: Optional[int]
    veth: str


class EmulatedHosts:
    """``count`` hosts on this machine, each on a link of rate ``link``. Made at construction.

    Args:
        count: how many hosts (1 to ``MAX_HOSTS``).
        link: the rate of every host's link (``"1gbit"``, ``"100mbit"``; tc's units, bits per
            second), a list with one rate per host, or ``None``: unshaped.
        guard: start the guard process that removes the hosts if this process dies first.

    Names are unique per run (a random id in every namespace, interface and hostname), so
    runs beside each other do not collide. The hosts are removed, with every process on
    them, by :meth:`close` (the context manager's exit), and by a guard process if the
    owner dies without closing (:mod:`lab.hosts._guard`); ``python -m lab.hosts clean``
    removes what a run whose owner and guard both died left.

    Raises :class:`HostsUnavailable` (with the reason) where namespaces cannot be made,
    ``ValueError`` for bad arguments, :class:`HostsError` if a command fails.
    """

    def __init__(self, count: int = 2, link: Union[None, str, Sequence[Optional[str]]] = "1gbit", *,
                 guard: bool = True):
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"invalid host count {count!r}: use an integer from 1 to {MAX_HOSTS}")
        links = [link] * count if link is None or isinstance(link, str) else list(link)
        if len(links) != count:
            raise ValueError(f"{len(links)} link rates for {count} hosts: give one rate, or one per host")
        rates = [parse_rate(r) for r in links]
        reason = missing_capability()
        if reason is not None:
            raise HostsUnavailable(reason)
        self._state: Optional[Dict] = None
        self._guard: Optional[subprocess.Popen] = None
        state = _net.new_run(count, rates)
        self._state = state
        try:
            if guard:
                self._guard = subprocess.Popen([sys.executable, "-m", "lab.hosts._guard", state["dir"]],
                                               stdin=subprocess.PIPE, text=True, start_new_session=True)
            _net.make(state)
            self.rsh = write_rsh(state)
        except BaseException:
            self.close()
            raise
        self.id, self.subnet, self.bridge = state["id"], state["subnet"], state["bridge"]
        self.hosts = [Host(h["name"], h["address"], h["netns"], h["rate"], h["veth"]) for h in state["hosts"]]

    def __len__(self) -> int:
        return len(self.hosts)

    # --- running things on the hosts ------------------------------------------------------
    def mpi_command(self, args: Sequence[str], ranks_per_host: Union[int, Sequence[int]] = 1,
                    launcher: Optional[str] = None, options: Sequence[str] = ()) -> List[str]:
        """The ``mpiexec`` command line that runs ``args`` (the program and its arguments) with
        ``ranks_per_host`` ranks on every host (or ``ranks_per_host[i]`` on host ``i``).
        ``launcher``: an MPICH or Open MPI ``mpiexec`` (default: the one next to this Python,
        else PATH's); ``options``: more launcher options (``["--with-ft", "ulfm"]``; an Open MPI
        ``--mca NAME VALUE`` replaces the default for ``NAME``: :func:`lab.hosts._mpi.launch_command`).
        Run it with :meth:`tcp_env` in its environment."""
        state = self._check_open()
        counts = [ranks_per_host] * len(self.hosts) if isinstance(ranks_per_host, int) else list(ranks_per_host)
        if len(counts) != len(self.hosts) or any(isinstance(k, bool) or not isinstance(k, int) or k < 0
                                                 for k in counts) or sum(counts) == 0:
            raise ValueError(f"invalid ranks per host {ranks_per_host!r} for {len(self.hosts)} hosts: give "
                             "one count >= 0 for every host (or one for all), at least one rank in all")
        launcher = launcher or mpiexec()
        return launch_command(state, self.rsh, launcher, mpi_flavour(launcher), counts, list(args), options)

    def launcher_options(self, launcher: Optional[str] = None) -> List[str]:
        """The options of ``launcher`` (an MPICH or Open MPI ``mpiexec``; default as in
        :meth:`mpi_command`) that start its ranks on these hosts, to put before a host list of
        their addresses (``-hosts A:K,...`` for MPICH, ``--host A:K,...`` for Open MPI): what
        ``python -m hsgd.run --launcher-args`` takes."""
        state = self._check_open()
        return launcher_options(state, self.rsh, mpi_flavour(launcher or mpiexec()))

    def tcp_env(self, launcher: Optional[str] = None) -> Dict[str, str]:
        """Environment variables that keep the MPI's bytes between the hosts on TCP (add them to
        the job's environment); see :mod:`lab.hosts._mpi`."""
        return tcp_env(mpi_flavour(launcher))

    def exec_command(self, host: int, args: Sequence[str]) -> List[str]:
        """A command line that runs ``args`` on host ``host`` (its namespaces), from this machine."""
        self._check_open()
        return [self.rsh, self.hosts[host].address, *args]

    # --- the links ----------------------------------------------------------------------------
    def counters(self) -> List[Dict[str, int]]:
        """For every host, the bytes it has ``sent`` and ``received`` over its link so far."""
        state = self._check_open()
        return _net.counters(state)

    def crossed(self, before: List[Dict[str, int]]) -> List[Dict[str, int]]:
        """What every host sent and received since ``before`` (an earlier :meth:`counters`)."""
        return [{k: now[k] - then[k] for k in now} for now, then in zip(self.counters(), before)]

    def verify_crossed(self, before: List[Dict[str, int]], nbytes: int, hosts: Optional[Sequence[int]] = None) -> None:
        """Raise :class:`HostsError` unless each of ``hosts`` (default: all) sent and received at
        least ``nbytes`` over its link since ``before`` (an earlier :meth:`counters`): for a job
        that must have moved that much between hosts, the proof that it did not go some other
        way (all hosts share one kernel, so an MPI that looks for shared memory finds it)."""
        crossed = self.crossed(before)
        short = [f"{self.hosts[i].name} sent {crossed[i]['sent']} and received {crossed[i]['received']} bytes"
                 for i in (range(len(self.hosts)) if hosts is None else hosts)
                 if min(crossed[i]["sent"], crossed[i]["received"]) < nbytes]
        if short:
            raise HostsError(f"the traffic did not cross the links ({'; '.join(short)}; expected at least "
                             f"{nbytes} each way): the MPI carried it some other way, most likely shared "
                             f"memory between the hosts' processes; start the job with tcp_env() in its "
                             f"environment ({', '.join(f'{k}={v}' for k, v in self.tcp_env().items())})")

    def set_link(self, host: int, up: bool) -> None:
        """Take host ``host``'s link down (a partition: nothing crosses either way) or up again.
        Up again, a host that :meth:`kill_host` killed answers the remote shell again (it came
        back), and every host forgets the addresses it failed to reach meanwhile: an address
        whose neighbour entry failed is refused (``EHOSTUNREACH``) until the kernel tries it
        again, the likely cause of a job started right after that failed (MPICH's start-up: "Destination is
        unreachable")."""
        state = self._check_open()
        _net._run("ip", "link", "set", self.hosts[host].veth, "up" if up else "down")
        if up:
            down_marker(state, self.hosts[host].name).unlink(missing_ok=True)
            for h in self.hosts:
                _net._run("ip", "-n", h.netns, "neigh", "flush", "all", check=False)
            _net._run("ip", "neigh", "flush", "dev", state["bridge"], check=False)

    def kill_host(self, host: int) -> None:
        """SIGKILL every process on host ``host`` (a host that dies; its link stays up, so the
        kills' resets reach its peers). From the moment before the kill, the remote shell
        refuses the host as a dead one would ("No route to host"), until :meth:`set_link` brings
        it up again: a probe that follows the job's end at once cannot find it alive."""
        state = self._check_open()
        down_marker(state, self.hosts[host].name).touch()
        _net._kill_namespace(self.hosts[host].netns)

    # --- life cycle ---------------------------------------------------------------------------
    def _check_open(self) -> Dict:
        """The run's state; raises :class:`HostsError` once :meth:`close` ran."""
        if self._state is None:
            raise HostsError("these emulated hosts were removed (close() ran)")
        return self._state

    def close(self) -> None:
        """Remove the hosts, with every process on them. Idempotent."""
        state: Optional[Dict] = self._state
        self._state = None
        failed = _net.teardown(state) if state is not None else []
        if self._guard is not None:
            try:
                self._guard.communicate("done" if not failed else "", timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._guard.kill()
            self._guard = None
        if failed:
            assert state is not None  # only a run's teardown fails
            raise HostsError(f"could not remove {', '.join(failed)} (run {state['id']}); "
                             "'python -m lab.hosts clean' tries again")

    def __enter__(self) -> EmulatedHosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._state is None:
            return "EmulatedHosts(closed)"
        hosts = ", ".join(f"{h.name} {h.address} {format_rate(h.rate)}" for h in self.hosts)
        return f"EmulatedHosts({hosts})"
