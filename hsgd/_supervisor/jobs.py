"""Starting the supervised MPI job, probing hosts with the same launcher, and following the job.

Three launchers: MPICH's hydra (``mpiexec -hosts A:K,B:K``), Open MPI's PRRTE
(``mpiexec --host A:K,B:K``) and Slurm's ``srun`` inside an allocation (``--nodelist``);
``extra`` (``--launcher-args``) goes right after the launcher, for a remote shell,
network interfaces or ``--mpi=pmi2``. :func:`run_job` starts the job in a session of its
own, passes on the signals the supervisor gets (SIGTERM, SIGUSR1, SIGINT), reads the run's
``metrics.jsonl`` as the job writes it, and returns the job's exit status; the job
inherits the supervisor's output, so its lines appear as they would without one.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from ..bench._launcher import kill_tree, root_env
from .hostlist import Host
from .journal import JobRecords, Journal

__all__ = ["LAUNCHERS", "launch_command", "probe_command", "launcher_env", "run_job", "FORWARDED"]

LAUNCHERS = ("mpich", "openmpi", "srun")
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_POLL_S = 0.2


def _placement(launcher: str, hosts: Sequence[Host]) -> List[str]:
    if launcher == "srun":
        return ["--nodelist", ",".join(h.name for h in hosts), "--nodes", str(len(hosts)),
                "--ntasks-per-node", str(hosts[0].ranks), "--ntasks", str(sum(h.ranks for h in hosts))]
    spec = ",".join(f"{h.name}:{h.ranks}" for h in hosts)
    return ["-hosts" if launcher == "mpich" else "--host", spec, "-n", str(sum(h.ranks for h in hosts))]


def launch_command(launcher: str, mpiexec: str, extra: Sequence[str], hosts: Sequence[Host],
                   program: Sequence[str], forward: Sequence[str] = ()) -> List[str]:
    """The command line that runs ``program`` with ``host.ranks`` ranks on each of ``hosts``,
    with the environment variables named in ``forward`` in the ranks' environment (hydra and
    srun pass on the whole environment; Open MPI's launcher only what ``-x`` names)."""
    passed = [word for name in forward for word in ("-x", name)] if launcher == "openmpi" else []
    return [mpiexec if launcher != "srun" else "srun", *extra, *passed, *_placement(launcher, hosts), *program]


def probe_command(launcher: str, mpiexec: str, extra: Sequence[str], host: Host) -> List[str]:
    """The command line that starts ``true`` on ``host`` the way the job starts its ranks."""
    return launch_command(launcher, mpiexec, extra, [Host(host.name, 1)], ["true"])


def launcher_env(launcher: str, env: Dict[str, str]) -> Dict[str, str]:
    """``env`` plus what the launcher needs here (Open MPI as root)."""
    return {**env, **root_env("openmpi" if launcher == "openmpi" else "mpich")}


def run_job(cmd: Sequence[str], env: Dict[str, str], journal: Journal,
            on_records: Optional[Callable[[List[dict]], None]] = None, startup_timeout: float = 0.0) -> tuple:
    """Run ``cmd`` to its end: ``(exit status, JobRecords, signal received or None)``.

    ``on_records(records)`` hears every batch of new records while the job runs. A signal
    the supervisor receives goes to the job's launcher, which passes it to the ranks (the
    trainer then checkpoints and exits 75). A job that has written no ``start`` record
    ``startup_timeout`` seconds after its launch (0: no limit) is killed, launcher and ranks,
    and its records say so (``startup_timed_out``): a launch can hang before any rank runs
    hsgd's code, where no stall inspector watches."""
    records = JobRecords()
    received: List[int] = []
    launched = time.monotonic()
    proc = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    def forward(signum, frame):
        received.append(signum)
        try:
            proc.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)
        except ProcessLookupError:
            pass
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        while True:
            ended = proc.poll() is not None
            new = journal.read_new()
            for record in new:
                records.take(record)
            if new and on_records is not None:
                on_records(new)
            if ended:
                break
            if startup_timeout and records.start is None and time.monotonic() - launched > startup_timeout:
                records.startup_timed_out = startup_timeout
                kill_tree(proc.pid)
                proc.wait()
                break
            time.sleep(_POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # the supervisor itself is going down: the job with it
            kill_tree(proc.pid)
            proc.wait()
    sys.stdout.flush()
    return proc.returncode, records, (received[0] if received else None)
