"""hsgd._engine.staging: which staged tensors cross together, and which element ranges a
bucket's gather copies (never a member outside the bucket). The GPU copies themselves run in
the cuda variants of tests/mpi (they skip without a GPU)."""

import torch

from hsgd._engine.staging import Staging, _Run, _runs, _stretches


def slot(segments):
    """A slot of segments of the given lengths (-1 everywhere), and its ``own``."""
    segs = [torch.full((n,), -1.0) for n in segments]
    return segs, (lambda seg: segs[seg])


def test_runs_break_at_unstaged_tensors_and_segment_changes():
    tensors = [torch.ones(3), torch.ones(2), torch.ones(4), torch.ones(1), torch.ones(2)]
    places = [(0, 0), (0, 4), (0, 8), (1, 0), (1, 4)]  # padded to 4 elements
    _, own = slot([16, 8])
    runs = _runs(places, tensors, [True, True, False, True, True], own)
    assert [r.members for r in runs] == [[0, 1], [3, 4]]
    assert [r.starts for r in runs] == [[0, 4], [0, 4]]
    assert [r.host.numel() for r in runs] == [6, 6]  # up to the last member's end, padding between


def test_a_bucket_copies_only_its_own_stretches():
    run = _Run(members=[0, 1, 2, 3], starts=[0, 4, 8, 12], numels=[3, 4, 2, 1],
               host=torch.zeros(13), device_buffer=torch.zeros(13))
    assert list(_stretches(run, None)) == [(0, 13)]
    assert list(_stretches(run, {1, 2})) == [(4, 10)]
    assert list(_stretches(run, {0, 2, 3})) == [(0, 3), (8, 13)]
    assert list(_stretches(run, {3})) == [(12, 13)]


def test_cpu_runs_write_straight_into_the_slot_and_read_back_from_it():
    tensors = [torch.ones(3), torch.ones(2, 2)]
    places = [(0, 0), (0, 4)]
    segs, own = slot([8])
    staging = Staging(places, tensors, [True, True], own)
    assert staging.pinned is None and staging.runs[0].device_buffer is staging.runs[0].host
    staging.gather({0: torch.full((3,), 2.0), 1: None})
    assert segs[0].tolist() == [2.0, 2.0, 2.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    segs[0][4:8] = 5.0  # "the average"
    staging.scatter()
    assert torch.equal(staging.device_view(1), torch.full((2, 2), 5.0))
    staging.close()
