"""Starting MPI ranks on emulated hosts, with TCP forced between them.

Both launchers start their daemons through a remote shell, called as ``RSH [options]
HOST COMMAND...``; for emulated hosts that shell is a small script (:func:`write_rsh`)
that runs ``COMMAND`` in ``HOST``'s UTS and network namespaces (``nsenter --uts`` then
``ip netns exec``, which also gives the host its own ``/sys/class/net``). Ranks fill
the hosts in order: ranks ``0..K1-1`` on the first host, and so on.

Every host runs on one kernel, so an MPI that looks for shared memory finds it between
the hosts too, and the bytes never cross the links: :func:`tcp_env` and
:func:`launch_command` keep them on TCP, and
:meth:`lab.hosts.EmulatedHosts.counters` then shows what crossed.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Dict, List, Sequence

__all__ = ["down_marker", "write_rsh", "launch_command", "launcher_options", "tcp_env"]


def down_marker(state: Dict, name: str) -> Path:
    """The file whose presence makes the remote shell refuse host ``name``: a dead host
    (``EmulatedHosts.kill_host``) answers no one, whatever its link."""
    return Path(state["dir"]) / f"down-{name}"


def write_rsh(state: Dict) -> str:
    """Write the run's remote shell script; return its path."""
    cases = "\n".join(
        f"  {h['address']}|{h['name']}) ns={shlex.quote(h['netns'])}; uts={shlex.quote(h['uts'])}; "
        f"down={shlex.quote(str(down_marker(state, h['name'])))};;"
        for h in state["hosts"])
    script = f"""#!/bin/sh
# lab.hosts, run {state['id']}: the remote shell that MPI's launchers call as
# "$0 [options] HOST COMMAND...": COMMAND runs on the emulated host HOST.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-l|-p|-i|-F) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
host=$1
shift
case "$host" in
{cases}
  *) echo "lab.hosts: no emulated host '$host' in run {state['id']}" >&2; exit 255;;
esac
if [ -e "$down" ]; then
  echo "ssh: connect to host $host port 22: No route to host" >&2; exit 255
fi
exec nsenter --uts="$uts" -- ip netns exec "$ns" sh -c "$*"
"""
    path = Path(state["dir"]) / "rsh"
    path.write_text(script)
    os.chmod(path, 0o755)
    return str(path)


def launcher_options(state: Dict, rsh: str, flavour: str, options: Sequence[str] = ()) -> List[str]:
    """The options that make an ``mpiexec`` of ``flavour`` start its daemons on the emulated hosts
    and keep its bytes on their subnet (the ones before the host list; see :func:`launch_command`),
    then ``options``; an Open MPI ``--mca NAME VALUE`` among them replaces the value for NAME."""
    if flavour == "openmpi":
        subnet = state["subnet"]
        mca = {"plm_rsh_agent": rsh, "oob_tcp_if_include": subnet, "btl_tcp_if_include": subnet, "pml": "ob1",
               "btl": "tcp,sm,self"}
        rest = _take_mca(options, mca)
        return ["--bind-to", "none", *[word for name, value in mca.items() for word in ("--mca", name, value)],
                *rest]
    return ["-launcher", "ssh", "-launcher-exec", rsh, "-iface", state["bridge"], *options]


def launch_command(state: Dict, rsh: str, launcher: str, flavour: str, ranks_per_host: Sequence[int],
                   args: Sequence[str], options: Sequence[str] = ()) -> List[str]:
    """``mpiexec`` (``launcher``, an ``"mpich"`` or ``"openmpi"`` one) running ``args`` with
    ``ranks_per_host[i]`` ranks on host ``i``.

    MPICH (hydra): ``mpiexec -launcher ssh -launcher-exec RSH -iface BRIDGE -hosts
    A1:K1,A2:K2 -n N ...``; the proxies call back to ``mpiexec`` on the bridge's address.
    Open MPI (PRRTE): ``mpiexec --mca plm_rsh_agent RSH --host A1:K1,A2:K2 -n N ...``, its
    daemons' and the byte transfer layer's TCP kept on the hosts' subnet, the ``ob1``
    messaging layer over ``tcp,sm,self`` (``sm`` only between ranks that PRRTE places on one
    host), no binding to cores (every host shares this machine's cores).

    ``options``: more launcher options, put before the program (``--with-ft ulfm``); for Open MPI an
    ``--mca NAME VALUE`` among them replaces this function's value for ``NAME`` (``--mca btl
    tcp,self``) instead of repeating it."""
    placed = [(h, k) for h, k in zip(state["hosts"], ranks_per_host) if k > 0]
    hosts = ",".join(f"{h['address']}:{k}" for h, k in placed)
    total = str(sum(k for _, k in placed))
    args = [*_thread_share(int(total)), *args]
    where = ["--host", hosts] if flavour == "openmpi" else ["-hosts", hosts]
    return [launcher, *launcher_options(state, rsh, flavour, options), *where, "-n", total, *args]


def _take_mca(options: Sequence[str], mca: Dict[str, str]) -> List[str]:
    """Move every ``--mca NAME VALUE`` of ``options`` into ``mca`` (replacing a default); the rest."""
    rest, words = [], list(options)
    while words:
        word = words.pop(0)
        if word == "--mca" and len(words) >= 2:
            name, value = words.pop(0), words.pop(0)
            mca[name] = value
        else:
            rest.append(word)
    return rest


def _thread_share(ranks: int) -> List[str]:
    """A prefix that sets ``OMP_NUM_THREADS`` to this machine's cores / ``ranks`` in the rank's
    environment, unless the rank's environment already has it (the job's, as the launcher
    passes it on): the emulated hosts share this machine's cores, which a rank cannot see (its
    host's ranks are all it finds), so by the host's count every rank would take every core,
    and the trainer's compute on 2 hosts x 1 rank, 2 cores, was many times slower."""
    share = max(1, len(os.sched_getaffinity(0)) // max(1, ranks))
    return ["sh", "-c", f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{share}}}"; exec "$@"', "hsgd-rank"]


def tcp_env(flavour: str) -> Dict[str, str]:
    """The variables that keep the MPI's bytes between hosts on TCP.

    MPICH's default UCX network module uses shared memory between ranks of one kernel:
    ``UCX_TLS=tcp,self`` (and ``FI_PROVIDER=tcp`` for MPICH's OFI module). Ranks on one host
    still meet through MPICH's own shared memory, as on a real node. Open MPI's UCX
    components would do the same: ``ob1`` over ``tcp,sm,self``, one-sided operations over it."""
    if flavour == "openmpi":
        # The hosts share this machine's cores, which PRRTE does not know: without yielding, a
        # rank that polls starves the others (an 8 MB allreduce: docs/hosts.md).
        return {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,sm,self", "OMPI_MCA_osc": "sm,rdma",
                "OMPI_MCA_mpi_yield_when_idle": "1"}
    return {"UCX_TLS": "tcp,self", "FI_PROVIDER": "tcp"}
