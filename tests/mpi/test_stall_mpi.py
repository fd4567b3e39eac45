"""The stall inspector (``stall=StallSettings(timeout=...)``): reports name exactly the ranks that keep
the others waiting."""

import re
import time

import pytest
import torch
from _models import fixed_batch, mlp

from hsgd import HierarchicalSGD
from hsgd.faults import StallSettings


def build(timeout, **kwargs):
    """A mode whose own inspector has ``timeout``, or, with ``stall=``, that inspector
    (the one ``stall=`` argument: a timeout beside it is passed the old way, and refused)."""
    model = mlp(torch.float64)
    settings = {"stall": StallSettings(timeout=timeout)} if "stall" not in kwargs else \
        {} if timeout is None else {"stall_timeout": timeout}
    return model, HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, **settings, **kwargs)


def train_step(model, opt):
    x, y = fixed_batch(torch.float64)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_a_sleeping_rank_is_named_by_the_waiting_ranks(comm, capsys):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs a rank to wait for another")
    model, opt = build(1.0)
    for _ in range(3):
        train_step(model, opt)
    capsys.readouterr()
    sleeper = size - 1
    if rank == sleeper:
        time.sleep(4.0)  # the others wait in step() meanwhile
    train_step(model, opt)
    reports = [line for line in capsys.readouterr().err.splitlines() if "hsgd stall" in line]
    if rank == sleeper:
        assert not reports, reports  # it never waited
    else:
        assert reports, "no stall report after 4 s with a 1 s timeout"
        for line in reports:
            assert re.search(rf"missing: rank {sleeper} \(last at step 2\)$", line), line
            assert f"[rank {rank}]" in line and "synchronization #4 (step 3, step())" in line, line
    opt.close()


def test_a_wait_that_every_rank_entered_is_reported_as_all_arrived_only_once_it_lasts(comm, capsys):
    """A hung network, not a missing rank: every rank is inside the synchronization. The
    report at the moment the last rank arrives would be noise, so it waits one more
    period; a wait that lasts is still reported."""
    from hsgd.faults.stall import StallInspector

    stall = StallInspector(comm, timeout=0.4)
    comm.Barrier()
    start = time.monotonic()
    with stall.waiting(7, "test"):
        comm.Barrier()  # every rank has published its entry
        time.sleep(1.5)
    waited = time.monotonic() - start  # the wait's length, at most; more than 1.5 s on a loaded machine
    stall.close()
    reports = [line for line in capsys.readouterr().err.splitlines() if "hsgd stall" in line]
    assert reports, "no report after 1.5 s in a synchronization with a 0.4 s timeout"
    for line in reports:
        assert line.endswith("synchronization #1 (step 7, test); missing: none (all arrived)"), line
    # the k-th report is due once the wait reached k x 0.4 s, the first held back one period (0.1 s)
    # to see whether the wait ends: 3 in a wait of 1.5 s, one more per 0.4 s that the wait outlasted it
    assert 1 <= len(reports) <= int(waited / 0.4), (waited, reports)


def test_no_report_when_every_rank_arrives(comm, capsys):
    model, opt = build(5.0)
    assert opt.stall.enabled
    for _ in range(20):
        train_step(model, opt)
    assert "hsgd stall" not in capsys.readouterr().err
    opt.close()


def test_zero_disables_and_bad_timeouts_are_refused(comm, monkeypatch):
    _, opt = build(0)
    assert not opt.stall.enabled and opt.stall.board is None and opt.stall._thread is None
    opt.close()
    monkeypatch.setenv("HSGD_STALL_TIMEOUT", "0")
    _, opt = build(None)
    assert not opt.stall.enabled
    opt.close()
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="stall timeout"):
            build(bad)


def test_a_wait_that_is_not_counted_is_watched_all_the_same(comm, capsys):
    """An allreduce inside a backward hook (overlap=True) waits on whichever rank's hook ran it:
    such a wait is reported (and would end the job after stall_abort_after) but publishes no
    synchronization, so the ranks' counts stay comparable."""
    from hsgd.faults.stall import StallInspector

    stall = StallInspector(comm, timeout=0.4)
    with stall.waiting(7, "counted"):
        comm.Barrier()
    with stall.waiting(8, "a hook", count=False):
        time.sleep(1.5)
    assert stall.entered == 1
    comm.Barrier()
    stall.close()
    reports = [line for line in capsys.readouterr().err.splitlines() if "hsgd stall" in line]
    assert reports, "no report after 1.5 s in an uncounted wait with a 0.4 s timeout"
    for line in reports:
        assert line.endswith("synchronization #1 (step 8, a hook); missing: none (all arrived)"), line


def test_a_mode_shares_an_inspector_handed_to_it_and_leaves_it_open(comm):
    """The trainer's way: one inspector counts the mode's waits and the caller's own, and the
    caller closes it after the mode. Settings beside it, or a closed one, are refused."""
    from hsgd.faults import StallInspector

    stall = StallInspector(comm, timeout=5.0)
    model, opt = build(None, stall=stall)
    assert opt.stall is stall
    for _ in range(3):
        train_step(model, opt)
    with stall.waiting(opt.num_steps, "the caller's own"):
        comm.Barrier()
    assert stall.entered == 4  # three steps and the caller's wait, on one count
    opt.close()
    assert stall.enabled and not stall.closed  # the caller's to close
    with pytest.raises(TypeError, match="stall_timeout"):  # one stall= argument: settings or an inspector
        build(5.0, stall=stall)
    with pytest.raises(TypeError, match="StallInspector"):
        build(None, stall="60")
    stall.close()
    with pytest.raises(ValueError, match="open StallInspector"):
        build(None, stall=stall)


def test_a_wait_many_times_the_ranks_pace_ends_the_job_unless_every_rank_is_in(comm, capsys):
    """``abort_pace`` (python -m hsgd.run's default): a wait longer than K times the rank's
    slowest recent step, at least a floor, ends the job, naming the rank missing; a wait that
    every rank entered (a slow transfer) is left to ``abort_after``. The abort is recorded here
    instead of made; a floor of 0.4 s instead of 3 keeps the test short."""
    from hsgd.faults.stall import Pace, StallInspector

    size, rank = comm.Get_size(), comm.Get_rank()
    if size != 3:
        pytest.skip("one size is enough: two ranks wait for a third")
    stall = StallInspector(comm, timeout=60.0, abort_after=0, abort_pace=2.0)
    stall.pace = Pace(2.0, floor=0.4)
    aborted = []
    stall._abort = lambda why, waited: aborted.append((why, waited))
    for step in range(10):  # a pace of a few ms: the limit is the floor
        with stall.waiting(step):
            comm.Barrier()
    assert stall._limit == pytest.approx(0.4)
    if rank == 2:
        time.sleep(1.5)  # the others wait for it
    with stall.waiting(10):
        comm.Barrier()
    comm.Barrier()
    lost = list(aborted)
    with stall.waiting(11, "every rank in"):
        comm.Barrier()  # every rank has published its entry
        time.sleep(1.2)
    comm.Barrier()
    stall.close()
    assert len(aborted) == len(lost), "a wait that every rank had entered ended the job"
    if rank == 2:
        assert not lost, lost  # it never waited
        return
    assert lost, "no abort after 1.5 s of waiting with a pace limit of 0.4 s"
    why, waited = lost[0]
    assert waited >= 0.4 and "stall_abort_pace / HSGD_STALL_ABORT_PACE = 2 x" in why, lost
    reports = [line for line in capsys.readouterr().err.splitlines() if "hsgd stall: waiting" in line]
    assert reports and "missing: rank 2 (last at step 9)" in reports[0], reports
