"""python -m hsgd.train across two emulated hosts: a run whose averages cross the links, a
stopped and resumed run that ends where an unstopped one does, and a signal that stops a mode
whose ranks agree through remote memory (the parameter box), then a resume."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpirun import ROOT, kill_job, mpi_env, remove_leftovers, run_command, snapshot

from hsgd.data import ensure_mnist1d

SMALL = ["--mnist1d-samples", "2000", "--epochs", "2", "--batch-size", "64", "--progress", "lines"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    ensure_mnist1d(str(path), num_samples=2000)
    return str(path)


def train(hosts, cache, args, ranks=2):
    proc = run_command(hosts.mpi_command([sys.executable, "-m", "hsgd.train", "--cache-dir", cache, *args], ranks),
                       env=hosts.tcp_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def records(run_dir, event):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().split("\n")[:-1]
    return [r for r in map(json.loads, lines) if r["event"] == event]


def final_model(run_dir):
    return torch.load(sorted((Path(run_dir) / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)["model"]


def test_a_run_across_hosts_sends_its_averages_over_the_links(emulated_hosts, cache, tmp_path):
    hosts = emulated_hosts(2, "1gbit")
    before = hosts.counters()
    train(hosts, cache, [*SMALL, "--run-dir", str(tmp_path / "run")])
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["world_size"] == 4 and config["num_nodes"] == 2
    epochs = records(tmp_path / "run", "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1] and epochs[-1]["test_acc"] > 0.2
    inter = sum(e["inter_bytes"] for e in epochs)  # summed over ranks: the two leaders' allreduces
    assert inter > 0
    hosts.verify_crossed(before, inter // 2)  # each host's leader sent (and received) its half


def test_a_stopped_and_resumed_run_across_hosts_ends_identical(emulated_hosts, cache, tmp_path):
    hosts = emulated_hosts(2, "1gbit")
    common = [*SMALL, "--optimizer", "sgd", "--lr", "0.05", "--inter-node", "sharded", "--compression", "bf16"]
    train(hosts, cache, [*common, "--run-dir", str(tmp_path / "whole")])
    first = train(hosts, cache, [*common, "--run-dir", str(tmp_path / "part"), "--stop-after", "20"])
    assert "stopped (stop-after) after 20 steps" in first.stderr
    second = train(hosts, cache, [*common, "--run-dir", str(tmp_path / "part"), "--resume"])
    assert "resuming from" in second.stderr
    want, got = final_model(tmp_path / "whole"), final_model(tmp_path / "part")
    assert all(torch.equal(want[key], got[key]) for key in want)


def test_a_signal_stops_the_parameter_box_across_hosts_and_it_resumes(emulated_hosts, cache, tmp_path):
    """SIGUSR1 to mpiexec reaches every rank on both hosts; the ranks of --sync async never
    wait for each other and agree on the stop step through remote memory on rank 0."""
    hosts = emulated_hosts(2, "1gbit")
    run, tmpdir = tmp_path / "run", tmp_path / "tmp"
    tmpdir.mkdir()
    args = ["-m", "hsgd.train", "--cache-dir", cache, *SMALL, "--epochs", "50", "--log-every", "5",
            "--sync", "async", "--run-dir", str(run)]
    before = snapshot()
    proc = subprocess.Popen(hosts.mpi_command([sys.executable, *args], 2), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=mpi_env(hosts.tcp_env(), str(tmpdir)),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or not records(run, "step"):
            assert time.monotonic() < deadline and proc.poll() is None, "training never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_job(proc)
    assert proc.returncode == 75, err[-4000:]
    assert not remove_leftovers(before, str(tmpdir))
    state = torch.load(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=False)
    assert f"stopped (signal) after {state['step']} steps" in err  # one step for every rank
    resumed = train(hosts, cache, [*SMALL, "--epochs", str(state["epoch"] + 1), "--sync", "async",
                                   "--run-dir", str(run), "--resume"])
    assert "resuming from" in resumed.stderr
