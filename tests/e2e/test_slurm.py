"""Slurm, for real: the project's batch scripts on a private cluster on loopback.

tests/e2e/slurm_cluster.py starts a slurmctld and three slurmd (emulated nodes
n1..n3, all on this host) for this module, and every test submits one of
scripts/slurm/*.sbatch with sbatch and polls the job to its end.

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

Needs root and Slurm (Debian: slurmctld slurmd slurm-client; .ci/slurm-setup.sh
installs them). Without them the tests skip, except under CI=true, where a
missing Slurm means the CI setup is broken and the tests fail.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

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

# Stand-in for the trainer: same CLI, reports what each rank sees.
PROBE = r'''
import argparse, json, os, signal, sys, time
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

me = dict(rank=rank, size=comm.Get_size(), slurm_node=os.environ.get("SLURMD_NODENAME"),
          node_index=topo.node_index, local_rank=topo.local_rank,
          node_sizes=list(topo.node_sizes), omp=os.environ.get("OMP_NUM_THREADS"),
          netmod=os.environ.get("MPIR_CVAR_CH4_NETMOD"), restart=restart)
ranks = comm.gather(me, root=0)
if rank == 0:
    with open(os.path.join(run_dir, "probe.json"), "w") as f:
        json.dump(ranks, f)
'''.replace("REQUEUE_EXIT", str(REQUEUE_EXIT))


@pytest.fixture(scope="module")
def slurm():
    reason = LocalSlurm.unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, so Slurm must be testable here, but: {reason}",
                        pytrace=False)
        pytest.skip(reason)
    cluster = LocalSlurm(nodes=3, cpus_per_node=2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.cleanup()


def job_env(**extra):
    """The job's environment: this Python and its mpiexec, hsgd from this checkout."""
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HSGD_PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "HSGD_RANKS_PER_NODE": None,   # the script sets it (HSGD_EMULATED_NODES)
        "HSGD_EMULATED_NODES": "1",
        "PROBE_WAIT_USR1": None,
        "PROBE_RAISE": None,
        # Keep MPI's own traffic on loopback too (UCX or libfabric netmod,
        # Hydra's proxies); the emulated nodes are all this host anyway.
        "UCX_NET_DEVICES": "lo",
        "FI_TCP_IFACE": "lo",
        "FI_SOCKETS_IFACE": "lo",
        "HYDRA_IFACE": "lo",
        # libfabric's native TCP provider for MPICH's OFI netmod (multi_node
        # picks OFI, see the script): the default here, tcp;ofi_rxm, stalled
        # in MPI_Init in about 1 of 5 start-ups of 3 emulated nodes x 2 ranks.
        "FI_PROVIDER": "tcp",
    }
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
def test_script_launches_ranks_across_nodes(slurm, tmp_path, name, nodes, per_node):
    run_dir = tmp_path / "run"
    job = slurm.submit(probe_script(name, tmp_path), ["--epochs", "1", "--run-dir", run_dir],
                       env=job_env(), sbatch_args=layout(nodes, per_node), cwd=tmp_path)
    size = nodes * per_node
    _, output = finish(slurm, job, tmp_path, probe_started(run_dir, size))
    ranks = json.loads((run_dir / "probe.json").read_text())
    assert [r["rank"] for r in ranks] == list(range(size)), output
    assert {r["size"] for r in ranks} == {size}
    # Slurm put ranks 0..per_node-1 on n1, the next on n2, ...; hsgd must agree.
    for r in ranks:
        assert r["slurm_node"] == f"n{r['rank'] // per_node + 1}", ranks
        assert (r["node_index"], r["local_rank"]) == divmod(r["rank"], per_node), ranks
        assert r["node_sizes"] == [per_node] * nodes, ranks
        assert r["omp"] == "1", ranks
    if name == "multi_node" and "ofi" in mpich_device():
        # srun + PMI: MPICH's OFI netmod, not UCX, whose start-up PMI lines can
        # exceed what Slurm's pmi2 plugin reads and hang the job (see the script).
        assert {r["netmod"] for r in ranks} == {"ofi"}, (ranks, output)


@pytest.mark.parametrize("name", ["multi_node", "multi_node_mpiexec"])
def test_usr1_checkpoint_exit_requeues_the_job(slurm, tmp_path, name):
    """SIGUSR1 reaches every rank; exit 75 makes the script requeue the job."""
    run_dir = tmp_path / "run"
    job = slurm.submit(probe_script(name, tmp_path), ["--run-dir", run_dir],
                       env=job_env(PROBE_WAIT_USR1="1"), sbatch_args=layout(2, 1),
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
def test_an_exception_on_one_rank_fails_the_job_instead_of_hanging(slurm, tmp_path, name):
    """Under srun (and mpiexec inside the allocation) hsgd's abort hook ends every rank."""
    run_dir = tmp_path / "run"
    job = slurm.submit(probe_script(name, tmp_path), ["--run-dir", run_dir], env=job_env(PROBE_RAISE="1"),
                       sbatch_args=layout(2, 1), cwd=tmp_path)
    _, output = finish(slurm, job, tmp_path, probe_started(run_dir, 2), expect="FAILED")
    assert output.count("Traceback") == 1, output[-4000:]
    assert "[rank 1] RuntimeError: probe bug on rank 1" in output, output[-4000:]


# At most 4 ranks on the 2-core test machines: the trainer is heavier than the probe.
TRAIN_CASES = [("single_node", 1, 2), ("multi_node", 2, 2), ("multi_node_mpiexec", 2, 2)]


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
def test_script_trains_one_epoch(slurm, tmp_path, train_args, name, nodes, per_node):
    run_dir = tmp_path / "run"
    job = slurm.submit(SCRIPTS / f"{name}.sbatch",
                       ["--epochs", "1", "--run-dir", run_dir, *train_args],
                       env=job_env(), sbatch_args=layout(nodes, per_node), cwd=tmp_path)
    _, output = finish(slurm, job, tmp_path, trainer_started(run_dir))
    assert [r["epoch"] for r in epoch_records(run_dir, output)] == [0], output[-4000:]


def test_trainer_checkpoints_on_usr1_and_resumes_after_requeue(slurm, tmp_path, train_args):
    """The whole chain: Slurm's warning signal, checkpoint, exit 75, requeue, --resume."""
    epochs = 20  # long enough that the signal lands well before the end
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    job = slurm.submit(SCRIPTS / "multi_node.sbatch",
                       ["--epochs", epochs, "--run-dir", run_dir, "--resume", "--log-every", "1",
                        *train_args],
                       env=job_env(), sbatch_args=layout(2, 1), cwd=tmp_path)
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
