"""Checkpoint files: atomic writes, damaged ones skipped on resume, the newest K kept."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hsgd._trainer.checkpoint import latest_checkpoint, load_checkpoint, newest_loadable, save_checkpoint


def state(step, numel=10):
    return {"model": {"w": torch.full((numel,), float(step))}, "step": step}


def test_a_truncated_newest_checkpoint_falls_back_to_the_newest_good_one(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, state(step), step)
    newest = latest_checkpoint(tmp_path)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # torn by a full disk, say
    path, loaded, damaged = newest_loadable(tmp_path)
    assert path.name == "ckpt-000000020.pt" and loaded["step"] == 20
    assert len(damaged) == 1 and "ckpt-000000030.pt" in damaged[0]


def test_no_loadable_checkpoint_is_an_error_naming_each(tmp_path):
    assert newest_loadable(tmp_path / "none") == (None, None, [])
    for step in (1, 2):
        save_checkpoint(tmp_path, state(step), step)
    for path in tmp_path.glob("ckpt-*.pt"):
        path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="no checkpoint .* can be loaded.*ckpt-000000002.*ckpt-000000001"):
        newest_loadable(tmp_path)


@pytest.mark.parametrize("keep", [1, 2, 5])
def test_the_newest_keep_checkpoints_stay(tmp_path, keep):
    for step in range(1, 8):
        save_checkpoint(tmp_path, state(step), step, keep=keep)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == \
        [f"ckpt-{s:09d}.pt" for s in range(max(1, 8 - keep), 8)]


# The trainer's way: the write in a background thread while the main thread goes on.
WRITER = """
import sys, time, torch
from hsgd._trainer.saving import CheckpointWriter
CheckpointWriter(sys.argv[1], keep=3).submit({"model": {"w": torch.ones(50_000_000)}, "step": 2}, 2)
while True:
    time.sleep(0.01)  # training goes on
"""


def test_sigkill_in_the_middle_of_a_write_keeps_the_good_checkpoint(tmp_path):
    save_checkpoint(tmp_path, state(1), 1)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".ckpt-*.tmp")):  # the 200 MB write has begun
        assert writer.poll() is None and time.monotonic() < deadline, "the writer never started writing"
        time.sleep(0.001)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert not (tmp_path / "ckpt-000000002.pt").exists()
    path, loaded, damaged = newest_loadable(tmp_path)
    assert path.name == "ckpt-000000001.pt" and loaded["step"] == 1 and not damaged
    save_checkpoint(tmp_path, state(3), 3)  # the next save removes the partial file
    assert not list(tmp_path.glob(".ckpt-*.tmp"))
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 3
