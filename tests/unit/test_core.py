"""Layer 1: the core's arithmetic and argument checks, in one process (world size 1)."""

import pytest
import torch

from hsgd import HierarchicalLocalSGD, HierarchicalSGD, InputError, SyncMode, Topology
from hsgd.intra_node import Layout, slice_bounds
from hsgd.modes import SYNC_MODES
from hsgd.topology import parse_ranks_per_node


@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 1000, 4913])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_slices_cover_exactly_once(numel, parts):
    bounds = [slice_bounds(numel, parts, i) for i in range(parts)]
    covered = [j for lo, hi in bounds for j in range(lo, hi)]
    assert covered == list(range(numel))
    assert all(lo % 16 == 0 for lo, hi in bounds if hi > lo)


def test_layout_groups_dtypes_and_aligns():
    layout = Layout([(torch.float32, 3), (torch.float64, 5), (torch.float32, 17)])
    assert layout.dtypes == [torch.float32, torch.float64]
    assert layout.places == [(0, 0), (1, 0), (0, 16)]  # float32 tensors aligned to 64 bytes
    assert layout.numels == [16 + 32, 8]
    assert layout.byte_offsets == [0, 4 * 48]
    assert layout.nbytes == 4 * 48 + 64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_layout_rejects_other_dtypes(dtype):
    with pytest.raises(TypeError, match="float32"):
        Layout([(dtype, 4)])


@pytest.mark.parametrize("value,want", [(None, None), ("", None), ("3", 3), (" 2 ", 2), (4, 4)])
def test_ranks_per_node_parsing(value, want):
    assert parse_ranks_per_node(value, "x") == want


@pytest.mark.parametrize("value", [0, -1, "0", "abc", "2.5", 2.5, True])
def test_ranks_per_node_rejects(value):
    with pytest.raises(ValueError, match="HSGD_RANKS_PER_NODE"):
        parse_ranks_per_node(value, "HSGD_RANKS_PER_NODE")


def model_and_opt(mode=HierarchicalSGD, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, mode(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs)


@pytest.mark.parametrize("mode,kwargs,match", [
    (HierarchicalSGD, {"inter_node": "ring"}, "inter_node"),
    (HierarchicalLocalSGD, {"inter_node": "ring"}, "inter_node"),
    (HierarchicalLocalSGD, {"intra_period": 0}, "intra_period"),
    (HierarchicalLocalSGD, {"inter_period": 1.5}, "inter_period"),
    (HierarchicalSGD, {"backward_passes_per_step": 0}, "backward_passes_per_step"),
])
def test_bad_arguments_name_themselves(mode, kwargs, match):
    with pytest.raises(InputError, match=match) as info:
        model_and_opt(mode, **kwargs)
    assert isinstance(info.value, ValueError)


def test_every_mode_is_a_sync_mode_listed_once_by_name():
    from hsgd import AsyncSGD, ElasticSGD, GossipSGD, HierarchicalDiLoCo
    from hsgd._core.settings import Settings
    assert SYNC_MODES == {"sync": HierarchicalSGD, "local": HierarchicalLocalSGD, "diloco": HierarchicalDiLoCo,
                          "elastic": ElasticSGD, "async": AsyncSGD, "gossip": GossipSGD}
    for name, mode in SYNC_MODES.items():
        assert issubclass(mode, SyncMode) and mode.name == name
        assert issubclass(mode.Settings, Settings)  # its settings, and so its trainer flags


def test_optimizer_must_train_the_model():
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a trainable parameter of the model"):
        HierarchicalSGD(torch.optim.SGD(other.parameters(), lr=0.1), model)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        HierarchicalSGD(object(), model)


def test_half_precision_model_gets_type_error():
    model = torch.nn.Linear(2, 2).half()
    with pytest.raises(TypeError, match="float16"):
        HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)


def test_gradients_are_views_into_shared_memory():
    model, opt = model_and_opt()
    window = [opt.averager.own(s) for s in range(len(opt.averager.layout.dtypes))]
    lo = window[0].data_ptr()
    hi = lo + window[0].numel() * window[0].element_size()
    model(torch.ones(3, 4)).sum().backward()
    for p in model.parameters():
        assert lo <= p.grad.data_ptr() < hi
    before = [p.grad.data_ptr() for p in model.parameters()]
    opt.step()
    opt.zero_grad(set_to_none=False)  # zeroed in place: the views stay
    assert [p.grad.data_ptr() for p in model.parameters()] == before
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    opt.zero_grad()  # None, as in torch; the next backward lands in the same memory
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    assert [p.grad.data_ptr() for p in model.parameters()] == before
    opt.close()


def test_parameter_mode_binds_values_and_schedule():
    model, opt = model_and_opt(HierarchicalLocalSGD, intra_period=2, inter_period=3)
    window = opt.averager.own(0)
    lo = window.data_ptr()
    for p in model.parameters():
        assert lo <= p.data_ptr() < lo + window.numel() * window.element_size()
    levels = [opt.averaging_level(t) for t in range(8)]
    assert levels == ["global", None, "node", None, "node", None, "global", None]
    with pytest.raises(RuntimeError, match="HierarchicalLocalSGD has no synchronize"):
        opt.synchronize()
    weight = model.weight.detach().clone()
    opt.close()
    assert torch.equal(model.weight.detach(), weight)


def test_state_dict_round_trip_keeps_step_count():
    model, opt = model_and_opt()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert state["hsgd_steps"] == 1
    model2, opt2 = model_and_opt()
    opt2.load_state_dict(state)
    assert opt2.num_steps == 1
    opt.close()
    opt2.close()


def test_topology_single_process():
    with Topology.from_comm() as topo:
        assert (topo.size, topo.num_nodes, topo.local_size, topo.is_leader) == (1, 1, 1, True)
