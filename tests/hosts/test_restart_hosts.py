"""python -m hsgd.run across three emulated hosts of two ranks, under MPICH: hosts lost mid-epoch,
the run restarted on those left, a host that comes back taken in again.

One supervised run checks it all (each launch costs seconds of torch imports on a small machine):

1. 3 hosts x 2 ranks train; once a checkpoint mid-epoch 0 is written, host 2's link is taken down
   and every process there killed (a host that loses its power: no connection closes, nothing
   answers there);
2. the supervisor restarts on hosts 0 and 1 (4 ranks, global batch kept); once that job runs,
   host 2's link comes back up; after a checkpoint mid-epoch 1, host 1 dies the same way;
3. the supervisor restarts on hosts 0 and 2: the host that came back joins.

Then: the run ended after all its epochs; every sample of every epoch was used exactly once
(the model writes down each step's samples: ``recording_model.py``); the restart records say
what was lost; the final parameters equal those of a run resumed by hand at 2 x 2 ranks from
the checkpoint the last restart loaded. Bad input to the supervisor: tests/unit/test_run_cli.py.
"""

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from mpirun import ROOT, kill_job, mpi_env, remove_leftovers, run_command, snapshot

from hsgd import report as hsgd_report
from hsgd.bench._launcher import mpi_flavour, mpiexec

SAMPLES, BATCH, EPOCHS = 1000, 50, 2  # 50: unequal shares at 6 ranks (9, 9, 8, 8, 8, 8) and at 4 (13, 13, 12, 12)
STEPS = SAMPLES // BATCH  # 20 per epoch: a fault in each epoch
TRAIN = ["--data", None, "--model", "recording_model:build", "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
         "--optimizer", "sgd", "--lr", "0.05", "--save-every", "3", "--keep-checkpoints", "100",
         "--log-every", "2", "--progress", "lines"]


def make_data(path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 9)).astype(np.float32)
    x[:, 0] = np.arange(SAMPLES)  # the index: what recording_model writes down
    with h5py.File(path, "w") as f:
        f["x_train"], f["y_train"] = x, rng.integers(0, 4, SAMPLES)
        f["x_test"], f["y_test"] = x[:96], rng.integers(0, 4, 96)


def records(run, event):
    lines = (run / "metrics.jsonl").read_text().split("\n")[:-1]
    return [r for r in map(json.loads, filter(None, lines)) if r["event"] == event]


def wait_for(what, check, proc, seconds=240):
    deadline = time.monotonic() + seconds
    while not check():
        assert proc.poll() is None, f"the supervisor ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def lose(hosts, i):
    """Host ``i`` dies as a host that loses its power: its link down first, so that no connection
    is closed and the survivors learn of it only by their stall inspector's abort pace (the
    supervisor's default), then its processes killed; a probe gets no answer there. (Killed
    first, Open MPI's launcher ends the job at once, and a probe could reach the host before
    its link is down.)"""
    hosts.set_link(i, up=False)
    hosts.kill_host(i)


def steps_used(samples_dir, starts):
    """{step: sorted samples of its global batch}, from what each rank wrote down: the job
    that began at ``starts[j][0]`` counts up to ``starts[j][1]``, where the next one resumed."""
    runs = []
    for path in samples_dir.glob("*.txt"):
        header, *lines = path.read_text().splitlines()
        rank, _, wall = header.split()
        runs.append((float(wall), int(rank), [list(map(int, b.split(","))) for b in lines]))
    jobs, last = [], None
    for wall, rank, batches in sorted(runs):  # a job's ranks take their first step together
        if last is None or wall - last > 5:
            jobs.append({})
        jobs[-1][rank], last = batches, wall
    assert len(jobs) == len(starts), (len(jobs), starts)
    used = {}
    for (first, until), ranks in zip(starts, jobs):
        assert all(len(b) >= until - first for b in ranks.values()), f"the job from step {first} stopped short"
        for k in range(until - first):
            used[first + 1 + k] = sorted(sum((ranks[r][k] for r in sorted(ranks)), []))
    return used


def test_a_supervised_run_restarts_on_the_hosts_left_and_takes_back_one_that_returns(emulated_hosts, tmp_path,
                                                                                      capsys):
    hosts = emulated_hosts(3, "1gbit")
    data, run, samples, tmpdir = tmp_path / "data.h5", tmp_path / "run", tmp_path / "samples", tmp_path / "tmp"
    make_data(data)
    samples.mkdir()
    tmpdir.mkdir()
    train = [str(data) if a is None else a for a in TRAIN]
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("".join(f"{h.address}:2\n" for h in hosts.hosts))
    launcher = shlex.join(hosts.launcher_options())
    env = mpi_env({**hosts.tcp_env(), "PYTHONPATH": str(Path(__file__).parent), "HSGD_SAMPLES_DIR": str(samples),
                   "HSGD_STEP_SLEEP": "0.05"}, str(tmpdir))
    before = snapshot()
    proc = subprocess.Popen([sys.executable, "-m", "hsgd.run", "--hosts-file", str(hosts_file), "--min-nodes", "2",
                             "--max-restarts", "2", "--probe-timeout", "3", "--launcher-args", launcher,
                             "--", *train, "--run-dir", str(run)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        mid_epoch = lambda lo, hi: lambda: (run / "metrics.jsonl").exists() and any(  # noqa: E731
            lo <= c["step"] < hi for c in records(run, "checkpoint"))
        wait_for("a checkpoint in epoch 0", mid_epoch(2, STEPS - 3), proc)
        lose(hosts, 2)
        wait_for("the first restart's job", lambda: len(records(run, "start")) == 2, proc)
        hosts.set_link(2, up=True)  # host 2 answers again (its processes are gone)
        wait_for("a checkpoint of the restarted job in epoch 1", mid_epoch(STEPS + 2, 2 * STEPS - 3), proc)
        lose(hosts, 1)
        out, err = proc.communicate(timeout=300)
    finally:
        kill_job(proc)
    assert proc.returncode == 0, err[-5000:]
    left = remove_leftovers(before, str(tmpdir))
    if mpi_flavour(mpiexec()) == "openmpi":
        # A dead host cleans up nothing (hsgd unlinks MPICH's segment early, not Open MPI's): its shared
        # memory, and in the job's TMPDIR its daemons' session directories, and those of the probes'
        # daemons, started there through the emulated remote shell and killed with the probe
        dead = tuple(f"sm_segment.{hosts.hosts[i].name}." for i in (1, 2))
        left = [f for f in left if not (Path(f).name.startswith(dead) or f.startswith(str(tmpdir)))]
    assert not left, f"the supervised run left files behind: {left}"

    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs][-EPOCHS:] == list(range(EPOCHS))
    starts = records(run, "start")
    restarts = records(run, "restart")
    addresses = [h.address for h in hosts.hosts]
    assert [s["world_size"] for s in starts] == [6, 4, 4]
    assert [(r["lost_hosts"], r["hosts"], r["world_size"]) for r in restarts] == [
        ([addresses[2]], addresses[:2], 4), ([addresses[1]], [addresses[0], addresses[2]], 4)]
    assert [r["from_step"] for r in restarts] == [s["resumed"] for s in starts[1:]]
    assert all(r["seconds_lost"] is not None and r["seconds_lost"] > 0 for r in restarts), restarts
    assert 0 < starts[1]["resumed"] < STEPS < starts[2]["resumed"] < 2 * STEPS  # mid-epoch, both
    assert hsgd_report.main([str(run), "--no-plots"]) == 0  # in this process: no launch
    shown = capsys.readouterr().out
    assert f"restart 2 at step {starts[2]['resumed']}" in shown, shown

    ends = [s["resumed"] for s in starts[1:]] + [EPOCHS * STEPS]
    used = steps_used(samples, [(s["step"], end) for s, end in zip(starts, ends)])
    assert sorted(used) == list(range(1, EPOCHS * STEPS + 1))
    for epoch in range(EPOCHS):
        seen = sum((used[s] for s in range(epoch * STEPS + 1, (epoch + 1) * STEPS + 1)), [])
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: a sample lost or seen twice"

    # By hand: the checkpoint the last restart loaded, resumed at 2 + 2 ranks on hosts 0 and 2.
    resumed = run / "checkpoints" / f"ckpt-{starts[2]['resumed']:09d}.pt"
    (tmp_path / "by-hand" / "checkpoints").mkdir(parents=True)
    shutil.copy(resumed, tmp_path / "by-hand" / "checkpoints")
    cmd = hosts.mpi_command([sys.executable, "-m", "hsgd.train", *train, "--run-dir", str(tmp_path / "by-hand"),
                             "--resume"], [2, 0, 2])
    by_hand = run_command(cmd, env={**hosts.tcp_env(), "PYTHONPATH": str(Path(__file__).parent)}, timeout=300)
    assert by_hand.returncode == 0, by_hand.stderr[-4000:]
    final = f"ckpt-{EPOCHS * STEPS:09d}.pt"
    want = torch.load(tmp_path / "by-hand" / "checkpoints" / final, weights_only=True)["model"]
    got = torch.load(run / "checkpoints" / final, weights_only=True)["model"]
    assert all(torch.equal(want[k], got[k]) for k in want)
