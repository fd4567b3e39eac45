"""A private Slurm cluster on this machine, for tests: on loopback, or on emulated hosts.

``LocalSlurm`` writes a slurm.conf into a temporary directory, starts one
slurmctld and ``nodes`` slurmd daemons (``slurmd -N n1``, ``-N n2``, ...), and
stops them again. Everything lives under the temporary directory: config,
state, spool, logs and PID files; the ports are picked free at start, so two
clusters (two test runs) do not clash, and a system Slurm, if any, is not
touched.

Where the nodes run:

- By default all daemons listen on 127.0.0.1: a multi-node job is real as far
  as Slurm goes (separate slurmd, separate job steps, PMI across nodes), but
  its ranks share one network stack and one host name, so MPI carries the
  "inter-node" bytes through shared memory or loopback.
- With ``hosts`` (an :class:`lab.hosts.EmulatedHosts`, see
  ``lab/hosts/__init__.py``), node ``n{i+1}`` is host ``i``: its slurmd runs
  in that host's network and UTS namespaces (``hosts.exec_command``), with
  ``NodeAddr`` the host's address and ``NodeHostname`` its name, so a job's
  tasks on different nodes run on different hosts, each with its own
  ``eth0`` and host name, and what MPI sends between them crosses the hosts'
  links (``hosts.counters()``), given ``hosts.tcp_env()`` in the job's
  environment (sbatch passes the submitting environment on). slurmctld stays
  in this machine's network namespace and listens on the hosts' bridge
  (``.1`` of ``hosts.subnet``), which every host reaches over its link, as
  the client commands here do.

  Slurm binds its listening sockets (``CommunicationParameters=NoInAddrAny,
  NoCtldInAddrAny``) to the address that ``gethostname()`` resolves to, and
  the hosts' names resolve nowhere. So every daemon runs in a mount namespace
  of its own with the cluster's ``/etc/hosts`` bind-mounted (``<dir>/hosts``:
  every host's name and address, and slurmctld's own host name, in a UTS
  namespace of its own, for the bridge's address); the job steps, slurmd's
  children, inherit it, so on a host ``srun`` (in a batch script) listens on
  the host's address, where the other hosts' slurmstepd reach it, and the
  hosts resolve each other's names as on a real cluster. This machine's
  ``/etc/hosts`` is never changed. (An ``srun`` or ``salloc`` started here,
  outside the hosts, would listen on 127.0.0.1, where no host can reach it:
  start steps from a batch script.) Under ``ip netns exec`` no cgroup file
  system is mounted, so the cluster's cgroup.conf names cgroup/v1, which
  slurmd loads without one (nothing here uses cgroups). The caller makes the
  hosts and removes them after the cluster (``hosts.close()`` also kills
  whatever still runs on them: job steps, ranks).

    with EmulatedHosts(3, link="1gbit") as hosts, \
            LocalSlurm(nodes=3, cpus_per_node=2, hosts=hosts) as slurm:
        before = hosts.counters()
        job = slurm.submit("scripts/slurm/multi_node.sbatch", ["--epochs", "1"],
                           env=hosts.tcp_env(), sbatch_args=["--nodes=2"], cwd=tmp)
        state = slurm.wait(job, timeout=120)      # "COMPLETED", "FAILED", ...
        hosts.verify_crossed(before, 1 << 20, hosts=[0, 1])

Needs root (slurmd runs jobs as their user and must be able to switch to it;
emulated hosts need CAP_NET_ADMIN and CAP_SYS_ADMIN) and Debian's
``slurmctld slurmd slurm-client`` (see .ci/setup.sh).
``LocalSlurm.unavailable()`` says why a cluster cannot be started here, or
returns None (``lab.hosts.missing_capability()`` says the same for hosts).
Authentication is off (auth/none, cred/none): munge need not run. Keep the
daemons out of reach of other machines: on loopback only 127.0.0.1 reaches
them; on hosts, slurmd listens inside the hosts' namespaces, which have no
route beyond their subnet, and slurmctld on the bridge's private address,
which another machine reaches only if it routes the hosts' subnet to this
one on purpose.

Every subprocess call has a timeout, every wait is bounded, and the daemons are
stopped (SIGTERM, then SIGKILL) by their PID files on exit, even when the test
fails. They are also started with a parent-death signal (on hosts too: the
commands that enter the namespaces exec each other, so our child is the
daemon itself), so a killed test run takes its daemons with it; the guard
process of emulated hosts then removes the hosts and what ran on them.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")

# Job states after which a job will not run again (see squeue(1), JOB STATE CODES).
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED",
}

CMD_TIMEOUT_S = 30  # for one scontrol / sbatch / squeue call

SLURM_CONF = """\
# Private test cluster written by tests/e2e/slurm_cluster.py ({where}).
ClusterName=hsgdtest
# Job ids unique across clusters on this host: MPICH names its shared-memory
# segments after the job step, so two clusters both running job 1 would clash.
FirstJobId={first_job_id}
SlurmctldHost={ctld_host}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# A requeued job may start again after cred_expire seconds (default 120).
AuthInfo=cred_expire=5
# Bind to the address the daemon's host name resolves to, not to every
# interface (slurmd: to its NodeAddr): 127.0.0.1 on loopback; on emulated
# hosts, every daemon runs with this cluster's own /etc/hosts (see LocalSlurm).
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny

StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true

# No cgroups: every emulated node shares this host's processes and cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The nodes may declare more CPUs than the host has.
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
# Fast turnaround for tests.
SlurmctldTimeout=10
SlurmdTimeout=10
InactiveLimit=0
MinJobAge=300
KillWait=5
MessageTimeout=10

{node_lines}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

# On emulated hosts slurmd runs under `ip netns exec`, which mounts a sysfs of
# the host's network namespace over /sys: no cgroup file system under it, and
# slurmd (22.05) will not start unless its cgroup plugin loads. Version 1 loads
# without one mounted, and nothing here uses it (proctrack/linuxproc, task/none).
CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
CgroupAutomount=no
"""

NODE_LINE = ("NodeName={name} NodeHostname={hostname} NodeAddr={addr} "
             "Port={port} CPUs={cpus} RealMemory=1000 State=UNKNOWN")


def _which(binary: str) -> Optional[str]:
    """``binary`` on PATH, or in the sbin directories a user's PATH may lack."""
    return shutil.which(binary) or shutil.which(
        binary, path="/usr/sbin:/usr/local/sbin:/sbin")


def _free_ports(count: int) -> List[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl (not Linux): the daemons are stopped by PID
        pass


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError as exc:
        return f"({exc})"


class SlurmError(RuntimeError):
    pass


class _DaemonDied(SlurmError):
    pass


class LocalSlurm:
    """A slurmctld and ``nodes`` slurmd, in a private temp dir: all on 127.0.0.1,
    or, with ``hosts`` (an :class:`lab.hosts.EmulatedHosts` of at least
    ``nodes`` hosts, which the caller removes after :meth:`cleanup`), node
    ``n{i+1}``'s slurmd on host ``i`` and slurmctld on the hosts' bridge."""

    def __init__(self, nodes: int = 3, cpus_per_node: int = 2,
                 start_timeout: float = 60.0, base_dir: Optional[str] = None,
                 keep_dir: bool = False, hosts=None):
        if hosts is not None and len(hosts) < nodes:
            raise ValueError(f"{nodes} nodes need as many emulated hosts, got {len(hosts)}")
        self.hosts = hosts
        self.node_names = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus_per_node = cpus_per_node
        self.start_timeout = start_timeout
        self._base_dir = base_dir
        self.keep_dir = keep_dir  # keep the temp dir (logs, state) after exit
        self.dir: Optional[Path] = None
        self.conf: Optional[Path] = None
        self.env: Dict[str, str] = {}
        self._procs: Dict[str, subprocess.Popen] = {}

    # ----------------------------------------------------------- availability
    @staticmethod
    def unavailable() -> Optional[str]:
        """Why no cluster can be started here, or None if it can."""
        missing = [b for b in BINARIES if _which(b) is None]
        if missing:
            return (f"Slurm not installed (missing {', '.join(missing)}); "
                    "run .ci/setup.sh as root to install it")
        if os.geteuid() != 0:
            return "a private Slurm cluster needs root (slurmd runs jobs as their user)"
        return None

    # --------------------------------------------------------------- lifecycle
    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.keep_dir:
            self.stop()
        else:
            self.cleanup()

    def start(self, attempts: int = 3) -> None:
        """Start the daemons and wait until every node is idle.

        A daemon that dies at start-up (most likely: another process took one
        of the ports picked) gets a fresh directory and fresh ports, up to
        ``attempts`` times.
        """
        reason = self.unavailable()
        if reason:
            raise SlurmError(reason)
        for attempt in range(1, attempts + 1):
            self.dir = Path(tempfile.mkdtemp(prefix="hsgd-slurm-", dir=self._base_dir))
            try:
                self._write_conf()
                self._spawn("slurmctld", self._ctld_command())
                for i, name in enumerate(self.node_names):
                    self._spawn(f"slurmd-{name}", self._slurmd_command(i, name))
                self._wait_idle()
                return
            except _DaemonDied:
                self.cleanup()
                if attempt == attempts:
                    raise
            except BaseException:
                self.stop()
                raise

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "run", "log", "jobs"):
            (self.dir / sub).mkdir()
        for name in self.node_names:
            (self.dir / "spool" / name).mkdir()
        ctld_port, *node_ports = _free_ports(1 + len(self.node_names))
        if self.hosts is None:
            where = "loopback only"
            ctld_host, ctld_addr = "localhost", "127.0.0.1"
            addrs = [("localhost", "127.0.0.1")] * len(self.node_names)
        else:
            where = f"emulated hosts {self.hosts.id}"
            ctld_host, ctld_addr = self.ctld_hostname, self.ctld_address
            addrs = [(h.name, h.address) for h in self.hosts.hosts[:len(self.node_names)]]
            (self.dir / "cgroup.conf").write_text(CGROUP_CONF)
            # The cluster's names, /etc/hosts for every daemon (in a mount namespace
            # of its own): with NoInAddrAny, Slurm binds to what gethostname() resolves to.
            (self.dir / "hosts").write_text("".join(
                f"{a} {n}\n" for n, a in [("localhost", "127.0.0.1"), (ctld_host, ctld_addr), *addrs]))
        nodes = "\n".join(
            NODE_LINE.format(name=n, hostname=h, addr=a, port=p, cpus=self.cpus_per_node)
            for n, (h, a), p in zip(self.node_names, addrs, node_ports))
        self.conf = self.dir / "slurm.conf"
        first_job_id = random.randrange(1_000_000, 60_000_000, 1000)
        self.conf.write_text(SLURM_CONF.format(d=self.dir, ctld_port=ctld_port,
                                               first_job_id=first_job_id, where=where,
                                               ctld_host=ctld_host, ctld_addr=ctld_addr,
                                               node_lines=nodes))
        # Client commands (and, through sbatch's environment, srun inside jobs)
        # find this cluster through SLURM_CONF.
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if var != "SLURM_CONF":
                del self.env[var]

    @property
    def ctld_hostname(self) -> str:
        """slurmctld's host name (on emulated hosts: its own, in a UTS namespace)."""
        return "localhost" if self.hosts is None else f"hsgd-{self.hosts.id}-ctld"

    @property
    def ctld_address(self) -> str:
        """Where slurmctld listens: 127.0.0.1, or the emulated hosts' bridge."""
        if self.hosts is None:
            return "127.0.0.1"
        return str(next(ipaddress.ip_network(self.hosts.subnet).hosts()))  # the bridge: .1

    def _ctld_command(self) -> List[str]:
        ctld = [_which("slurmctld"), "-D", "-f", str(self.conf)]
        if self.hosts is None:
            return ctld
        # This machine's network, but a host name of its own that the cluster's
        # /etc/hosts gives the bridge's address: slurmctld listens there (only).
        return ["unshare", "--mount", "--propagation", "private", "--uts", "sh", "-c",
                'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"',
                "sh", str(self.dir / "hosts"), self.ctld_hostname, *ctld]

    def _slurmd_command(self, index: int, name: str) -> List[str]:
        slurmd = [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)]
        if self.hosts is None:
            return slurmd
        # On host `index` (its network and host name), with the cluster's
        # /etc/hosts; the job steps are slurmd's children and see the same.
        # exec_command's remote shell joins its arguments into one command line
        # for `sh -c`: quoted, and exec'd, so that our child is slurmd itself.
        return self.hosts.exec_command(index, ["exec", *map(shlex.quote, [
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$1" /etc/hosts && shift && exec "$@"',
            "sh", str(self.dir / "hosts"), *slurmd])])

    def _spawn(self, name: str, cmd: List[str]) -> None:
        log = open(self.dir / "log" / f"{name}.console", "wb")
        with log:
            self._procs[name] = subprocess.Popen(
                cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent)

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        states = ""
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise _DaemonDied(f"{name} exited with {proc.returncode} "
                                      f"during start-up\n{self.logs()}")
            res = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = res.stdout.strip()
            idle = [ln.split()[0] for ln in states.splitlines()
                    if len(ln.split()) == 2 and ln.split()[1] == "idle"]
            if sorted(idle) == sorted(self.node_names):
                return
            time.sleep(0.5)
        raise SlurmError(f"nodes not idle after {self.start_timeout:.0f} s "
                         f"(sinfo: {states!r})\n{self.logs()}")

    def stop(self, timeout: float = 15.0) -> None:
        """Cancel all jobs, then stop every daemon by its PID file."""
        if self.dir is None:
            return
        if self._procs.get("slurmctld") and self._procs["slurmctld"].poll() is None:
            self._run(["scancel", "--quiet", f"--user={os.geteuid()}"], check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not self._run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
                    break
                time.sleep(0.5)
        for name, proc in self._procs.items():
            for pid in self._pids(name, proc):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for name, proc in list(self._procs.items()):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            del self._procs[name]

    def _pids(self, name: str, proc: subprocess.Popen) -> List[int]:
        """The daemon's PID from its PID file, and our child's PID.

        They are the same (the daemons run with -D); a PID file is only
        believed if that process was started with our slurm.conf, so a stale
        or foreign PID is never signalled.
        """
        pids = [proc.pid] if proc.poll() is None else []
        try:
            pid = int((self.dir / "run" / f"{name}.pid").read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return pids
        if str(self.conf).encode() in cmdline and pid not in pids:
            pids.append(pid)
        return pids

    def cleanup(self) -> None:
        """Stop, then remove the temporary directory."""
        self.stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # -------------------------------------------------------------------- jobs
    def _run(self, cmd: List[str], check: bool = True, timeout: float = CMD_TIMEOUT_S,
             env: Optional[Dict[str, str]] = None, cwd=None) -> subprocess.CompletedProcess:
        try:
            res = subprocess.run(cmd, env=env or self.env, cwd=cwd, text=True,
                                 capture_output=True, timeout=timeout,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            if check:
                raise SlurmError(f"{' '.join(cmd)} timed out after {timeout} s") from None
            return subprocess.CompletedProcess(cmd, -1, "", "timeout")
        if check and res.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} failed ({res.returncode}): "
                             f"{res.stdout}{res.stderr}\n{self.logs()}")
        return res

    def submit(self, script, args: Iterable[str] = (), env: Optional[Dict[str, str]] = None,
               sbatch_args: Iterable[str] = (), cwd=None) -> int:
        """``sbatch [sbatch_args] script [args]``; returns the job id.

        ``env`` is added to the submitting environment (a value of None
        removes the variable); sbatch passes that environment on to the job
        (--export=ALL). ``cwd`` is where the job runs and where relative
        ``--output`` paths land (default: ``<dir>/jobs``).
        """
        full_env = dict(self.env)
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = str(value)
        cmd = ["sbatch", "--parsable", *sbatch_args, str(script), *map(str, args)]
        res = self._run(cmd, env=full_env, cwd=cwd or self.dir / "jobs")
        return int(res.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> Dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``ExitCode``, ...)."""
        res = self._run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        info = {}
        for field in res.stdout.split():
            key, sep, value = field.partition("=")
            if sep:
                info.setdefault(key, value)
        return info

    def wait(self, job_id: int, timeout: float = 300.0, poll: float = 0.5) -> str:
        """Poll until the job reaches a final state; returns it.

        Raises SlurmError (with the daemon logs) if it is still not done after
        ``timeout`` seconds; the job is cancelled then.
        """
        deadline = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < deadline:
            state = self.job_info(job_id).get("JobState", "?")
            if state in FINAL_STATES:
                return state
            time.sleep(poll)
        self._run(["scancel", str(job_id)], check=False)
        raise SlurmError(f"job {job_id} not finished after {timeout:.0f} s "
                         f"(state {state})\n{self.logs()}")

    def wait_started(self, job_id: int, started, startup_timeout: float = 60.0,
                     timeout: float = 300.0, poll: float = 0.5,
                     what: str = "its ranks to start") -> Optional[float]:
        """Poll until ``started()`` is true or the job reaches a final state.

        ``started`` is a sign that every rank got past start-up (MPI_Init):
        a file the job writes then. If the job has been RUNNING for
        ``startup_timeout`` seconds without it, start-up has stalled (as when
        the PMI exchange between the MPI library and Slurm goes wrong and
        every rank waits forever): the job is cancelled and SlurmError raised,
        with the job's errors from the daemon logs. ``timeout`` bounds the
        whole wait (a job that never leaves PENDING). Returns the seconds from
        RUNNING to started, or None if the job ended first.
        """
        deadline = time.monotonic() + timeout
        running_since = None
        state = "?"
        while True:
            if started():
                now = time.monotonic()
                return now - running_since if running_since is not None else 0.0
            state = self.job_info(job_id).get("JobState", "?")
            now = time.monotonic()
            if state in FINAL_STATES:
                return None
            if state != "RUNNING":
                running_since = None   # not yet, or again (requeued)
            elif running_since is None:
                running_since = now
            if running_since is not None and now - running_since > startup_timeout:
                if started():   # raced with the job
                    return now - running_since
                self._run(["scancel", str(job_id)], check=False)
                raise SlurmError(
                    f"job {job_id} RUNNING for {now - running_since:.0f} s without "
                    f"{what}: start-up stalled (e.g. in MPI_Init), job cancelled\n"
                    f"{self.job_errors(job_id)}\n{self.logs()}")
            if now > deadline:
                self._run(["scancel", str(job_id)], check=False)
                raise SlurmError(f"timed out after {timeout:.0f} s waiting for {what} "
                                 f"(job {job_id} {state})\n{self.logs()}")
            time.sleep(poll)

    def job_errors(self, job_id: int, limit: int = 40) -> str:
        """The daemon log lines about ``job_id`` that report an error."""
        lines = []
        if self.dir is not None:
            for log in sorted((self.dir / "log").glob("*.log")):
                try:
                    text = log.read_text(errors="replace")
                except OSError:
                    continue
                lines += [f"{log.name}: {ln[:400]}" for ln in text.splitlines()
                          if "error:" in ln and str(job_id) in ln]
        head = f"--- daemon log errors for job {job_id} ---"
        if not lines:
            return f"{head}\n(none)"
        return "\n".join([head, *lines[:limit]] +
                         ([f"... {len(lines) - limit} more"] if len(lines) > limit else []))

    def wait_for(self, condition, timeout: float = 60.0, what: str = "condition",
                 poll: float = 0.2) -> None:
        """Poll ``condition()`` until true; SlurmError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout:.0f} s waiting for "
                                 f"{what}\n{self.logs()}")
            time.sleep(poll)

    def signal(self, job_id: int, sig: str = "USR1") -> None:
        """Send ``sig`` to the job's steps, as ``--signal=SIG@T`` does."""
        self._run(["scancel", f"--signal={sig}", str(job_id)])

    def logs(self) -> str:
        """The tail of every daemon log, for error messages."""
        if self.dir is None:
            return ""
        parts = []
        for log in sorted((self.dir / "log").glob("*.log")):
            parts.append(f"--- {log.name} ---\n{_tail(log)}")
        # A daemon's console only matters if it died before opening its log.
        for console in sorted((self.dir / "log").glob("*.console")):
            if not console.with_suffix(".log").exists():
                parts.append(f"--- {console.name} ---\n{_tail(console)}")
        return "\n".join(parts)
