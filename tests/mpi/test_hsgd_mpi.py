"""HierarchicalSGD under mpiexec: equal to single-process SGD, and safe to misuse.

Collective objects are closed explicitly at the end of a test, not by a ``with`` block: a
failed assertion on one rank must abort the job (tests/mpi/conftest.py), not run a collective
``close()`` on that rank alone and hang.
"""

import pytest
import torch
from _models import LAYOUTS, expected_nodes, fixed_batch, mlp, on, shard
from _sgd import OPTIMIZERS, Branchy, assert_params_close, check_binding, reference, train_shards

from hsgd import HierarchicalLocalSGD, HierarchicalSGD, Topology, broadcast_parameters
from hsgd._core.traffic import allreduce_bytes
from hsgd.replicas import average_buffers

STEPS = 10


def check_strategy(opt, topo, inter_node):
    """The strategy asked for runs (no fallback to 'leader'), across nodes when there are ranks to."""
    assert opt.averager.inter_node == inter_node
    assert topo.num_nodes > 1 or topo.size == 1 or inter_node == "leader"


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("inter_node", ["leader", "sharded"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_equals_single_process(comm, dtype, inter_node, opt_name):
    make_opt = OPTIMIZERS[opt_name]
    model = mlp(dtype, seed=comm.rank)  # different init: the broadcast must fix it
    topo = Topology.from_comm(comm, ranks_per_node=LAYOUTS[inter_node](comm))
    opt = HierarchicalSGD(make_opt(model.parameters()), model, topology=topo, inter_node=inter_node)
    check_strategy(opt, topo, inter_node)
    train_shards(model, opt, comm, dtype)
    assert_params_close(model, reference(dtype, make_opt), dtype)
    opt.close()
    topo.close()


@pytest.mark.parametrize("rpn", [1, 3, None])
def test_equals_single_process_any_layout(comm, rpn, binding):
    model = mlp(device=on(binding))
    make_opt = OPTIMIZERS["momentum_wd"]
    topo = Topology.from_comm(comm, ranks_per_node=rpn)
    opt = HierarchicalSGD(make_opt(model.parameters()), model, topology=topo, zero_copy=binding == "zero_copy")

    def step(_):
        opt.step()
        check_binding(opt, binding)
    # staged gradients: both zeroings
    train_shards(model, opt, comm, zero_grad=lambda i: opt.zero_grad(set_to_none=i % 2 == 0), step=step)
    assert_params_close(model, reference(torch.float64, make_opt, device=on(binding)), torch.float64)
    opt.close()
    topo.close()


def test_clip_between_synchronize_and_step(comm, binding):
    model = mlp(device=on(binding))
    make_opt = OPTIMIZERS["sgd"]
    opt = HierarchicalSGD(make_opt(model.parameters()), model, zero_copy=binding == "zero_copy")

    def step(_):
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            opt.step()
    train_shards(model, opt, comm, step=step)
    check_binding(opt, binding)
    assert_params_close(model, reference(torch.float64, make_opt, clip=0.05, device=on(binding)), torch.float64)
    opt.close()


def test_accumulation_over_micro_batches(comm, binding):
    x, y = fixed_batch(device=on(binding))
    xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
    half = xs.shape[0] // 2
    model = mlp(device=on(binding))
    make_opt = OPTIMIZERS["momentum_wd"]
    opt = HierarchicalSGD(make_opt(model.parameters()), model, backward_passes_per_step=2,
                          zero_copy=binding == "zero_copy")
    for _ in range(STEPS):
        opt.zero_grad()
        for part in (slice(0, half), slice(half, None)):
            torch.nn.functional.cross_entropy(model(xs[part]), ys[part]).backward()
        opt.step()
    check_binding(opt, binding)
    assert_params_close(model, reference(torch.float64, make_opt, device=on(binding)), torch.float64)
    opt.close()


def test_unused_branch_counts_as_zero(comm, binding):
    model = Branchy().to(on(binding))
    x = torch.ones(2, 4, dtype=torch.float64, device=on(binding))
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.0), model, zero_copy=binding == "zero_copy")
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(x, use_branch=comm.rank == 0).backward()
        opt.step()
    check_binding(opt, binding)
    ref = Branchy().to(on(binding))
    ref(x, use_branch=True).backward()
    want = ref.branch.weight.grad / comm.size
    torch.testing.assert_close(model.branch.weight.grad, want)
    opt.close()


@pytest.mark.parametrize("write", ["copy_", "fill_", "add_"])
@pytest.mark.parametrize("path", ["step", "synchronize"])
def test_gradients_written_in_place_are_averaged(comm, write, path):
    """Gradients written into p.grad without backward (as Horovod's tests do) are kept."""
    model = torch.nn.Linear(3, 2).double()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.5), model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad(set_to_none=False)  # zero gradients to write into, not None (torch's default)
    for p in model.parameters():
        value = torch.full_like(p, float(comm.rank + 1))
        getattr(p.grad, write)(value if write != "fill_" else float(comm.rank + 1))
    if path == "synchronize":
        opt.synchronize()
    else:
        opt.step()
    mean = (comm.size + 1) / 2  # mean of 1..size
    for p, old in zip(model.parameters(), before):
        assert p.grad is not None, f"{write} gradient dropped after {path}()"
        torch.testing.assert_close(p.grad, torch.full_like(p, mean), rtol=0, atol=0)
        if path == "step":
            torch.testing.assert_close(p.detach(), old - 0.5 * mean, rtol=0, atol=1e-15)
    opt.close()


def test_zero_grad_sets_none_and_backward_fills_the_slot_without_a_copy(comm, binding):
    """zero_grad() leaves None (torch's default); backward's gradient lands in the slot and
    p.grad is a view of it (zero-copy) or private (staged); a second backward accumulates."""
    x, y = fixed_batch(device=on(binding))
    model = mlp(device=on(binding))
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, zero_copy=binding == "zero_copy")
    bound = opt.engine.binding
    want = mlp(device=on(binding))
    torch.nn.functional.cross_entropy(want(x), y).backward()
    for micro in (1, 2):
        if micro == 1:
            opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for p, view, ref in zip(model.parameters(), bound.views, want.parameters()):
            in_slot = p.grad.data_ptr() == view.data_ptr()
            assert in_slot == (binding == "zero_copy"), f"after backward {micro}, in slot: {in_slot}"
            torch.testing.assert_close(p.grad, micro * ref.grad, rtol=0, atol=1e-15)
    opt.step()  # every rank had the same batch: the average is that gradient
    for p, ref in zip(model.parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, 2 * ref.grad, rtol=0, atol=1e-14)
    opt.close()


def test_autograd_grad_and_create_graph_bypass_the_slot(comm):
    """torch.autograd.grad returns private tensors and leaves p.grad alone; a backward with
    create_graph=True keeps its graph (the slot hook stands aside); both still average."""
    x, y = fixed_batch()
    model = mlp()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    opt.zero_grad()
    params = list(model.parameters())
    grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
    slot = opt.engine.binding.views
    assert all(p.grad is None for p in params)
    assert all(g.data_ptr() != v.data_ptr() for g, v in zip(grads, slot))
    torch.nn.functional.cross_entropy(model(x), y).backward(create_graph=True)
    assert all(p.grad.requires_grad for p in params), "create_graph=True lost the gradients' graph"
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad.detach(), g, rtol=0, atol=1e-15)
    opt.step()
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-14)  # same batch on every rank
    opt.close()


def test_model_replaced_grads_are_picked_up(comm, binding):
    """A user zeroing through the model (set_to_none) must not lose gradients."""
    model = mlp(device=on(binding))
    make_opt = OPTIMIZERS["sgd"]
    opt = HierarchicalSGD(make_opt(model.parameters()), model, zero_copy=binding == "zero_copy")
    train_shards(model, opt, comm, zero_grad=lambda _: model.zero_grad(set_to_none=True))
    check_binding(opt, binding)
    assert_params_close(model, reference(torch.float64, make_opt, device=on(binding)), torch.float64)
    opt.close()


@pytest.mark.parametrize("culprit", ["shape", "count", "dtype"])
def test_mismatched_models_raise_on_every_rank(comm, culprit):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    model = mlp()
    if comm.rank == comm.size - 1:
        if culprit == "shape":
            model = mlp(hidden=17)
        elif culprit == "count":
            model.append(torch.nn.Linear(3, 3).double())
        else:
            model = mlp(dtype=torch.float32)
    with pytest.raises(ValueError, match="differs between ranks"):
        HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)


def test_different_settings_raise_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    model = mlp()
    with pytest.raises(ValueError, match="different HierarchicalSGD settings"):
        HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model,
                        inter_node="leader" if comm.rank else "sharded")


def test_bad_argument_on_one_rank_raises_everywhere(comm):
    model = mlp()
    period = 0 if comm.rank == 0 else 1
    with pytest.raises(ValueError, match="intra_period"):
        HierarchicalLocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model,
                             intra_period=period)


@pytest.mark.parametrize("intra,inter", [(1, 1), (2, 3), (3, 1)])
def test_parameter_averaging_fires_at_expected_steps(comm, intra, inter):
    """Rank r's gradient is r + 1; simulate every rank's scalar in plain floats."""
    topo = Topology.from_comm(comm, ranks_per_node=2)
    nodes = expected_nodes(comm, 2)
    model = torch.nn.Linear(1, 1, bias=False).double()
    opt = HierarchicalLocalSGD(torch.optim.SGD(model.parameters(), lr=1.0), model,
                               topology=topo, intra_period=intra, inter_period=inter)
    sim = [model.weight.item()] * comm.size
    for t in range(13):
        opt.zero_grad()
        model.weight.grad = torch.full_like(model.weight, comm.rank + 1.0)
        opt.step()
        sim = [w - (r + 1.0) for r, w in enumerate(sim)]
        if t % (intra * inter) == 0:
            sim = [sum(sim) / len(sim)] * len(sim)
        elif t % intra == 0:
            for node in nodes:
                mean = sum(sim[r] for r in node) / len(node)
                for r in node:
                    sim[r] = mean
        assert model.weight.item() == pytest.approx(sim[comm.rank], rel=1e-12), t
    opt.close()
    topo.close()


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta",
                                  "Adamax", "NAdam", "RAdam", "ASGD", "Rprop"])
def test_state_broadcast_after_rank0_loads(comm, name):
    model = mlp()
    kwargs = {"lr": 0.01}
    if name == "SGD":
        kwargs["momentum"] = 0.9
    opt = HierarchicalSGD(getattr(torch.optim, name)(model.parameters(), **kwargs), model)
    if comm.rank == 0:  # rank 0 alone loads a checkpoint with state and a changed lr
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.optimizer.step()
        opt.param_groups[0]["lr"] = 0.123
        opt.num_steps = 7
        opt.load_state_dict(opt.state_dict())
    opt.broadcast_state()
    broadcast_parameters(model, comm)
    states = comm.allgather(opt.state_dict())
    ref, mine = states[0]["state"], opt.state_dict()["state"]
    assert opt.param_groups[0]["lr"] == 0.123 and opt.num_steps == 7
    # rank 0 stepped once: every parameter has state (else the comparison below compares nothing)
    assert len(ref) == len(list(model.parameters())) and all(ref.values())
    assert mine.keys() == ref.keys()
    for key, value in ref.items():
        assert mine[key].keys() == value.keys()
        for k, v in value.items():
            torch.testing.assert_close(torch.as_tensor(mine[key][k]), torch.as_tensor(v), rtol=0, atol=0)
    opt.close()


def test_close_keeps_values_and_use_after_close_raises(comm):
    x, y = fixed_batch()
    model = mlp()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(shard(x, comm.rank, comm.size)),
                                      shard(y, comm.rank, comm.size)).backward()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.close()
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
        p.grad.add_(1.0)  # private storage now: writable without touching freed memory
    for call in (opt.step, opt.zero_grad, opt.synchronize):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    opt.close()  # idempotent



def test_parameter_no_rank_used_is_left_alone(comm, binding):
    model = Branchy().to(on(binding))
    x = torch.ones(2, 4, dtype=torch.float64, device=on(binding))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    before = model.branch.weight.detach().clone()
    opt = HierarchicalSGD(inner, model, zero_copy=binding == "zero_copy")
    for _ in range(3):
        opt.zero_grad()
        model(x, use_branch=False).backward()
        opt.step()
        assert model.branch.weight.grad is None and model.trunk.weight.grad is not None
    assert torch.equal(model.branch.weight.detach(), before)
    opt.zero_grad()
    model(x, use_branch=True).backward()  # used again: back to a shared-memory view (or staged)
    opt.step()
    check_binding(opt, binding)
    assert model.branch.weight.grad is not None
    assert not torch.equal(model.branch.weight.detach(), before)
    opt.close()


def test_buffer_mismatch_raises_instead_of_hanging(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    model = mlp()
    size = 5 if comm.rank == comm.size - 1 else 4
    model.register_buffer("table", torch.zeros(size))
    with pytest.raises(ValueError, match="'table'"):
        HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)


def test_synchronize_twice_averages_once(comm):
    model = mlp()
    x, y = fixed_batch()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, backward_passes_per_step=2)
    torch.nn.functional.cross_entropy(model(shard(x, comm.rank, comm.size)),
                                      shard(y, comm.rank, comm.size)).backward()
    opt.synchronize()
    once = [p.grad.clone() for p in model.parameters()]
    opt.synchronize()
    grads = [p.grad for p in model.parameters()]
    assert len(grads) == len(once) and all(torch.equal(g, o) for g, o in zip(grads, once))
    opt.close()


def local_sgd_reference(node_sizes, rank, make_opt, steps, intra, inter, device="cpu"):
    """Every rank's replica in one process: each steps on its own shard, then the replicas of each
    node (virtual nodes: consecutive ranks) or of all ranks are replaced by their mean parameters
    on HierarchicalLocalSGD's schedule. Returns rank ``rank``'s parameters."""
    size = sum(node_sizes)
    x, y = fixed_batch(device=device)
    models = [mlp(device=device) for _ in range(size)]
    opts = [make_opt(m.parameters()) for m in models]
    starts = [sum(node_sizes[:i]) for i in range(len(node_sizes))]
    nodes = [list(range(a, a + n)) for a, n in zip(starts, node_sizes)]
    for t in range(steps):
        for r, (model, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(shard(x, r, size)), shard(y, r, size)).backward()
            opt.step()
        groups = [list(range(size))] if t % (intra * inter) == 0 else nodes if t % intra == 0 else []
        with torch.no_grad():
            for group in groups:
                for replicas in zip(*(models[r].parameters() for r in group)):
                    mean = torch.stack(replicas).mean(0)
                    for p in replicas:
                        p.copy_(mean)
    return [p.detach().clone() for p in models[rank].parameters()]


@pytest.mark.parametrize("inter_node", ["leader", "sharded"])
def test_local_sgd_equals_a_one_process_simulation(comm, inter_node, binding):
    topo = Topology.from_comm(comm, ranks_per_node=LAYOUTS[inter_node](comm))
    model = mlp(seed=comm.rank, device=on(binding))  # different init: the broadcast must fix it
    make_opt = OPTIMIZERS["momentum_wd"]  # momentum stays each rank's own
    opt = HierarchicalLocalSGD(make_opt(model.parameters()), model, topology=topo, inter_node=inter_node,
                               intra_period=2, inter_period=2,  # global on 0 and 4, node on 2 and 6
                               zero_copy=binding == "zero_copy")
    check_strategy(opt, topo, inter_node)
    x, y = fixed_batch(device=on(binding))
    for _ in range(7):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(shard(x, comm.rank, comm.size)),
                                          shard(y, comm.rank, comm.size)).backward()
        opt.step()
    check_binding(opt, binding)
    want = local_sgd_reference(list(topo.node_sizes), comm.rank, make_opt, 7, 2, 2, device=on(binding))
    assert_params_close(model, want, torch.float64)
    opt.close()
    topo.close()


def _traffic_of(make_opt, model, topo, steps):
    """Sum over all ranks of the bytes counted during ``steps`` steps, and this rank's own."""
    x = torch.ones(2, model.in_features, dtype=torch.float64)
    opt = make_opt(topo)
    assert opt.traffic == {"intra_bytes": 0, "inter_bytes": 0}
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    mine = opt.traffic
    opt.close()
    return {k: topo.comm.allreduce(v) for k, v in mine.items()}, mine


@pytest.mark.parametrize("inter_node", ["leader", "sharded"])
def test_traffic_counters_match_the_closed_form(comm, inter_node):
    """4 ranks as 2 nodes of 2: across nodes, each step is one 2-party allreduce of the
    buffer per node (n bytes sent by each node); inside a node, reduce + spread copy n."""
    if comm.size != 4:
        pytest.skip("closed form written for 4 ranks as 2 virtual nodes")
    # Every tensor starts on a 64-byte line: weight 32 x 8 x 8 B = 2048, bias 64, and the two
    # float32 "used" flags of gradient averaging take one line of 64.
    model = torch.nn.Linear(32, 8).double()
    n = 2048 + 64 + 64
    topo = Topology.from_comm(comm, ranks_per_node=2)
    total, mine = _traffic_of(lambda t: HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1),
                                                        model, topology=t, inter_node=inter_node),
                              model, topo, steps=3)
    assert total == {"inter_bytes": 3 * 2 * n, "intra_bytes": 3 * 2 * 2 * n}, total
    if inter_node == "leader":
        assert mine["inter_bytes"] == (3 * n if topo.is_leader else 0)
    m = 2048 + 64  # local SGD averages the values only, no flags
    total, _ = _traffic_of(lambda t: HierarchicalLocalSGD(
        torch.optim.SGD(model.parameters(), lr=0.1), model, topology=t, inter_node=inter_node,
        intra_period=1, inter_period=2), model, topo, steps=4)  # global on 0 and 2, node on 1 and 3
    assert total == {"inter_bytes": 2 * 2 * m, "intra_bytes": 4 * 2 * 2 * m}, total
    topo.close()


def test_without_virtual_nodes_the_hosts_are_the_nodes(comm):
    """One host sends nothing across nodes; on several hosts (tests/hosts) each step is one
    allreduce among the hosts' leaders, and each host averages inside itself."""
    model = torch.nn.Linear(8, 8).double()
    n = 512 + 64 + 64  # weight, bias, used flags (each on its own 64-byte line)
    topo = Topology.from_comm(comm)
    nodes = expected_nodes(comm, None)
    assert [list(topo.node_sizes), list(topo.node_ranks)] == [[len(r) for r in nodes],
                                                             next(r for r in nodes if comm.rank in r)]
    total, _ = _traffic_of(lambda t: HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1),
                                                     model, topology=t), model, topo, steps=2)
    topo.close()
    intra = 2 * sum(2 * (len(ranks) - 1) * n for ranks in nodes)
    inter = 2 * len(nodes) * allreduce_bytes(n, len(nodes))
    assert total == {"inter_bytes": inter, "intra_bytes": intra}, (total, nodes)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_uneven_batches_weighted_by_size_equal_single_process(comm, opt_name):
    """Load balancing's averaging: rank r takes a batch of its own size (not equal); with
    those batch_shares the training equals the global batch on one process (2 virtual nodes)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = fixed_batch(torch.float64)
    shares = [2 * (r + 1) for r in range(size)]  # uneven, summing to less than the batch
    shares[-1] += x.shape[0] - sum(shares)  # the global batch unchanged
    first = sum(shares[:rank])
    mine_x, mine_y = x[first:first + shares[rank]], y[first:first + shares[rank]]
    model = mlp(torch.float64)
    topo = Topology.from_comm(comm, ranks_per_node=2)
    opt = HierarchicalSGD(OPTIMIZERS[opt_name](model.parameters()), model, topology=topo)
    opt.batch_shares = shares
    assert opt.batch_shares == shares
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(mine_x), mine_y).backward()
        opt.step()
    assert_params_close(model, reference(torch.float64, OPTIMIZERS[opt_name]), torch.float64)
    opt.close()
    topo.close()


def test_local_sgd_averages_weight_ranks_by_batch_shares(comm):
    """Rank r's gradient is r + 1 and its share r + 1: node and global averages are weighted."""
    size = comm.Get_size()
    topo = Topology.from_comm(comm, ranks_per_node=2)
    nodes = [list(range(s, min(s + 2, size))) for s in range(0, size, 2)]
    shares = [r + 1 for r in range(size)]
    model = torch.nn.Linear(1, 1, bias=False).double()
    opt = HierarchicalLocalSGD(torch.optim.SGD(model.parameters(), lr=1.0), model, topology=topo,
                               intra_period=2, inter_period=3)
    opt.batch_shares = shares
    sim = [model.weight.item()] * size
    for t in range(13):
        opt.zero_grad()
        model.weight.grad = torch.full_like(model.weight, comm.rank + 1.0)
        opt.step()
        sim = [w - (r + 1.0) for r, w in enumerate(sim)]
        groups = [list(range(size))] if t % 6 == 0 else nodes if t % 2 == 0 else []
        for group in groups:
            mean = sum(shares[r] * sim[r] for r in group) / sum(shares[r] for r in group)
            for r in group:
                sim[r] = mean
        assert model.weight.item() == pytest.approx(sim[comm.rank], rel=1e-12), t
    opt.batch_shares = None  # equal again
    assert opt.batch_shares is None and opt.step_weight("global") == 1.0
    opt.close()
    topo.close()


def test_batch_shares_are_checked(comm):
    size = comm.Get_size()
    model = mlp(torch.float64)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for bad in ([0] * size, [-1] * size, [1] * (size + 1), [True] * size, [1.5] * size, "1" * size):
        with pytest.raises(ValueError, match="batch shares"):
            opt.batch_shares = bad
    opt.close()


def test_gradients_finite_is_the_same_on_every_rank(comm):
    """A NaN on one rank's gradient makes the average non-finite everywhere: every rank skips."""
    model = mlp(torch.float64)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x, y = fixed_batch(torch.float64)
    for poison in (None, float("nan"), float("inf")):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(RuntimeError, match="before synchronize"):
            opt.gradients_finite()
        if poison is not None and comm.Get_rank() == comm.Get_size() - 1:
            next(model.parameters()).grad[0, 0] = poison
        opt.synchronize()
        finite = opt.gradients_finite()
        assert finite == (poison is None)
        assert comm.allgather(finite) == [finite] * comm.Get_size()
    opt.close()


def test_batchnorm_running_statistics_are_averaged(comm):
    """Each rank's BatchNorm running statistics come from its own batches (gradient averaging
    leaves them apart): average_buffers, and the mode's shared_state_dict (what a checkpoint
    holds), give every rank their mean over ranks; the batch counter is rank 0's."""
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4)).double()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x, _ = fixed_batch()
    for _ in range(rank + 1):  # rank r sees r + 1 batches, scaled by r + 1: every statistic differs
        model(shard(x, rank, size) * (rank + 1))
    stats = ("running_mean", "running_var")
    every = comm.allgather({k: getattr(model[1], k).clone() for k in stats})
    if size > 1:
        assert not torch.equal(every[0]["running_var"], every[-1]["running_var"])
    want = {k: torch.stack([e[k] for e in every]).mean(0) for k in stats}
    shared = opt.shared_state_dict()
    average_buffers(model, comm)
    for k in stats:
        torch.testing.assert_close(getattr(model[1], k), want[k], rtol=1e-12, atol=0)
        torch.testing.assert_close(shared[f"1.{k}"], want[k], rtol=1e-12, atol=0)
    assert model[1].num_batches_tracked.item() == shared["1.num_batches_tracked"].item() == 1
    opt.close()
