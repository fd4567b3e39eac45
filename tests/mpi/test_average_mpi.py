"""Two-level averaging of rank-valued tensors against the closed form.

Collective objects are closed explicitly at the end, not by ``with``: a failed assertion on one
rank must abort the job (conftest.py), not run a collective ``close()`` on that rank alone.
"""

import pytest
import torch

from hsgd import Topology
from hsgd.hierarchical import HierarchicalAverager
from hsgd.intra_node import Layout

SHAPES = [(17,), (17, 17), (17, 17, 17)]


def tolerance(size, dtype):
    """Exact for sums that need no rounding; else about an ulp or two of the dtype. (These
    integer values come out exact even from a float32 reduction of a float64 segment: see
    test_float64_is_averaged_in_float64 for that.)"""
    return 0.0 if size <= 3 else (1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.filterwarnings("ignore:inter_node='sharded' needs nodes")
@pytest.mark.parametrize("strategy", ["leader", "sharded"])
@pytest.mark.parametrize("rpn", [1, 2, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_global_mean_is_closed_form(comm, strategy, rpn, dtype):
    topo = Topology.from_comm(comm, ranks_per_node=rpn)
    # the other dtype's tensor in between: two segments, interleaved places
    other = torch.float64 if dtype == torch.float32 else torch.float32
    layout = Layout([(dtype, torch.Size(SHAPES[0]).numel()), (other, 1000),
                     *[(dtype, torch.Size(s).numel()) for s in SHAPES[1:]]])
    places = [layout.places[0], *layout.places[2:]]
    avg = HierarchicalAverager(topo, layout, strategy)
    seg1, off1 = layout.places[1]
    avg.own(seg1)[off1:off1 + 1000] = float(comm.rank)
    for (seg, off), shape in zip(places, SHAPES):
        n = torch.Size(shape).numel()
        # element j of rank r holds r + j, so a misplaced slice shows
        avg.own(seg)[off:off + n] = comm.rank + torch.arange(n, dtype=dtype)
    avg.average("global")
    assert torch.all(avg.own(seg1)[off1:off1 + 1000] == (comm.size - 1) / 2)
    for (seg, off), shape in zip(places, SHAPES):
        n = torch.Size(shape).numel()
        want = (comm.size - 1) / 2 + torch.arange(n, dtype=dtype)
        tol = tolerance(comm.size, dtype)
        torch.testing.assert_close(avg.own(seg)[off:off + n], want, rtol=tol, atol=tol)
    avg.close()
    topo.close()


@pytest.mark.filterwarnings("ignore:inter_node='sharded' needs nodes")
@pytest.mark.parametrize("strategy", ["leader", "sharded"])
@pytest.mark.parametrize("rpn", [1, 2, None])
def test_float64_is_averaged_in_float64(comm, strategy, rpn):
    """Values float32 cannot hold, (r + 1) / 3 + j * 1e-10 on rank r: the mean must be right to
    float64's precision (a float64 segment reduced in float32 misses by ~1e-8), beside a float32
    segment."""
    topo = Topology.from_comm(comm, ranks_per_node=rpn)
    layout = Layout([(torch.float32, 100), (torch.float64, 1000)])
    avg = HierarchicalAverager(topo, layout, strategy)
    (seg32, off32), (seg64, off64) = layout.places
    j = torch.arange(1000, dtype=torch.float64)
    avg.own(seg32)[off32:off32 + 100] = float(comm.rank)
    avg.own(seg64)[off64:off64 + 1000] = (comm.rank + 1) / 3 + j * 1e-10
    avg.average("global")
    want = torch.stack([(r + 1) / 3 + j * 1e-10 for r in range(comm.size)]).sum(0) / comm.size
    torch.testing.assert_close(avg.own(seg64)[off64:off64 + 1000], want, rtol=1e-14, atol=0)
    assert torch.all(avg.own(seg32)[off32:off32 + 100] == (comm.size - 1) / 2)
    avg.close()
    topo.close()


@pytest.mark.parametrize("rpn", [1, 2, 3, None])
def test_node_mean_is_closed_form(comm, rpn):
    topo = Topology.from_comm(comm, ranks_per_node=rpn)
    avg = HierarchicalAverager(topo, Layout([(torch.float64, 1000)]))
    avg.own(0).fill_(comm.rank)
    avg.average("node")
    first = comm.rank - topo.local_rank
    want = first + (topo.local_size - 1) / 2
    assert torch.all(avg.own(0) == want)
    avg.close()
    topo.close()


def test_scale_is_applied(comm):
    topo = Topology.from_comm(comm, ranks_per_node=2)
    avg = HierarchicalAverager(topo, Layout([(torch.float64, 33)]))
    avg.own(0).fill_(2.0 * (comm.rank + 1))
    avg.average("global", scale=0.5)
    assert torch.all(avg.own(0) == (comm.size + 1) / 2)
    avg.close()
    topo.close()


def test_sharded_falls_back_on_unequal_nodes(comm):
    topo = Topology.from_comm(comm, ranks_per_node=2)
    if topo.equal_nodes:
        avg = HierarchicalAverager(topo, Layout([(torch.float32, 5)]), "sharded")
        assert avg.inter_node == "sharded"
    else:
        with pytest.warns(RuntimeWarning, match="falling back"):
            avg = HierarchicalAverager(topo, Layout([(torch.float32, 5)]), "sharded")
        assert avg.inter_node == "leader"
    avg.close()
    topo.close()


def test_unsupported_dtype_raises_type_error():
    with pytest.raises(TypeError, match="float32"):
        Layout([(torch.float16, 4)])


def test_use_after_close_raises(comm):
    topo = Topology.from_comm(comm)
    avg = HierarchicalAverager(topo, Layout([(torch.float32, 5)]))
    avg.close()
    with pytest.raises(RuntimeError, match="closed"):
        avg.average()
    topo.close()


@pytest.mark.parametrize("rpn", [1, None])
def test_a_new_window_is_zero_even_where_freed_memory_held_nan(comm, rpn):
    """MPI does not zero a new window (MPICH mallocs a one-rank node's); the padding between
    tensors is averaged too, so a reused block's NaN must not survive into the next window."""
    layout = Layout([(torch.float32, 1000), (torch.float32, 3)])  # padding between the two
    with Topology.from_comm(comm, ranks_per_node=rpn) as topo:
        for _ in range(3):
            avg = HierarchicalAverager(topo, layout)
            whole = avg.own(0)
            assert whole.numel() > 1003 and bool((whole == 0).all()), "a new window held garbage"
            whole.fill_(float("nan"))
            avg.close()


@pytest.mark.filterwarnings("ignore:inter_node='sharded' needs nodes")
@pytest.mark.parametrize("strategy", ["leader", "sharded"])
@pytest.mark.parametrize("compression", [None, "bf16"])
def test_a_buffer_larger_than_a_chunk_crosses_in_several_allreduces(comm, monkeypatch, strategy, compression):
    """hsgd.inter_node.CHUNK_BYTES (4 MiB) cut to 200 bytes: 1001 floats (1008 with the segment's
    padding) cross in 21 allreduces of 50, the last of 8 holding element 1000; every element
    gets the same mean as in one allreduce."""
    from hsgd import inter_node

    monkeypatch.setattr(inter_node, "CHUNK_BYTES", 200)
    topo = Topology.from_comm(comm, ranks_per_node=1)  # every rank a node: all of it crosses
    avg = HierarchicalAverager(topo, Layout([(torch.float32, 1001)]), strategy, compression)
    avg.own(0)[:1001] = comm.rank + torch.arange(1001, dtype=torch.float32) / 64
    avg.average("global")
    want = (comm.size - 1) / 2 + torch.arange(1001, dtype=torch.float32) / 64
    tol = 0.0 if compression is None else 2 * comm.size * 2.0 ** -8 * want.abs().max().item()
    torch.testing.assert_close(avg.own(0)[:1001], want, rtol=0, atol=tol)
    avg.close()
    topo.close()
