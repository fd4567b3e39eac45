"""--save-every in steps or seconds, and the background checkpoint writer (one process, no MPI)."""

import threading
import time

import pytest
import torch

from hsgd import InputError
from hsgd._trainer import saving
from hsgd._trainer.checkpoint import latest_checkpoint, load_checkpoint
from hsgd._trainer.saving import FIRST_ESTIMATE_STEPS, CheckpointWriter, SaveCadence, parse_save_every


class Root:
    """Rank 0 of a world whose broadcasts return what rank 0 gave."""

    def __init__(self):
        self.broadcasts = []

    def Get_rank(self):
        return 0

    def bcast(self, value, root=0):
        self.broadcasts.append(value)
        return value


@pytest.mark.parametrize("text,want", [("0", (0, 0.0)), ("100", (100, 0.0)), ("30s", (0, 30.0)),
                                       (" 5m ", (0, 300.0))])
def test_save_every_takes_steps_or_seconds(text, want):
    assert parse_save_every(text) == want


@pytest.mark.parametrize("text", ["-1", "1.5", "30 sec", "s", "10h"])
def test_save_every_refuses_anything_else_saying_what_to_write(text):
    with pytest.raises(ValueError, match=r"steps \(e.g. 100\) or seconds \(e.g. 30s, 5m\)"):
        parse_save_every(text)


def test_a_step_cadence_saves_every_n_steps_without_talking():
    comm = Root()
    cadence = SaveCadence((5, 0.0), comm, step=0)
    assert [s for s in range(1, 21) if cadence.due(s)] == [5, 10, 15, 20] and not comm.broadcasts


def test_a_seconds_cadence_saves_after_that_many_seconds_at_rank_0s_pace(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(saving.time, "monotonic", lambda: clock[0])
    comm = Root()
    cadence = SaveCadence((0, 2.0), comm, step=40)  # a run resumed at step 40; 2 s between saves
    saves = []
    for step in range(41, 101):
        clock[0] += 0.1  # 0.1 s a step: a save every 20 steps
        if cadence.due(step):
            saves.append(step)
            cadence.saved(step)
    assert saves == [60, 80, 100]
    assert comm.broadcasts[0] == 20 and len(comm.broadcasts) == 1 + len(saves)  # the estimate, then each save
    assert 40 + FIRST_ESTIMATE_STEPS < saves[0]


def test_the_writer_writes_in_the_background_one_write_at_a_time(tmp_path, monkeypatch):
    started, release, order = threading.Event(), threading.Event(), []
    write = saving.save_checkpoint

    def slow(directory, state, step, keep):
        order.append(("start", step))
        started.set()
        release.wait(10)
        write(directory, state, step, keep)
        order.append(("end", step))
    monkeypatch.setattr(saving, "save_checkpoint", slow)
    writer = CheckpointWriter(tmp_path, keep=2)
    writer.submit({"model": {"w": torch.zeros(3)}, "step": 1}, 1)
    assert started.wait(10) and order == [("start", 1)]  # submit returned while the write goes on
    threading.Timer(0.2, release.set).start()
    writer.submit({"model": {"w": torch.ones(3)}, "step": 2}, 2)  # waits for the first write
    writer.wait()
    assert order == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 2


def test_a_failed_write_fails_the_next_save_saying_what_to_do(tmp_path):
    (tmp_path / "file").write_text("")
    writer = CheckpointWriter(tmp_path / "file" / "checkpoints", keep=2)  # a directory under a file
    writer.submit({"model": {}, "step": 1}, 1)
    time.sleep(0.01)
    with pytest.raises(InputError, match="cannot write the checkpoint of step 1 to .*--checkpoint-dir"):
        writer.wait()
    writer.wait()  # reported once
