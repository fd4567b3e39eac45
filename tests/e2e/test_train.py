"""End to end: python -m hsgd.train under mpiexec, its outputs, resumes and errors."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from mpirun import ROOT, descendants, kill_job, mpi_command, mpi_env, remove_leftovers, run_mpi, snapshot

from hsgd._trainer.precision import AMP_DTYPES
from hsgd.amp import probe_autocast
from hsgd.data import ensure_mnist1d

SMALL = ["--mnist1d-samples", "2000", "--epochs", "2", "--batch-size", "64", "--progress", "lines"]
STEPS_PER_EPOCH = 2000 // 64  # 31: each of 2 ranks takes 31 batches of 32 (drop_last)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One generated MNIST-1D file shared by the tests of this module."""
    return str(tmp_path_factory.mktemp("cache"))


def train(nprocs, args, cache, timeout=300, module=("-m", "hsgd.train"), env=None):
    return run_mpi(nprocs, [*module, "--cache-dir", cache, *args], timeout=timeout, env=env)


def sigill_probe_env():
    """A job's environment in which the autocast probe's child dies of SIGILL, as on a CPU that
    advertises AMX its hypervisor does not enable (tests/amp_faults/sitecustomize.py on PYTHONPATH)."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "amp_faults"),
                                           *filter(None, [os.environ.get("PYTHONPATH")])])}


def records(run_dir, event):
    """Complete records of ``event`` (a line still being written is skipped)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().split("\n")[:-1]
    return [r for r in map(json.loads, lines) if r["event"] == event]


def final_model(checkpoint_dir):
    latest = sorted(Path(checkpoint_dir).glob("ckpt-*.pt"))[-1]
    return torch.load(latest, weights_only=True)["model"]


def test_run_writes_metrics_timeline_and_report(tmp_path, cache):
    run = tmp_path / "run"
    proc = train(2, [*SMALL, "--run-dir", str(run), "--timeline", str(tmp_path / "trace.json"),
                     "--tensorboard"], cache)
    assert proc.returncode == 0, proc.stderr
    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert epochs[-1]["test_acc"] > 0.25  # 10 classes: chance is 0.1
    assert set(epochs[-1]["time"]) >= {"data", "compute", "intra", "eval"}
    # One node of 2 ranks: every step's node mean copies 2 (k - 1) n = 2 n bytes in shared
    # memory (n: the padded gradient buffer), nothing crosses nodes.
    steps_per_epoch = epochs[1]["step"] - epochs[0]["step"]
    assert epochs[-1]["inter_bytes"] == 0
    assert epochs[-1]["intra_bytes"] > 0 and epochs[-1]["intra_bytes"] % (2 * steps_per_epoch) == 0
    steps = records(run, "step")
    assert steps and all(s["loss"] > 0 and s["samples_per_s"] > 0 and s["ranks"] == 2 for s in steps)
    assert json.loads((run / "config.json").read_text())["batch_size"] == 64
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in trace if e["ph"] == "X"} == {0, 1}
    assert {"data", "compute", "intra"} <= {e["name"] for e in trace}
    report = subprocess.run([sys.executable, "-m", "hsgd.report", str(run)], capture_output=True,
                            text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith("cnn, adamw, 2 ranks, batch 64\n"), report.stdout
    assert (run / "plots" / "accuracy.png").stat().st_size > 1000
    board = [event.tag for path in (run / "tensorboard").glob("events.out.tfevents.*")
             for event in _tensorboard_scalars(path)]
    assert {"step/loss", "epoch/test_acc", "epoch/intra_bytes", "epoch/time/compute"} <= set(board)


def _tensorboard_scalars(path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    return [value for event in EventFileLoader(str(path)).Load()
            for value in event.summary.value]


LOCAL_SGD = ["--sync", "local", "--intra-period", "2", "--inter-period", "2",
             "--ranks-per-node", "1", "--compression", "bf16"]
# period 6, fragment 1 syncs after steps 3, 9, 15, 21 and merges 2 steps later: in flight at step 23,
# its pseudo-gradients across the two nodes in int8 with error feedback (in the checkpoint's rank states)
STREAMING_DILOCO = ["--sync", "diloco", "--intra-period", "2", "--inter-period", "3", "--ranks-per-node", "1",
                    "--fragments", "2", "--fragment-sync-delay", "2", "--fragment-update-alpha", "0.5",
                    "--outer-compression", "int8"]


@pytest.fixture(scope="module")
def whole_runs(tmp_path_factory, cache):
    """``run(extra)`` -> the run directory of an uninterrupted run with ``extra``: one run per
    setting, shared by the stop-and-resume cases of that setting."""
    made = {}

    def run(extra):
        key = tuple(extra)
        if key not in made:
            run_dir = tmp_path_factory.mktemp("whole")
            proc = train(2, [*SMALL, "--optimizer", "sgd", "--lr", "0.05", *extra, "--run-dir", str(run_dir)], cache)
            assert proc.returncode == 0, proc.stderr
            assert [e["step"] for e in records(run_dir, "epoch")] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
            made[key] = run_dir
        return made[key]
    return run


# synchronous SGD across two nodes of one rank, each keeping its node's error feedback
SYNC_POWERSGD = ["--ranks-per-node", "1", "--compression", "powersgd", "--powersgd-rank", "2"]


# Stopped mid-epoch (step 23) and resumed; synchronous SGD is stopped again on an epoch's last
# step (STEPS_PER_EPOCH) by its first resume, and resumed from there: one chain of runs for both.
@pytest.mark.parametrize("extra,stops", [(SYNC_POWERSGD, (23, STEPS_PER_EPOCH)), (LOCAL_SGD, (23,)),
                                         (STREAMING_DILOCO, (23,))])
def test_stopped_and_resumed_run_ends_identical(tmp_path, cache, whole_runs, extra, stops):
    common = [*SMALL, "--optimizer", "sgd", "--lr", "0.05", *extra]
    whole = whole_runs(extra)
    part = tmp_path / "part"
    done = 0
    for stop_at in stops:
        first = train(2, [*common, "--run-dir", str(part), "--stop-after", str(stop_at - done),
                          *(["--resume"] if done else [])], cache)
        assert first.returncode == 0, first.stderr
        assert f"stopped (stop-after) after {stop_at} steps" in first.stderr
        assert len(records(part, "epoch")) == (stop_at == STEPS_PER_EPOCH)  # the epoch ended before the stop
        done = stop_at
    second = train(2, [*common, "--run-dir", str(part), "--resume"], cache)
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stderr
    want, got = final_model(whole / "checkpoints"), final_model(part / "checkpoints")
    for key in want:
        assert torch.equal(want[key], got[key]), key
    epochs = records(part, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert all(math.isfinite(e["train_loss"]) and e["train_loss"] > 0 for e in epochs)  # no NaN or Inf
    # each job's last record says how it ended (a supervisor's evidence besides the exit status)
    assert [(e["step"], e["stopped"]) for e in records(part, "end")] == \
        [*((s, "stop-after") for s in stops), (2 * STEPS_PER_EPOCH, None)]


def test_resume_on_another_number_of_ranks_continues_the_interrupted_epoch(tmp_path, cache):
    """2 ranks stop mid-epoch; 1 rank resumes from the saved model at the same global batch of that
    epoch, with the step count and LR schedule of that point, and ends where an unstopped run ends."""
    run = tmp_path / "run"
    common = [*SMALL, "--model", "mlp", "--run-dir", str(run)]
    first = train(2, [*common, "--stop-after", "20"], cache)
    assert first.returncode == 0, first.stderr
    second = train(1, [*common, "--resume"], cache)
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stderr and "(step 20)" in second.stderr
    assert "the checkpoint is from 2 ranks, this run has 1" in second.stderr
    epochs = records(run, "epoch")
    assert [(e["epoch"], e["step"]) for e in epochs] == [(0, STEPS_PER_EPOCH), (1, 2 * STEPS_PER_EPOCH)]
    assert records(run, "step")[-1]["ranks"] == 1
    assert f"done after {2 * STEPS_PER_EPOCH} steps" in second.stderr


def test_trainer_flags_sharded_lars_scaled_step_schedule_test_file_bar_and_saves(tmp_path, cache):
    """One run through flags that no other test takes: --inter-node sharded (2 virtual nodes),
    --overlap with small buckets (averaged across nodes inside backward), --optimizer lars,
    --scale-lr, --schedule step, --test-data with its own keys, --progress bar, --save-every
    with --keep-checkpoints."""
    test_file = tmp_path / "test.h5"
    generated = ensure_mnist1d(cache, num_samples=2500)  # the file --mnist1d-samples 2000 uses
    with h5py.File(generated, "r") as f, h5py.File(test_file, "w") as out:
        out["inputs"], out["labels"] = f["x_test"][:300], f["y_test"][:300]
    run = tmp_path / "run"
    proc = train(2, [*SMALL, "--model", "mlp", "--run-dir", str(run), "--log-every", "10",
                     "--inter-node", "sharded", "--ranks-per-node", "1", "--overlap", "--bucket-cap-mb", "0.01",
                     "--optimizer", "lars", "--lr", "20", "--scale-lr",  # 20 * 64 / 256 = 5
                     "--schedule", "step", "--milestones", "1",
                     "--test-data", str(test_file), "--test-x-key", "inputs", "--test-y-key", "labels",
                     "--progress", "bar", "--save-every", "10", "--keep-checkpoints", "3"], cache)
    assert proc.returncode == 0, proc.stderr
    assert "HierarchicalSGD(LARS, inter_node='sharded'" in proc.stderr and "node_sizes=[1, 1]" in proc.stderr
    assert "2000 train / 300 test samples" in proc.stderr
    for epoch in (0, 1):  # tqdm draws each epoch's bar when it starts
        assert f"epoch {epoch}:   0%|          | 0/{STEPS_PER_EPOCH} [" in proc.stderr, proc.stderr[-3000:]
    lrs = {s["step"]: s["lr"] for s in records(run, "step")}
    assert lrs[20] == pytest.approx(5.0) and lrs[40] == pytest.approx(0.5), lrs  # x0.1 after epoch 1
    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1] and all(e["inter_bytes"] > 0 for e in epochs)
    assert max(e["test_acc"] for e in epochs) > 0.2  # the test file's 300 samples, 10 classes
    # saved every 10 steps and at epoch ends (31, 62): the newest 3 stay
    assert sorted(p.name for p in (run / "checkpoints").glob("ckpt-*.pt")) == \
        [f"ckpt-{s:09d}.pt" for s in (50, 60, 62)]


def stop_at_20_and_resume(run, args, cache):
    """Run ``args`` for 20 steps, then resume to the end; returns the epoch records and the
    checkpointed model at the stop."""
    common = [*SMALL, "--ranks-per-node", "1", *args, "--run-dir", str(run)]
    first = train(2, [*common, "--stop-after", "20"], cache)
    assert first.returncode == 0, first.stderr
    stopped = final_model(run / "checkpoints")
    second = train(2, [*common, "--resume"], cache)
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stderr and "(step 20)" in second.stderr
    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1]
    return epochs, stopped


@pytest.mark.parametrize("mode", [["--sync", "elastic", "--alpha", "0.3"], ["--sync", "async"]])
def test_parameter_box_run_stops_and_resumes_from_w_g(tmp_path, cache, mode):
    """The box modes train, checkpoint W_g, and resume from it (ranks interleave freely:
    no bit-identical end, but the resumed run starts from the checkpoint and finishes)."""
    run = tmp_path / "run"
    epochs, stopped = stop_at_20_and_resume(run, mode, cache)
    assert epochs[-1]["test_acc"] > 0.15  # 10 classes: chance is 0.1
    # two virtual nodes, one owner each: half of W_g is on the other node
    assert epochs[-1]["inter_bytes"] > 0 and epochs[-1]["intra_bytes"] > 0
    final = final_model(run / "checkpoints")
    assert any(not torch.equal(stopped[k], final[k]) for k in final)  # it trained on from there


def test_gossip_run_saves_the_consensus_and_resumes(tmp_path, cache):
    """--sync gossip trains; its checkpoint holds the push-sum consensus of the replicas (never
    one rank's), and a stopped run resumes with each rank's weight and replica."""
    run = tmp_path / "run"
    epochs, _ = stop_at_20_and_resume(run, ["--sync", "gossip", "--gossip-theta", "0.01"], cache)
    assert epochs[-1]["test_acc"] > 0.25  # 10 classes: chance is 0.1
    assert epochs[-1]["inter_bytes"] > 0 and epochs[-1]["intra_bytes"] == 0  # the peer is on the other node
    state = torch.load(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=False)
    weights = [r["optimizer"]["hsgd_gossip"]["weight"] for r in state["replicas"]]
    for key, value in state["model"].items():
        if value.is_floating_point() and key in dict(state["replicas"][0]["model"]):
            mass = sum(w * r["model"][key].double() for w, r in zip(weights, state["replicas"]))
            assert torch.allclose(value.double(), mass / sum(weights), atol=1e-6), key


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The process id of rank ``rank`` of the job ``launcher`` started (MPICH or Open MPI)."""
    wanted = {f"PMI_RANK={rank}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    for pid in descendants(launcher.pid):
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if env & wanted and b"hsgd.train" in cmdline:
            return pid
    raise AssertionError(f"no rank {rank} among the job's processes")


# SIGTERM to rank 1 alone (what Slurm sends each task at its time limit or on scancel): the ranks
# must agree on the stop. SIGUSR1 to mpiexec, which forwards it to every rank, in async with a
# straggler: the ranks drift apart and agree on the stop through remote memory.
@pytest.mark.parametrize("extra,sig", [([], signal.SIGTERM),
                                       (["--sync", "async", "--straggler", "1:3"], signal.SIGUSR1)],
                         ids=["sync-SIGTERM-to-rank-1", "async-SIGUSR1-to-mpiexec"])
def test_signal_checkpoints_and_exits_for_requeue(tmp_path, cache, extra, sig):
    run = tmp_path / "run"
    cmd = mpi_command(2, ["-m", "hsgd.train", "--cache-dir", cache, *SMALL, "--epochs", "50",
                          "--log-every", "5", "--run-dir", str(run), *extra])
    shm_before, tmpdir = snapshot(), str(tmp_path / "tmp")
    os.mkdir(tmpdir)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(tmpdir=tmpdir), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or not records(run, "step"):
            assert time.monotonic() < deadline and proc.poll() is None, "training never started"
            time.sleep(0.2)
        if sig == signal.SIGTERM:
            os.kill(rank_pid(proc, 1), sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_job(proc)
    left = remove_leftovers(shm_before, tmpdir)
    assert proc.returncode == 75, err
    assert not left, f"a job stopped by a signal left files behind: {left}"
    assert "stopped (signal)" in err
    checkpoints = sorted((run / "checkpoints").glob("ckpt-*.pt"))
    assert checkpoints
    state = torch.load(checkpoints[-1], weights_only=False)
    assert f"stopped (signal) after {state['step']} steps" in err  # one step for every rank


def test_balance_gives_the_straggler_less_and_a_resume_keeps_the_saved_shares(tmp_path, cache):
    """--balance gives the slow rank less. Shares saved mid-epoch keep weighting that epoch when
    the run resumes, with --balance (balanced anew after it) or without (equal batches after it);
    a mode that cannot weight them is refused with one error. One stopped run, resumed both ways."""
    run, plain = tmp_path / "run", tmp_path / "plain"
    balance = ["--balance", "--straggler", "1:3"]
    first = train(2, [*SMALL, "--ranks-per-node", "1", *balance, "--run-dir", str(run), "--stop-after", "20"],
                  cache)
    assert first.returncode == 0, first.stderr
    shutil.copytree(run, plain)
    saved = torch.load(run / "checkpoints" / f"ckpt-{20:09d}.pt", weights_only=False)["loader"]["shares"]

    second = train(2, [*SMALL, "--ranks-per-node", "1", *balance, "--run-dir", str(run), "--resume"], cache)
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stderr and "(step 20)" in second.stderr
    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1]
    for epoch in epochs:
        shares = epoch["batch_shares"]
        assert sum(shares) == 64 and min(shares) >= 1 and shares[1] < shares[0], shares
        assert math.isfinite(epoch["train_loss"])
    assert saved == epochs[0]["batch_shares"]  # the resumed epoch kept them
    assert epochs[-1]["test_acc"] > 0.25  # 10 classes: chance is 0.1

    common = [*SMALL, "--ranks-per-node", "1", "--run-dir", str(plain)]
    refused = train(2, [*common, "--resume", "--sync", "gossip"], cache)
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert refused.returncode == 2 and len(errors) == 1 and "cannot weight them" in errors[0], refused.stderr
    resumed = train(2, [*common, "--resume"], cache)
    assert resumed.returncode == 0, resumed.stderr
    epochs = records(plain, "epoch")
    assert epochs[0]["batch_shares"] == saved != [32, 32] and epochs[1]["batch_shares"] == [32, 32]


def test_straggler_stretches_its_steps_and_every_rank_reports_its_pace(tmp_path, cache):
    run = tmp_path / "run"
    proc = train(2, [*SMALL, "--sync", "async", "--straggler", "0:3", "--log-every", "5",
                     "--run-dir", str(run)], cache)
    assert proc.returncode == 0, proc.stderr
    for epoch in records(run, "epoch"):
        times = epoch["time"]  # rank 0's phases: rank 0 is the straggler
        # each step's own work (data and compute, not communication) is stretched by 2x
        assert times["straggler"] >= 1.9 * (times["data"] + times["compute"]), times
        assert len(epoch["rank_steps_per_s"]) == 2 and min(epoch["rank_steps_per_s"]) > 0
    steps = records(run, "step")
    assert steps and all(s["ranks"] == 1 for s in steps)  # async: rank 0's own, no collective


def bad_h5(tmp_path, name, **arrays):
    path = tmp_path / name
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f[key] = value
    return str(path)


def bad_inputs(tmp_path):
    """(name, ranks, extra args, text the one error line must contain). A flag's own checks are
    unit-tested (tests/unit/test_config.py); these show that an error of each kind (a bad
    flag, a bad file, a problem only the ranks together see) ends the job with one line. One
    case of each kind runs on 2 ranks (every rank finds the error; one line is printed); the
    other cases of the same kind, on the same path, run on 1 rank (half the processes)."""
    not_h5 = tmp_path / "text.h5"
    not_h5.write_text("hello")
    tiny = bad_h5(tmp_path, "tiny.h5", x=np.zeros((8, 40), np.float32), y=np.arange(8) % 2)
    floats = bad_h5(tmp_path, "floats.h5", x=np.zeros((100, 40), np.float32), y=np.zeros(100))
    blocker = tmp_path / "file"
    blocker.write_text("")
    return [
        ("model", 1, ["--model", "transformer"], "--model 'transformer' is not a built-in model"),
        ("lr", 2, ["--lr", "0"], "--lr must be positive"),
        ("missing", 2, ["--data", str(tmp_path / "nope.h5")], "nope.h5"),
        ("not hdf5", 1, ["--data", str(not_h5)], "HDF5"),
        ("key", 1, ["--data", tiny, "--x-key", "images"], "images"),
        ("labels", 1, ["--data", floats, "--x-key", "x", "--y-key", "y"], "label"),
        ("batch", 1, ["--data", tiny, "--x-key", "x", "--y-key", "y", "--batch-size", "64"], "larger than the 8"),
        ("unwritable", 1, ["--checkpoint-dir", str(blocker / "sub")], "--checkpoint-dir"),
        ("odd batch, gossip", 2, ["--batch-size", "63", "--sync", "gossip"],
         "--sync gossip cannot weight unequal batches"),  # --sync sync weights 32 + 31
        ("straggler rank", 2, ["--straggler", "2:3"], "no rank 2 in a job of 2 ranks"),
        ("overlap fp16", 2, ["--overlap", "--amp", "fp16"], "--overlap averages the gradients during backward"),
    ] + ([] if torch.cuda.is_available() else
         [("no GPU", 1, ["--device", "cuda"], "--device cuda, but torch sees no GPU")])


def test_bad_input_gets_one_message_and_exit_2(tmp_path, cache):
    failures = []
    for name, ranks, args, text in bad_inputs(tmp_path):
        proc = train(ranks, [*SMALL, "--run-dir", str(tmp_path / "runs" / name), *args], cache, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        if proc.returncode != 2 or len(errors) != 1 or text not in errors[0] or "Traceback" in proc.stderr:
            failures.append(f"{name}: exit {proc.returncode}, stderr:\n{proc.stderr[-2000:]}")
    assert not failures, "\n\n".join(failures)


def test_a_bug_keeps_its_traceback_and_aborts_the_job(tmp_path, cache):
    """A programming error (not a bad value from the user) is no one-line 'error:'."""
    code = ("import sys, torch, hsgd.train\n"
            "def broken(*args, **kwargs):\n"
            "    raise AttributeError('a bug in model code')\n"
            "torch.nn.Conv1d.__init__ = broken  # the default model, cnn, builds Conv1d layers\n"
            "sys.exit(hsgd.train.main(sys.argv[1:]))\n")
    proc = train(2, [*SMALL, "--run-dir", str(tmp_path / "run")], cache, timeout=120,
                 module=["-c", code])
    assert proc.returncode not in (0, 2), proc.stderr
    assert "Traceback" in proc.stderr and "AttributeError: a bug in model code" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if "train: error:" in line]


def test_checkpoint_of_another_model_is_refused(tmp_path, cache):
    run = str(tmp_path / "run")
    first = train(2, [*SMALL, "--epochs", "1", "--model", "mlp", "--run-dir", run], cache)
    assert first.returncode == 0, first.stderr
    second = train(2, [*SMALL, "--model", "cnn", "--run-dir", run, "--resume"], cache)
    assert second.returncode == 2
    errors = [line for line in second.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "different model" in errors[0], second.stderr


@pytest.mark.parametrize("mode", [["--sync", "sync"], ["--sync", "async", "--straggler", "1:3"],
                                  ["--sync", "gossip"]])
def test_uneven_data_and_an_empty_evaluation_shard_end_cleanly(tmp_path, cache, mode):
    """8 training samples on 3 ranks, 2 test samples (one rank evaluates none); in async the
    ranks also finish their steps at different times. Every collective is entered alike."""
    run = tmp_path / "run"
    proc = train(3, ["--mnist1d-samples", "10", "--batch-size", "6", "--epochs", "2", "--progress", "lines",
                     "--run-dir", str(run), *mode], cache, timeout=120)
    assert proc.returncode == 0, proc.stderr
    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1] and all(0 <= e["test_acc"] <= 1 for e in epochs)
    assert "8 train / 2 test samples" in proc.stderr


def test_non_finite_gradients_skip_steps_then_stop_the_run(tmp_path, cache):
    # across two nodes with int8: the skipped steps leave its error feedback as it was (NaN-free)
    proc = train(2, [*SMALL, "--optimizer", "sgd", "--lr", "1e20", "--nonfinite-limit", "3",
                     "--ranks-per-node", "1", "--compression", "int8", "--run-dir", str(tmp_path / "run")], cache)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "NaN or Inf in 3 steps in a row" in errors[0], \
        proc.stderr
    assert proc.stderr.count("step skipped") == 3, proc.stderr  # logged once per skip (rank 0)


@pytest.mark.parametrize("mode", [["--sync", "sync"], ["--sync", "local", "--intra-period", "1"]])
def test_clip_grad_norm_bounds_every_update(tmp_path, cache, mode):
    # plain SGD at lr 2: a step moves the parameters by lr x the clipped gradient, at most 2 x 1e-3;
    # in local SGD each rank's step is clipped and the node's average moves no further
    common = [*SMALL, *mode, "--optimizer", "sgd", "--momentum", "0", "--lr", "2", "--schedule", "constant",
              "--warmup-epochs", "0", "--clip-grad-norm", "1e-3", "--ranks-per-node", "2"]
    models = []
    for steps in (5, 6):
        run = tmp_path / f"run{steps}"
        proc = train(2, [*common, "--run-dir", str(run), "--stop-after", str(steps)], cache)
        assert proc.returncode == 0, proc.stderr
        models.append(final_model(run / "checkpoints"))
    moved = math.sqrt(sum(float(((models[1][k] - models[0][k]) ** 2).sum()) for k in models[0]))
    assert 1e-4 < moved <= 2e-3 * (1 + 1e-4), moved


def test_resume_skips_a_damaged_newest_checkpoint_and_refuses_when_none_loads(tmp_path, cache):
    run = tmp_path / "run"
    common = [*SMALL, "--run-dir", str(run), "--save-every", "10", "--keep-checkpoints", "2"]
    first = train(2, [*common, "--stop-after", "20"], cache)
    assert first.returncode == 0, first.stderr
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("ckpt-*.pt")) == ["ckpt-000000010.pt", "ckpt-000000020.pt"]
    newest = ckpts / "ckpt-000000020.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # torn
    second = train(2, [*common, "--resume", "--stop-after", "5"], cache)
    assert second.returncode == 0, second.stderr
    assert second.stderr.count("damaged checkpoint") == 1, second.stderr
    assert "ckpt-000000010.pt (step 10)" in second.stderr
    for path in ckpts.glob("ckpt-*.pt"):
        path.write_bytes(b"not a checkpoint")
    third = train(2, [*common, "--resume"], cache)
    errors = [line for line in third.stderr.splitlines() if "error:" in line]
    assert third.returncode == 2 and len(errors) == 1 and "can be loaded" in errors[0], third.stderr


@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_resnet_on_images(tmp_path, cache, layout):
    """The ResNet with BatchNorm on tiny images, both channel layouts."""
    gen = np.random.default_rng(0)
    y = gen.integers(0, 3, 192)
    x = gen.normal(size=(192, 3, 8, 8)).astype(np.float32) + y[:, None, None, None]
    if layout == "hwc":
        x = x.transpose(0, 2, 3, 1).copy()
    data = bad_h5(tmp_path, "images.h5", x_train=x[:128], y_train=y[:128], x_test=x[128:], y_test=y[128:])
    run = tmp_path / "run"
    proc = train(2, ["--data", data, "--model", "resnet", "--optimizer", "sgd", "--lr", "0.05",
                     "--epochs", "3", "--batch-size", "32", "--run-dir", str(run)], cache)
    assert proc.returncode == 0, proc.stderr
    assert records(run, "epoch")[-1]["test_acc"] > 0.6  # classes are shifted means: easy


def skip_unless_autocast_works(amp):
    """Mixed precision depends on the CPU: tried in a child process (where it may crash), and
    the test is skipped with the reason where it does not work."""
    problem = probe_autocast("cpu", AMP_DTYPES[amp])
    if problem:
        pytest.skip(f"--amp {amp} cannot run on this machine: {problem}")


def test_amp_bf16_trains_and_evaluates(tmp_path, cache):
    skip_unless_autocast_works("bf16")
    run = tmp_path / "run"
    proc = train(2, [*SMALL, "--amp", "bf16", "--run-dir", str(run)], cache)
    assert proc.returncode == 0, proc.stderr
    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert all(math.isfinite(e["train_loss"]) and math.isfinite(e["test_loss"]) for e in epochs)
    assert epochs[-1]["test_acc"] > 0.25  # 10 classes: chance is 0.1
    assert json.loads((run / "config.json").read_text())["amp"] == "bf16"
    assert "scaler" not in final_checkpoint(run / "checkpoints")  # bfloat16 needs no loss scaling


def final_checkpoint(checkpoint_dir):
    return torch.load(sorted(Path(checkpoint_dir).glob("ckpt-*.pt"))[-1], weights_only=True)


def test_amp_fp16_scales_the_loss_and_resumes_with_the_saved_scale(tmp_path, cache):
    """--amp fp16 across 2 virtual nodes: the GradScaler's state is checkpointed and a resumed run
    continues from it (the saved scale is changed to one a fresh scaler would not have)."""
    skip_unless_autocast_works("fp16")
    run = tmp_path / "run"
    common = [*SMALL, "--amp", "fp16", "--ranks-per-node", "1", "--run-dir", str(run)]
    first = train(2, [*common, "--stop-after", "20"], cache)
    assert first.returncode == 0, first.stderr
    path = run / "checkpoints" / f"ckpt-{20:09d}.pt"
    state = torch.load(path, weights_only=True)
    assert state["scaler"]["scale"] == 65536.0 and state["scaler"]["_growth_tracker"] == 20, state["scaler"]
    state["scaler"]["scale"] = 1024.0
    torch.save(state, path)
    second = train(2, [*common, "--resume"], cache)
    assert second.returncode == 0, second.stderr
    assert "(step 20)" in second.stderr
    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1] and all(math.isfinite(e["train_loss"]) for e in epochs)
    assert epochs[-1]["test_acc"] > 0.25
    scaler = final_checkpoint(run / "checkpoints")["scaler"]
    assert scaler["scale"] == 1024.0 and scaler["_growth_tracker"] == 2 * STEPS_PER_EPOCH, scaler


def test_amp_whose_probe_fails_ends_the_job_with_one_error(tmp_path, cache):
    """As on a CPU that advertises AMX its hypervisor does not enable: the probe's child dies of
    SIGILL (simulated by a sitecustomize on the job's PYTHONPATH, also under ONEDNN_MAX_CPU_ISA,
    so that the test holds where that is set)."""
    proc = train(2, [*SMALL, "--amp", "bf16", "--run-dir", str(tmp_path / "run")], cache, timeout=120,
                 env=sigill_probe_env())
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith("python -m hsgd.train: error: --amp bf16: bfloat16 autocast on the CPU killed "
                                "a test process with SIGILL (illegal instruction"), errors[0]
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" in errors[0] and errors[0].endswith("(--amp none)"), errors[0]
    assert "train samples" not in proc.stderr  # stopped before any model was built
