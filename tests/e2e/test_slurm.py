"""Slurm, for real: the project's batch scripts on a private cluster of emulated hosts.

tests/e2e/slurm_cluster.py starts a slurmctld and three slurmd (nodes n1..n3)
for this module, and every test submits one of scripts/slurm/*.sbatch with
sbatch and polls the job to its end. Each slurmd runs on a host of its own
(lab.hosts: network and UTS namespaces, 1 Gbit/s links to a bridge, where
slurmctld listens), so the ranks of a multi-node job run on different hosts,
each with its own host name and network stack, hsgd finds those hosts as its
nodes (MPI_COMM_TYPE_SHARED; HSGD_EMULATED_NODES is not set), and MPI's bytes
between them cross the links (the job's environment carries the hosts'
tcp_env(): all hosts share one kernel, and UCX would take shared memory).
test_script_launches_ranks_across_nodes checks all three, the bytes with the
links' counters.

Trainer CLI these tests rely on (python -m hsgd.train; see train_args below):
    --epochs N           number of epochs
    --run-dir DIR        writes DIR/metrics.jsonl: JSON lines, among them
                         {"event": "epoch", "epoch": E, ..., "test_acc": <float>}
    --model mlp, --mnist1d-samples 2000, --cache-dir DIR
                         a small model on a small generated MNIST-1D, cached
                         once for the module
    --log-every 1, --resume   (requeue test) agree on a signal at every step;
                         resume from the latest checkpoint after the requeue
    exit status 75       after SIGUSR1: checkpoint saved, requeue me (the
                         protocol is described in the scripts' comments)

The plumbing tests swap `-m hsgd.train` in a copy of each script for a small
mpi4py probe (PROBE below), so they check launch, node layout and the
signal/requeue path independently of the trainer.

A job whose ranks are not past MPI_Init STARTUP_TIMEOUT_S after it started
(the probe's started.* files, the trainer's config.json) is cancelled and the
test fails with the daemons' errors for it, instead of at JOB_TIMEOUT_S.

Needs root and Slurm (Debian: slurmctld slurmd slurm-client; .ci/setup.sh
installs them). Without them the tests skip, except under CI=true, where a
missing Slurm means the CI setup is broken and the tests fail. The multi-node
tests also need emulated hosts (CAP_NET_ADMIN and CAP_SYS_ADMIN): where they
cannot be made, the cluster runs on loopback for the single-node tests, and
the multi-node ones skip with the reason, or fail under CI=true (the rule of
tests/hosts/conftest.py).
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.hosts import EmulatedHosts, HostsUnavailable, missing_capability

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import LocalSlurm, SlurmError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "slurm"
JOB_TIMEOUT_S = float(os.environ.get("HSGD_SLURM_JOB_TIMEOUT", "300"))
# A job RUNNING this long without every rank past MPI_Init has stalled at
# start-up (as when the PMI exchange with Slurm breaks: the ranks wait forever).
# Fail then, with the daemon logs, rather than at JOB_TIMEOUT_S. Start-up
# (bash, python, torch import, MPI_Init) took 4-22 s on a 2-core machine at
# load 7-10 (48 start-ups measured).
STARTUP_TIMEOUT_S = float(os.environ.get("HSGD_SLURM_STARTUP_TIMEOUT", "60"))
REQUEUE_EXIT = 75
NODES = 3
LINK = "1gbit"
# The rule of tests/hosts/conftest.py: without emulated hosts skip, under CI fail.
IN_CI = os.environ.get("CI", "").strip().lower() == "true"
# What a multi-node probe job allreduces (PROBE_CROSS): every node must send
# and receive at least this much over its link, whatever the algorithm.
CROSS_COUNT, CROSS_BYTES = 2, 4 << 20

# Stand-in for the trainer: same CLI, reports what each rank sees.
PROBE = r'''
import argparse, json, os, signal, socket, sys, time
from mpi4py import MPI
from hsgd import Topology

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--run-dir", required=True)
args, _ = parser.parse_known_args()
run_dir = args.run_dir
got_usr1 = []
signal.signal(signal.SIGUSR1, lambda *_: got_usr1.append(1))
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
os.makedirs(run_dir, exist_ok=True)
open(os.path.join(run_dir, f"started.{rank}.{restart}"), "w").close()  # past MPI_Init
topo = Topology.from_comm()

if os.environ.get("PROBE_RAISE"):
    # A bug on rank 1 after the others entered a synchronization: the job must end, not hang.
    import torch
    from hsgd import HierarchicalSGD
    model = torch.nn.Linear(2, 1)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, topology=topo)
    if rank == 1:
        time.sleep(1.0)
        raise RuntimeError("probe bug on rank 1")
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # waits for rank 1 forever, unless the job is aborted

if os.environ.get("PROBE_WAIT_USR1") and restart == 0:
    # First run: wait for SIGUSR1, "checkpoint", and ask to be requeued.
    open(os.path.join(run_dir, f"ready.{rank}"), "w").close()
    deadline = time.time() + 120
    while not got_usr1 and time.time() < deadline:
        time.sleep(0.1)
    if got_usr1:
        open(os.path.join(run_dir, f"usr1.{rank}"), "w").close()
    comm.Barrier()
    sys.exit(REQUEUE_EXIT if got_usr1 else 1)

if os.environ.get("PROBE_CROSS"):
    # COUNT allreduces of NBYTES: each node's share must cross its link.
    import numpy as np
    count, nbytes = map(int, os.environ["PROBE_CROSS"].split(","))
    data = np.ones(nbytes // 4, dtype=np.float32)
    out = np.empty_like(data)
    for _ in range(count):
        comm.Allreduce(data, out)
        assert out[0] == comm.Get_size()

shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
me = dict(rank=rank, size=comm.Get_size(), slurm_node=os.environ.get("SLURMD_NODENAME"),
          host=socket.gethostname(), interfaces=sorted(os.listdir("/sys/class/net")),
          shared=shared.allgather(rank),
          node_index=topo.node_index, local_rank=topo.local_rank,
          node_sizes=list(topo.node_sizes), omp=os.environ.get("OMP_NUM_THREADS"),
          netmod=os.environ.get("MPIR_CVAR_CH4_NETMOD"), restart=restart)
shared.Free()
ranks = comm.gather(me, root=0)
if rank == 0:
    with open(os.path.join(run_dir, "probe.json"), "w") as f:
        json.dump(ranks, f)
'''.replace("REQUEUE_EXIT", str(REQUEUE_EXIT))


@pytest.fixture(scope="module")
def slurm():
    """The module's cluster: its nodes on emulated hosts where they can be made
    (``slurm.hosts``), else all on loopback (``slurm.hosts`` None), which is
    enough for the single-node tests; the multi-node ones use ``nodes_are_hosts``.
    Removed (daemons, then hosts with whatever still runs on them) however the
    module ends."""
    reason = LocalSlurm.unavailable()
    if reason:
        if IN_CI:
            pytest.fail(f"CI=true, so Slurm must be testable here, but: {reason}",
                        pytrace=False)
        pytest.skip(reason)
    try:
        hosts = EmulatedHosts(NODES, link=LINK)
    except HostsUnavailable:
        hosts = None  # nodes_are_hosts says why
    try:
        cluster = LocalSlurm(nodes=NODES, cpus_per_node=2, hosts=hosts)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.cleanup()
    finally:
        if hosts is not None:
            hosts.close()


@pytest.fixture
def nodes_are_hosts(slurm):
    """For a job across nodes: the cluster's nodes must be emulated hosts (their
    own names and network stacks, MPI's bytes on their links)."""
    if slurm.hosts is None:
        why = f"(the multi-node Slurm tests run their nodes on them): {missing_capability()}"
        if IN_CI:
            pytest.fail(f"CI=true, but emulated hosts cannot be made here {why}", pytrace=False)
        pytest.skip(f"emulated hosts {why}")


def job_env(slurm, **extra):
    """The job's environment: this Python and its mpiexec, hsgd from this checkout."""
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HSGD_PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "HSGD_RANKS_PER_NODE": None,
        "HSGD_EMULATED_NODES": None,
        "PROBE_WAIT_USR1": None,
        "PROBE_RAISE": None,
        "PROBE_CROSS": None,
        # libfabric's native TCP provider for MPICH's OFI netmod (multi_node
        # picks OFI, see the script): the default here, tcp;ofi_rxm, stalled
        # in MPI_Init in about 1 of 5 start-ups of 3 emulated nodes x 2 ranks.
        "FI_PROVIDER": "tcp",
    }
    if slurm.hosts is not None:
        # Nodes are hosts: hsgd finds them (MPI_COMM_TYPE_SHARED) as on a real
        # cluster, and MPI's bytes between them stay on TCP, on the links (all
        # hosts share one kernel: MPICH's UCX, multi_node_mpiexec's netmod,
        # would take shared memory without UCX_TLS=tcp,self).
        env.update(slurm.hosts.tcp_env())
    else:
        env.update({
            # Loopback, single-node jobs only: keep MPI's own traffic on
            # loopback too (UCX or libfabric netmod, Hydra's proxies).
            "UCX_NET_DEVICES": "lo",
            "FI_TCP_IFACE": "lo",
            "FI_SOCKETS_IFACE": "lo",
            "HYDRA_IFACE": "lo",
        })
    env.update(extra)
    return env


def mpich_device() -> str:
    """What `mpichversion` next to this Python says under "MPICH Device" ("" if none)."""
    exe = Path(sys.executable).parent / "mpichversion"
    try:
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                 if ln.startswith("MPICH Device:")), "")


def probe_script(name: str, tmp_path: Path) -> Path:
    """A copy of scripts/slurm/NAME.sbatch that runs PROBE instead of the trainer."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    text = (SCRIPTS / f"{name}.sbatch").read_text()
    launch = '"$PYTHON" -m hsgd.train'
    if text.count(launch) != 1:
        pytest.fail(f"{name}.sbatch: expected one `{launch}` to swap for the probe")
    copy = tmp_path / f"{name}.probe.sbatch"
    copy.write_text(text.replace(launch, f'"$PYTHON" {probe}'))
    return copy


def layout(nodes, per_node):
    return [f"--nodes={nodes}", f"--ntasks-per-node={per_node}", "--time=10"]


def job_output(job, tmp_path) -> str:
    out_file = tmp_path / f"hsgd-{job}.out"
    return out_file.read_text(errors="replace") if out_file.exists() else "(no output file)"


def probe_started(run_dir: Path, ranks: int, restart: int = 0):
    """Every probe rank is past MPI_Init (PROBE writes started.<rank>.<restart>)."""
    return lambda: len(list(run_dir.glob(f"started.*.{restart}"))) >= ranks


def trainer_started(run_dir: Path, since: float = 0.0):
    """Every trainer rank is past MPI_Init: rank 0 writes config.json (again
    after a requeue) after the first collective, so the others got there too."""
    config = run_dir / "config.json"

    def started():
        try:
            return config.stat().st_mtime >= since
        except OSError:
            return False
    return started


def wait_started(slurm, job, tmp_path, started):
    """Fail within STARTUP_TIMEOUT_S of the job starting if its ranks stall in
    start-up, showing the daemons' errors for the job and its output."""
    try:
        slurm.wait_started(job, started, startup_timeout=STARTUP_TIMEOUT_S,
                           timeout=JOB_TIMEOUT_S)
        return
    except SlurmError as exc:
        error = str(exc)
    pytest.fail(f"{error}\n--- hsgd-{job}.out ---\n{job_output(job, tmp_path)[-6000:]}",
                pytrace=False)


def finish(slurm, job, tmp_path, started, expect="COMPLETED"):
    """Wait for the job; assert its final state, showing its output if wrong.

    ``started``: the sign that every rank got past MPI_Init (see wait_started).
    """
    wait_started(slurm, job, tmp_path, started)
    try:
        state = slurm.wait(job, timeout=JOB_TIMEOUT_S)
    except SlurmError as exc:
        pytest.fail(f"{exc}\n--- hsgd-{job}.out ---\n{job_output(job, tmp_path)[-6000:]}")
    output = job_output(job, tmp_path)
    info = slurm.job_info(job)
    assert state == expect, (
        f"job {job} ended {state} (exit {info.get('ExitCode')}), expected {expect}\n"
        f"--- hsgd-{job}.out ---\n{output[-6000:]}\n{slurm.logs()}")
    return info, output


# (script, nodes, ranks per node): the node counts the scripts are meant for.
CASES = [("single_node", 1, 2), ("multi_node", 3, 2), ("multi_node_mpiexec", 2, 2)]


@pytest.mark.parametrize("name,nodes,per_node", CASES)
def test_script_launches_ranks_across_nodes(slurm, request, tmp_path, name, nodes, per_node):
    """Slurm places the ranks node by node, hsgd finds the same nodes; across
    nodes, every node is a host of its own (its name, its network stack, one
    MPI_COMM_TYPE_SHARED group) and MPI's bytes between them cross the links."""
    if nodes > 1:
        request.getfixturevalue("nodes_are_hosts")
    run_dir = tmp_path / "run"
    cross = {"PROBE_CROSS": f"{CROSS_COUNT},{CROSS_BYTES}"} if nodes > 1 else {}
    before = slurm.hosts.counters() if slurm.hosts is not None else None
    job = slurm.submit(probe_script(name, tmp_path), ["--epochs", "1", "--run-dir", run_dir],
                       env=job_env(slurm, **cross), sbatch_args=layout(nodes, per_node), cwd=tmp_path)
    size = nodes * per_node
    _, output = finish(slurm, job, tmp_path, probe_started(run_dir, size))
    ranks = json.loads((run_dir / "probe.json").read_text())
    assert [r["rank"] for r in ranks] == list(range(size)), output
    assert {r["size"] for r in ranks} == {size}
    # Slurm put ranks 0..per_node-1 on n1, the next on n2, ...; hsgd must agree.
    for r in ranks:
        node = r["rank"] // per_node
        assert r["slurm_node"] == f"n{node + 1}", ranks
        assert (r["node_index"], r["local_rank"]) == divmod(r["rank"], per_node), ranks
        assert r["node_sizes"] == [per_node] * nodes, ranks
        assert r["omp"] == "1", ranks
        if slurm.hosts is not None:
            # Node n{i+1} is host i: its host name, only its own interfaces, and
            # MPI's shared-memory node is that host's ranks (hsgd's physical
            # nodes above: HSGD_EMULATED_NODES is not set on hosts).
            assert r["host"] == slurm.hosts.hosts[node].name, ranks
            assert r["interfaces"] == ["eth0", "lo"], ranks
            assert r["shared"] == list(range(node * per_node, (node + 1) * per_node)), ranks
    if nodes > 1:
        # The allreduces' bytes went over the links of the job's hosts: at
        # least CROSS_BYTES each way per allreduce (each node needs the others'
        # sum, and its own data is needed by the others), not through memory.
        slurm.hosts.verify_crossed(before, CROSS_COUNT * CROSS_BYTES, hosts=range(nodes))
    if name == "multi_node" and "ofi" in mpich_device():
        # srun + PMI: MPICH's OFI netmod, not UCX, whose start-up PMI lines can
        # exceed what Slurm's pmi2 plugin reads and hang the job (see the script).
        assert {r["netmod"] for r in ranks} == {"ofi"}, (ranks, output)


@pytest.mark.parametrize("name", ["multi_node", "multi_node_mpiexec"])
@pytest.mark.usefixtures("nodes_are_hosts")
def test_usr1_checkpoint_exit_requeues_the_job(slurm, tmp_path, name):
    """SIGUSR1 reaches every rank; exit 75 makes the script requeue the job."""
    run_dir = tmp_path / "run"
    job = slurm.submit(probe_script(name, tmp_path), ["--run-dir", run_dir],
                       env=job_env(slurm, PROBE_WAIT_USR1="1"), sbatch_args=layout(2, 1),
                       cwd=tmp_path)
    wait_started(slurm, job, tmp_path, probe_started(run_dir, 2))
    slurm.wait_for(lambda: len(list(run_dir.glob("ready.*"))) == 2, timeout=JOB_TIMEOUT_S,
                   what=f"job {job}'s ranks to start")
    slurm.signal(job, "USR1")      # what --signal=USR1@120 does near the time limit
    # After the requeue: the ranks of the second run must start too.
    info, output = finish(slurm, job, tmp_path, probe_started(run_dir, 2, restart=1))
    assert len(list(run_dir.glob("usr1.*"))) == 2, f"not every rank got SIGUSR1\n{output}"
    assert info.get("Restarts") == "1", output
    assert "requeueing" in output, output
    assert {r["restart"] for r in json.loads((run_dir / "probe.json").read_text())} == {1}


@pytest.mark.parametrize("name", ["multi_node", "multi_node_mpiexec"])
@pytest.mark.usefixtures("nodes_are_hosts")
def test_an_exception_on_one_rank_fails_the_job_instead_of_hanging(slurm, tmp_path, name):
    """Under srun (and mpiexec inside the allocation) hsgd's abort hook ends every rank."""
    run_dir = tmp_path / "run"
    job = slurm.submit(probe_script(name, tmp_path), ["--run-dir", run_dir], env=job_env(slurm, PROBE_RAISE="1"),
                       sbatch_args=layout(2, 1), cwd=tmp_path)
    _, output = finish(slurm, job, tmp_path, probe_started(run_dir, 2), expect="FAILED")
    assert output.count("Traceback") == 1, output[-4000:]
    assert "[rank 1] RuntimeError: probe bug on rank 1" in output, output[-4000:]


# At most 4 ranks on the 2-core test machines: the trainer is heavier than the probe.
TRAIN_CASES = [("single_node", 1, 2), ("multi_node", 2, 2), ("multi_node_mpiexec", 2, 2), ("supervised", 2, 2)]


@pytest.fixture(scope="module")
def train_args(tmp_path_factory):
    """A short training run; the MNIST-1D file is generated once, into a shared cache."""
    cache = tmp_path_factory.mktemp("mnist1d-cache")
    return ["--model", "mlp", "--mnist1d-samples", "2000", "--cache-dir", cache]


def epoch_records(run_dir: Path, output: str):
    metrics = run_dir / "metrics.jsonl"
    assert metrics.exists(), f"no {metrics}\n{output[-4000:]}"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    epochs = [r for r in records if r.get("event") == "epoch"]
    assert epochs and all("test_acc" in r for r in epochs), records[-5:]
    return epochs


@pytest.mark.parametrize("name,nodes,per_node", TRAIN_CASES)
def test_script_trains_one_epoch(slurm, request, tmp_path, train_args, name, nodes, per_node):
    if nodes > 1:
        request.getfixturevalue("nodes_are_hosts")
    run_dir = tmp_path / "run"
    job = slurm.submit(SCRIPTS / f"{name}.sbatch",
                       ["--epochs", "1", "--run-dir", run_dir, *train_args],
                       env=job_env(slurm), sbatch_args=layout(nodes, per_node), cwd=tmp_path)
    _, output = finish(slurm, job, tmp_path, trainer_started(run_dir))
    assert [r["epoch"] for r in epoch_records(run_dir, output)] == [0], output[-4000:]
    # The trainer found Slurm's nodes itself (no virtual nodes asked for): on
    # hosts, its physical nodes are the hosts.
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["world_size"], config["num_nodes"], config["ranks_per_node"]) == (nodes * per_node, nodes, None)
    if name == "supervised":  # python -m hsgd.run probed the nodes and started the ranks with srun
        assert f"starting {nodes * per_node} ranks on {nodes} hosts: n1, n2" in output, output[-4000:]
        assert "the job ended well" in output, output[-4000:]


@pytest.mark.usefixtures("nodes_are_hosts")
def test_trainer_checkpoints_on_usr1_and_resumes_after_requeue(slurm, tmp_path, train_args):
    """The whole chain: Slurm's warning signal, checkpoint, exit 75, requeue, --resume."""
    epochs = 20  # long enough that the signal lands well before the end
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    job = slurm.submit(SCRIPTS / "multi_node.sbatch",
                       ["--epochs", epochs, "--run-dir", run_dir, "--resume", "--log-every", "1",
                        *train_args],
                       env=job_env(slurm), sbatch_args=layout(2, 1), cwd=tmp_path)
    wait_started(slurm, job, tmp_path, trainer_started(run_dir))
    slurm.wait_for(lambda: metrics.exists() and '"event": "epoch"' in metrics.read_text(),
                   timeout=JOB_TIMEOUT_S, what=f"job {job}'s first epoch")
    signalled = time.time()
    slurm.signal(job, "USR1")
    info, output = finish(slurm, job, tmp_path, trainer_started(run_dir, since=signalled))
    assert info.get("Restarts") == "1" and "requeueing" in output, output[-4000:]
    # The requeued run resumed from the checkpoint the first run wrote at its stop ...
    stopped = re.findall(r"stopped \(signal\) after (\d+) steps", output)
    resumed = re.findall(r"resuming from \S+ \(step (\d+)\)", output)
    assert len(stopped) == len(resumed) == 1 and stopped == resumed and int(stopped[0]) > 0, output[-4000:]
    # ... so every epoch was recorded once, in order (a run that restarted from scratch repeats them)
    records = epoch_records(run_dir, output)
    assert [r["epoch"] for r in records] == list(range(epochs)), output[-4000:]
    steps = [r["step"] for r in records]
    assert steps == [steps[0] * (e + 1) for e in range(epochs)], steps
