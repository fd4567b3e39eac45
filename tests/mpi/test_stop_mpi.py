"""The trainer's stop agreement under mpiexec: after a signal on one rank, every rank stops
after the same step, also when the ranks step at different speeds (hsgd._trainer.stopping)."""

import math
import time

import pytest

from hsgd._trainer.stopping import STOP_CHECK_STEPS, CollectiveStop, RemoteStop

LIMIT = 3000  # steps: a stand-in for the epoch's end, far beyond any agreed stop


class Signal:
    received = 0.0


def steps_until_stop(cls, comm, start, signal_rank, signal_step, slow_rank, limit=LIMIT):
    """Step (sleeping 1 ms, 3 ms on ``slow_rank``) until told to stop or ``limit`` steps;
    returns the last step."""
    rank, signal = comm.Get_rank(), Signal()
    stops = cls(comm, signal, start)
    step = start
    while step < start + limit:
        time.sleep(0.003 if rank == slow_rank else 0.001)
        step += 1
        if rank == signal_rank and step == signal_step:
            signal.received = 1.0
        if stops.should_stop(step):
            break
    stops.close()
    return step


@pytest.mark.parametrize("start", [0, 25])
@pytest.mark.parametrize("who", ["last signals, first slow", "first signals and is slow"])
def test_remote_stop_is_one_step_for_all_ranks(comm, start, who):
    size = comm.Get_size()
    signal_rank, slow_rank = (size - 1, 0) if who.startswith("last") else (0, 0)
    signal_step = start + 33
    last = steps_until_stop(RemoteStop, comm, start, signal_rank, signal_step, slow_rank)
    every = comm.allgather(last)
    assert len(set(every)) == 1, every
    assert signal_step < every[0] < start + LIMIT, every


def test_remote_stop_without_a_signal_runs_on(comm):
    last = steps_until_stop(RemoteStop, comm, 0, -1, 0, 0, limit=200)
    assert comm.allgather(last) == [200] * comm.Get_size()


def test_collective_stop_at_the_next_check(comm):
    start, signal_step = 25, 33
    last = steps_until_stop(CollectiveStop, comm, start, comm.Get_size() - 1, start + signal_step, -1)
    want = math.ceil((start + signal_step) / STOP_CHECK_STEPS) * STOP_CHECK_STEPS
    assert comm.allgather(last) == [want] * comm.Get_size()
