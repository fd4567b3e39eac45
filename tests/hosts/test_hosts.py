"""lab.hosts as the tests and benchmarks use it: separate nodes, real links, unique names,
nothing left behind however the owner ends."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpirun import ROOT, mpi_env, mpi_flavour, run_command

from lab.hosts import EmulatedHosts, HostsError
from lab.hosts._net import STATE_ROOT

JOB = str(Path(__file__).with_name("allreduce_job.py"))
MB = 1 << 20


def run_job(hosts, ranks, count=4, nbytes=8 * MB, env=None):
    proc = run_command(hosts.mpi_command([sys.executable, JOB, str(count), str(nbytes)], ranks),
                       timeout=180, env=hosts.tcp_env() if env is None else env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_each_host_is_a_node_with_its_own_name_interfaces_and_shaped_link(emulated_hosts):
    hosts = emulated_hosts(2, "1gbit")
    before = hosts.counters()
    ranks = run_job(hosts, [2, 2])
    assert [r["host"] for r in ranks] == [hosts.hosts[0].name] * 2 + [hosts.hosts[1].name] * 2
    assert [r["node_size"] for r in ranks] == [2, 2, 2, 2]  # MPI_COMM_TYPE_SHARED splits 2 + 2
    assert all(r["interfaces"] == ["eth0", "lo"] for r in ranks)
    hosts.verify_crossed(before, 4 * 8 * MB)  # each allreduce: every host sends and receives >= 8 MB
    for host in hosts.hosts:  # both ends of the link
        for cmd in (["tc", "qdisc", "show", "dev", host.veth],
                    hosts.exec_command(hosts.hosts.index(host), ["tc", "qdisc", "show", "dev", "eth0"])):
            shown = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            assert "tbf" in shown and "rate 1Gbit" in shown, shown


def test_the_counters_catch_traffic_that_did_not_cross_the_links(emulated_hosts):
    """Without tcp_env(), MPICH's UCX sees one kernel and carries the bytes between the hosts
    through shared memory: the job succeeds, and only the link counters tell."""
    if mpi_flavour() != "mpich":
        pytest.skip("the shared-memory shortcut is UCX's, as MPICH uses it; Open MPI's launch "
                    "command itself keeps ob1 over TCP")
    hosts = emulated_hosts(2, None)
    before = hosts.counters()
    run_job(hosts, [1, 1], env={})
    with pytest.raises(HostsError, match="did not cross the links.*UCX_TLS=tcp,self"):
        hosts.verify_crossed(before, 4 * 8 * MB)
    before = hosts.counters()
    run_job(hosts, [1, 1])
    hosts.verify_crossed(before, 4 * 8 * MB)


def test_runs_side_by_side_get_their_own_names_and_subnets(emulated_hosts):
    one, two = emulated_hosts(2, "1gbit"), emulated_hosts(2, "100mbit")
    names = [h.name for h in one.hosts] + [h.name for h in two.hosts]
    assert len(set(names)) == 4 and one.id != two.id and one.subnet != two.subnet
    procs = [subprocess.Popen(h.mpi_command([sys.executable, JOB, "2", str(MB)], 1), cwd=ROOT, env=mpi_env(h.tcp_env()),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for h in (one, two)]
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    assert "100Mbit" in subprocess.run(["tc", "qdisc", "show", "dev", two.hosts[0].veth],
                                       capture_output=True, text=True).stdout


def _gone(run_id):
    """What is left of run ``run_id``: namespaces, links, its state directory."""
    left = [p.name for p in Path("/run/netns").glob(f"hsgd-{run_id}-*")]
    left += [p.name for p in Path("/sys/class/net").iterdir() if run_id in p.name]
    left += [str(STATE_ROOT / run_id)] if (STATE_ROOT / run_id).exists() else []
    return left


def test_an_exception_inside_the_block_removes_the_hosts_and_their_processes(emulated_hosts):
    emulated_hosts()  # the capability check (skip or fail as the layer says)
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedHosts(2) as hosts:
            sleeper = subprocess.Popen(hosts.exec_command(1, ["sleep", "300"]))
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert not _gone(hosts.id)


def test_a_killed_owner_leaves_nothing_behind(emulated_hosts):
    """The owner (a test process killed by a timeout, say) dies with SIGKILL: its guard removes
    the hosts and whatever ran on them."""
    emulated_hosts()
    marker = f"300.{os.getpid()}"  # a sleep of this test's own: another `sleep 300` on the machine is not ours
    owner = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from lab.hosts import EmulatedHosts\n"
        "hosts = EmulatedHosts(2)\n"
        f"subprocess.Popen(hosts.exec_command(0, ['sleep', '{marker}']))\n"
        "print(hosts.id, flush=True)\n"
        "time.sleep(300)\n")], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    run_id = owner.stdout.readline().strip()
    assert run_id and _gone(run_id), "the owner did not make its hosts"
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 20
    while _gone(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _gone(run_id)
    # SIGKILL is delivered at once but acted on when the process next runs: on a loaded machine
    # (a process in uninterruptible I/O) the sleep may outlive its namespace by a moment.
    while _sleeping(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sleeping(marker)


def test_a_launch_racing_the_teardown_leaves_nothing(emulated_hosts):
    """A command started on a host just before the hosts are removed (the owner killed right after
    a launch) may enter its namespace after the teardown listed the namespace's processes: the
    teardown kills it anyway. Before the fix, 11 of 15 such launches outlived their host."""
    emulated_hosts()
    for i in range(5):
        marker = f"301.{os.getpid()}{i}"
        with EmulatedHosts(2, guard=False) as hosts:
            launch = subprocess.Popen(hosts.exec_command(0, ["sleep", marker]), stderr=subprocess.DEVNULL)
        try:
            launch.wait(timeout=20)  # killed, or failed to enter the deleted namespace
        except subprocess.TimeoutExpired:
            launch.kill()
            launch.wait()
            pytest.fail(f"launch {i} outlived its host")
        assert not _sleeping(marker), f"launch {i} outlived its host"


def _sleeping(marker):
    """The processes that run ``sleep MARKER``."""
    found = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"sleep\x00" + marker.encode() in p.read_bytes():
                found.append(p)
        except OSError:  # gone between the listing and the read
            pass
    return found


def test_without_root_the_command_says_why(tmp_path):
    """Namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN: without them, one error line, exit 2.

    The command runs as root with every capability dropped (setpriv), not as another user: the
    user stays the owner of the checkout and its environment, wherever the clone lives and
    whatever its permissions (a clone in a directory only root can read is fine).
    """
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the command without capabilities")
    proc = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-m",
                           "lab.hosts", "run", "--", "true"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("error: emulated hosts need root"), proc.stderr


def test_the_command_runs_a_job_and_reports_the_links(emulated_hosts):
    emulated_hosts()
    proc = subprocess.run([sys.executable, "-m", "lab.hosts", "run", "--hosts", "2", "--ranks-per-host", "2,1",
                           "--link", "1gbit,100mbit", "--", sys.executable, JOB, "2", str(MB)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert [r["node_size"] for r in json.loads(proc.stdout.strip().splitlines()[-1])] == [2, 2, 1]
    assert "link 1gbit" in proc.stderr and "link 100mbit" in proc.stderr, proc.stderr
    sent = [float(x) for x in __import__("re").findall(r"sent ([0-9.]+) MB", proc.stderr)]
    assert len(sent) == 2 and min(sent) >= 2 * MB / 1e6, proc.stderr


@pytest.mark.parametrize("name,options,header", [
    ("stall", ["--params", "1000", "--steps", "3", "--repeats", "1", "--warmup", "0"],
     "| stall inspector | ms per step (each repeat) | median | on / off |"),
    ("train", ["--workloads", "cnn", "--steps", "1", "--repeats", "1", "--warmup", "0"],
     "| method | ms per step | samples/s | MB per step on the busiest link | wire limit ms | of the wire limit "
     "| samples/s / DDP's |"),
    ("allreduce", ["--sizes", "1e4", "--repeats", "1", "--warmup", "0"],
     "| ranks | floats | method | ms | MB on the busiest link | wire limit ms | of the wire limit | MPI/method |"),
    ("box", ["--sizes", "1e3", "--repeats", "1", "--seconds", "0.1"],
     "| ranks | floats | PS | box | box, all work | box, owner computes | box/PS | all work/PS "
     "| owner computes/PS |"),
    ("gossip", ["--epochs", "1", "--thetas", "--warmup", "0", "--mnist1d-samples", "800", "--batch-size", "64"],
     "| run | intra MB | inter MB | traffic vs every-step gossip | wall s | train s "
     "| train time vs every-step gossip | final test acc | best test acc | MB on the busiest link "
     "| wire limit s | of the wire limit |"),
])  # model: test_the_model_measures_the_many_to_many_efficiency_from_three_hosts
def test_the_benchmarks_run_across_hosts(emulated_hosts, name, options, header):
    """``python -m lab.bench SUBCOMMAND --hosts 2``, as a user runs it (no timing asserted)."""
    emulated_hosts()  # the capability check
    proc = subprocess.run([sys.executable, "-m", "lab.bench", name, *options, "--hosts", "2", "--ranks-per-host",
                           "1", "--link", "1gbit", "--progress", "lines"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=mpi_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert header in proc.stdout.splitlines(), proc.stdout
    assert "2 emulated hosts (1+1 ranks, links 1gbit, TCP)" in proc.stdout + proc.stderr


def test_the_model_measures_the_many_to_many_efficiency_from_three_hosts(emulated_hosts):
    """``python -m lab.bench model --hosts 3`` as a user runs it: from 3 hosts on it fits ``eta``
    (a fan exchange between the hosts) and validates with it (no timing asserted)."""
    emulated_hosts()
    proc = subprocess.run([sys.executable, "-m", "lab.bench", "model", "--validate", "--validate-sizes", "64",
                           "--params", "1e3", "--nodes", "3", "--ranks-per-node", "1", "--repeats", "1",
                           "--warmup", "0", "--hosts", "3", "--ranks-per-host", "1", "--link", "1gbit",
                           "--progress", "lines"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=mpi_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    eta = [line for line in proc.stdout.splitlines() if line.startswith("| many-to-many efficiency (eta) |")]
    assert len(eta) == 1 and "fit across 3 emulated hosts: every first rank sends 16 MiB / 2" in eta[0], proc.stdout
    value = float(eta[0].split("|")[2].strip().rstrip("%"))
    assert 0 < value <= 100
    assert "| 3 x 1 | 64 | box |" in proc.stdout, proc.stdout
    assert ("| nodes x ranks/node | floats | strategy | predicted ms | measured ms | error | bytes as modelled |"
            in proc.stdout.splitlines()), proc.stdout
    assert "3 emulated hosts (1+1+1 ranks, links 1gbit, TCP)" in proc.stdout + proc.stderr


@pytest.mark.parametrize("script,arguments", [
    ("gossip_rounds.py", ["1e4", "1"]),
    ("concurrent_streams.py", ["1e4", "1", "shift"]),
    ("concurrent_streams.py", ["1e4", "1", "fans"]),
])
def test_the_labs_measuring_scripts_run_across_hosts(emulated_hosts, script, arguments):
    """``lab/scripts/``, as their docstrings run them: one command from the clone, tiny sizes (no timing
    asserted)."""
    emulated_hosts()  # the capability check
    proc = subprocess.run([sys.executable, "-m", "lab.hosts", "run", "--hosts", "2", "--ranks-per-host", "2",
                           "--link", "1gbit", "--", sys.executable, f"lab/scripts/{script}", *arguments],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env=mpi_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median" in proc.stdout, proc.stdout
