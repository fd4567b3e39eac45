"""Two-level averaging of rank-valued tensors against the closed form."""

import pytest
import torch

from hsgd import Topology
from hsgd.hierarchical import HierarchicalAverager
from hsgd.intra_node import Layout

SHAPES = [(17,), (17, 17), (17, 17, 17)]


def tolerance(size, dtype):
    """Exact for sums that need no rounding; else about an ulp or two of the dtype (a float64
    segment reduced in float32 would miss by ~1e-7)."""
    return 0.0 if size <= 3 else (1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.filterwarnings("ignore:inter_node='sharded' needs nodes")
@pytest.mark.parametrize("strategy", ["leader", "sharded"])
@pytest.mark.parametrize("rpn", [1, 2, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_global_mean_is_closed_form(comm, strategy, rpn, dtype):
    with Topology.from_comm(comm, ranks_per_node=rpn) as topo:
        # the other dtype's tensor in between: two segments, interleaved places
        other = torch.float64 if dtype == torch.float32 else torch.float32
        layout = Layout([(dtype, torch.Size(SHAPES[0]).numel()), (other, 1000),
                         *[(dtype, torch.Size(s).numel()) for s in SHAPES[1:]]])
        places = [layout.places[0], *layout.places[2:]]
        with HierarchicalAverager(topo, layout, strategy) as avg:
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


@pytest.mark.parametrize("rpn", [1, 2, 3, None])
def test_node_mean_is_closed_form(comm, rpn):
    with Topology.from_comm(comm, ranks_per_node=rpn) as topo:
        with HierarchicalAverager(topo, Layout([(torch.float64, 1000)])) as avg:
            avg.own(0).fill_(comm.rank)
            avg.average("node")
            first = comm.rank - topo.local_rank
            want = first + (topo.local_size - 1) / 2
            assert torch.all(avg.own(0) == want)


def test_scale_is_applied(comm):
    with Topology.from_comm(comm, ranks_per_node=2) as topo:
        with HierarchicalAverager(topo, Layout([(torch.float64, 33)])) as avg:
            avg.own(0).fill_(2.0 * (comm.rank + 1))
            avg.average("global", scale=0.5)
            assert torch.all(avg.own(0) == (comm.size + 1) / 2)


def test_sharded_falls_back_on_unequal_nodes(comm):
    with Topology.from_comm(comm, ranks_per_node=2) as topo:
        if topo.equal_nodes:
            avg = HierarchicalAverager(topo, Layout([(torch.float32, 5)]), "sharded")
            assert avg.inter_node == "sharded"
        else:
            with pytest.warns(RuntimeWarning, match="falling back"):
                avg = HierarchicalAverager(topo, Layout([(torch.float32, 5)]), "sharded")
            assert avg.inter_node == "leader"
        avg.close()


def test_unsupported_dtype_raises_type_error():
    with pytest.raises(TypeError, match="float32"):
        Layout([(torch.float16, 4)])


def test_use_after_close_raises(comm):
    with Topology.from_comm(comm) as topo:
        avg = HierarchicalAverager(topo, Layout([(torch.float32, 5)]))
        avg.close()
        with pytest.raises(RuntimeError, match="closed"):
            avg.average()
