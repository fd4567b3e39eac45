"""DiLoCo's outer step in HierarchicalLocalSGD under mpiexec: every rank's parameters equal a
one-process float64 simulation of every replica (outer Nesterov, streaming fragments, their
delay and mixing), an outer SGD(lr=1) is plain local SGD, a resumed run ends where an
unstopped one does, and bad arguments are refused on every rank alike."""

import copy
import warnings

import pytest
import torch
from _models import LAYOUTS, mlp
from _quantized import Int8Simulation
from mpi4py import MPI

from hsgd import HierarchicalDiLoCo, HierarchicalLocalSGD, InputError, Topology
from hsgd.compression import Int4, PowerSGD
from hsgd.hierarchical.outer import fragment_groups
from hsgd.inter_node import CHUNK_BYTES
from hsgd.intra_node import Layout

PER_RANK = 6  # samples per rank and step
NESTEROV = (0.7, 0.9, True)  # DiLoCo's outer lr, momentum, Nesterov


def batch(step, rank, dtype=torch.float64):
    """Rank ``rank``'s batch at ``step``: different on every rank and step, the same in the simulation."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(PER_RANK, 8, generator=gen, dtype=dtype), torch.randint(0, 3, (PER_RANK,), generator=gen)


def inner(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)


def outer_sgd(lr, momentum, nesterov):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)


def local_step(model, opt, step, rank):
    x, y = batch(step, rank)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def simulate(nodes, steps, H, B, outer=None, fragments=1, delay=0, alpha=0.0, levels=None):
    """Every replica of a run on one process: ``nodes[r]`` is rank r's node; ``outer``:
    ``(lr, momentum, nesterov)`` or ``None`` (plain local SGD); ``levels``: the pseudo-gradients'
    node sums cross nodes as int8 (127) or int4 (7) with error feedback, one state per fragment.
    Returns each rank's parameters."""
    size, period = len(nodes), H * B
    models = [mlp() for _ in range(size)]
    opts = [inner(m.parameters()) for m in models]
    params = [list(m.parameters()) for m in models]
    n = len(params[0])
    anchor = [torch.nn.Parameter(p.detach().clone()) for p in params[0]]
    groups = fragment_groups([p.numel() for p in params[0]], fragments)
    members = [[r for r in range(size) if nodes[r] == node] for node in sorted(set(nodes))]
    lay = Layout([(p.dtype, p.numel()) for p in params[0]], [p.shape for p in params[0]])
    bits = 8 if levels == 127 else 4
    sims = [Int8Simulation(lay, lay.places[a][1], lay.places[b - 1][1] + lay.sizes[b - 1], 256,
                           CHUNK_BYTES // (4 + 256 * bits // 8), len(members), levels, torch.float64,
                           tensor_blocks=False)
            for a, b in groups] if levels and len(members) > 1 else None

    def pseudo_gradient(f):
        a, b = groups[f]
        if sims is None:
            return [anchor[i].detach() - mean(i, range(size)) for i in range(a, b)]
        sums = []  # each node's Δ summed in local-rank order (in shared memory), every entry
        for ranks in members:
            total = [torch.zeros(p.numel(), dtype=p.dtype) for p in params[0]]
            for r in ranks:
                for i in range(a, b):
                    total[i] += (anchor[i].detach() - params[r][i].detach()).view(-1)
            sums.append(total)
        got = sims[f].run(sums)
        return [(got[i] * (1.0 / size)).view_as(anchor[i]) for i in range(a, b)]
    outers = [outer_sgd(*outer)(anchor[a:b]) for a, b in groups] if outer else []
    offsets = [f * period // fragments for f in range(fragments)]
    in_flight = {}

    def mean(i, ranks):
        return torch.stack([params[r][i].detach() for r in ranks]).mean(0)

    def merge(f, delta):
        a, b = groups[f]
        for i in range(a, b):
            anchor[i].grad = delta[i - a]
        outers[f].step()
        with torch.no_grad():
            for r in range(size):
                for i in range(a, b):
                    params[r][i].mul_(alpha).add_(anchor[i].detach(), alpha=1 - alpha)

    for t in range(steps):
        for r in range(size):
            local_step(models[r], opts[r], t, r)
        level = "global" if t % period == 0 else "node" if t % H == 0 else None
        if outer and level == "global":
            level = None if (fragments == 1 and delay == 0 and alpha == 0) else "node"
        with torch.no_grad():
            for i in range(n) if level else ():
                groups_of_ranks = [list(range(size))] if level == "global" else \
                    [[r for r in range(size) if nodes[r] == node] for node in set(nodes)]
                for ranks in groups_of_ranks:
                    value = mean(i, ranks)
                    for r in ranks:
                        params[r][i].copy_(value)
        if not outer:
            continue
        for f in sorted(f for f, (start, _) in in_flight.items() if start + delay == t):
            merge(f, in_flight.pop(f)[1])
        for f in range(fragments):
            if t >= offsets[f] and (t - offsets[f]) % period == 0:
                delta = pseudo_gradient(f)
                if delay == 0:
                    merge(f, delta)
                else:
                    in_flight[f] = (t, delta)
    return [[p.detach() for p in ps] for ps in params]


def run(comm, steps, H, B, layout="leader", **kwargs):
    """This rank's parameters after ``steps`` steps of the real thing, and the nodes of all ranks."""
    topo = Topology.from_comm(comm, ranks_per_node=LAYOUTS[layout](comm))
    model = mlp(seed=comm.rank)  # the broadcast makes them equal
    cls = HierarchicalDiLoCo if "outer_lr" in kwargs else HierarchicalLocalSGD
    opt = cls(inner(model.parameters()), model, topology=topo, intra_period=H, inter_period=B,
              inter_node=layout, **kwargs)
    for t in range(steps):
        local_step(model, opt, t, comm.rank)
    nodes = comm.allgather(topo.node_index)
    opt.close()
    topo.close()
    return [p.detach().clone() for p in model.parameters()], nodes


def assert_close(mine, want, tol):
    for got, expected in zip(mine, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=tol)


def test_an_outer_sgd_of_lr_1_is_plain_local_sgd(comm):
    plain, _ = run(comm, 13, 2, 3)
    outer, _ = run(comm, 13, 2, 3, outer_optimizer=outer_sgd(1.0, 0.0, False))
    assert_close(outer, plain, 1e-12)


@pytest.mark.parametrize("layout", ["leader", "sharded"])
def test_nesterov_outer_step_matches_the_simulation_of_every_replica(comm, layout):
    mine, nodes = run(comm, 16, 2, 3, layout, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True)
    want = simulate(nodes, 16, 2, 3, outer=NESTEROV)[comm.rank]
    assert_close(mine, want, 1e-10)
    plain = simulate(nodes, 16, 2, 3)[comm.rank]
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(mine, plain)), "the outer step changed nothing"


@pytest.mark.parametrize("fragments,delay,alpha", [(2, 0, 0.0), (3, 2, 0.5), (4, 1, 0.0)])
def test_streaming_fragments_delay_and_alpha_match_the_simulation(comm, fragments, delay, alpha):
    kwargs = dict(outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True, fragments=fragments,
                  fragment_sync_delay=delay, fragment_update_alpha=alpha)
    mine, nodes = run(comm, 20, 2, 3, **kwargs)
    want = simulate(nodes, 20, 2, 3, outer=NESTEROV, fragments=fragments, delay=delay, alpha=alpha)[comm.rank]
    assert_close(mine, want, 1e-10)


@pytest.mark.parametrize("compression,fragments,delay,alpha", [
    ("int8", 1, 0, 0.0), ("int8", 2, 1, 0.5),
    (Int4(), 4, 2, 0.0),  # offsets 0, 1, 3, 4 of period 6, delay 2: two fragments in flight at once
], ids=["int8", "int8-streaming", "int4-streaming-overlapping"])
def test_compressed_outer_step_matches_the_simulation_with_error_feedback(comm, compression, fragments, delay,
                                                                           alpha):
    """The pseudo-gradients' node sums cross nodes of 2 ranks in 8 or 4 bits, about 3 outer
    rounds per fragment: the error feedback of each fragment carries over its rounds."""
    kwargs = dict(outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True, fragments=fragments,
                  fragment_sync_delay=delay, fragment_update_alpha=alpha, outer_compression=compression)
    mine, nodes = run(comm, 20, 2, 3, **kwargs)
    levels = 7 if isinstance(compression, Int4) else 127
    sims = [simulate(nodes, 20, 2, 3, outer=NESTEROV, fragments=fragments, delay=delay, alpha=alpha, levels=lv)
            for lv in (levels, None)]
    assert_close(mine, sims[0][comm.rank], 1e-10)
    if len(set(nodes)) > 1:  # else nothing crosses nodes, nothing is compressed
        assert any((a - b).abs().max() > 1e-6 for a, b in zip(mine, sims[1][comm.rank])), "compressed nothing"


def _run_saving_at_step_9(model, opt, comm):
    """Steps 0-19, the state saved after step 9 with a fragment in flight; closes ``opt``.
    Returns the saved state and the final parameters."""
    for t in range(20):
        local_step(model, opt, t, comm.rank)
        if t == 9:
            assert opt.engine.outer.in_flight, "no fragment in flight at the stop"
            # a deep copy, as torch.save makes: a state dict holds the live momentum buffers
            saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    unstopped = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return saved, unstopped


def test_a_compressed_fragment_in_flight_resumes_exactly(comm):
    """As below, with every rank its own node and the pseudo-gradients in int8: the error
    feedback is in the rank's state, and the fragment in flight at the stop is sent again
    through it as it was. Loaded on another node layout, it starts afresh, and rank 0 says so."""
    kwargs = dict(intra_period=2, inter_period=3, fragments=2, fragment_sync_delay=2, outer_compression="int8")

    def build(ranks_per_node=1):
        model = mlp()
        topo = Topology.from_comm(comm, ranks_per_node=ranks_per_node)
        return model, HierarchicalDiLoCo(inner(model.parameters()), model, topology=topo, **kwargs), topo

    model, opt, topo = build()
    saved, unstopped = _run_saving_at_step_9(model, opt, comm)
    errors = saved["opt"]["hsgd_outer_codec"]["state"]["parts"]
    assert comm.size == 1 or any(e["error"].abs().max() > 0 for e in errors.values()), "no error feedback saved"
    for ranks_per_node, warns in ((1, False), (2, comm.size > 1)):
        model, opt, topo2 = build(ranks_per_node)
        loaded = copy.deepcopy(saved)  # as torch.load gives: a loaded state's buffers step on with the run
        model.load_state_dict(loaded["model"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.load_state_dict(loaded["opt"])
        said = any("starts afresh" in str(w.message) for w in caught)
        assert said == (warns and comm.rank == 0), [str(w.message) for w in caught]
        if not warns:
            for t in range(10, 20):
                local_step(model, opt, t, comm.rank)
            assert_close([p.detach() for p in model.parameters()], unstopped, 0.0)
        opt.close()
        topo2.close()
    topo.close()


def test_a_resumed_run_ends_where_an_unstopped_one_does(comm):
    """Stopped after step 8 with fragment 1 in flight (period 6, 2 fragments: fragment 1 syncs
    after step 3 and 9; delay 2: after step 9 it is in flight until 11), resumed from the
    model and optimizer state."""
    kwargs = dict(intra_period=2, inter_period=3, fragments=2, fragment_sync_delay=2, fragment_update_alpha=0.25)

    def build():
        model = mlp()
        return model, HierarchicalDiLoCo(inner(model.parameters()), model, **kwargs)

    model, opt = build()
    saved, unstopped = _run_saving_at_step_9(model, opt, comm)
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    for t in range(10, 20):
        local_step(model, opt, t, comm.rank)
    assert_close([p.detach() for p in model.parameters()], unstopped, 0.0)
    opt.close()


def test_a_fragment_in_flight_resumed_on_fewer_ranks_merges_as_on_all(comm):
    """Stopped after step 9 with fragment 1 in flight (as above), every rank's state merged
    (``merge_state_dicts``) and loaded on the first ``size - 1`` ranks: its merge after step 11
    takes the outer step on the old ranks' mean, so ``θ_g`` of fragment 1 is the unstopped run's."""
    if comm.size < 2:
        pytest.skip("resumes on fewer ranks: needs two or more")
    kwargs = dict(intra_period=2, inter_period=3, fragments=2, fragment_sync_delay=2)

    def build(topology=None):
        model = mlp()
        return model, HierarchicalDiLoCo(inner(model.parameters()), model, topology=topology, **kwargs)

    model, opt = build()
    for t in range(12):
        local_step(model, opt, t, comm.rank)
        if t == 9:
            states = comm.allgather(copy.deepcopy(opt.state_dict()))
    a, b = opt.engine.outer.groups[1]
    unstopped = [p.detach().clone() for p in opt.engine.outer.anchor[a:b]]
    before = [p.detach().clone() for p in states[0]["hsgd_outer"]["anchor"][a:b]]
    opt.close()
    fewer = comm.Split(0 if comm.rank < comm.size - 1 else MPI.UNDEFINED, comm.rank)
    if fewer != MPI.COMM_NULL:
        topo = Topology.from_comm(fewer)
        model, opt = build(topo)
        opt.load_state_dict(opt.merge_state_dicts(states, fewer.Get_size()))
        for t in range(10, 12):
            local_step(model, opt, t, fewer.Get_rank())
        resumed = [p.detach().clone() for p in opt.engine.outer.anchor[a:b]]
        opt.close()
        topo.close()
        fewer.Free()
        assert_close(resumed, unstopped, 1e-12)
        assert any((x - y).abs().max() > 1e-6 for x, y in zip(unstopped, before)), "no outer step was taken"


def test_each_fragment_sends_its_share_of_the_bytes(comm):
    """Peak inter-node bytes per step: the whole model with one fragment, about 1/F with F.
    The pseudo-gradients (float32) in int8: at least 3.9x fewer bytes in all, scales included;
    in int4 at least 7.5x."""
    topo = Topology.from_comm(comm, ranks_per_node=2)
    if topo.num_nodes == 1:
        topo.close()
        pytest.skip("needs two nodes")
    peaks, totals = {}, {}
    for fragments, compression in ((1, "none"), (2, "none"), (1, "int8"), (1, "int4")):
        model = torch.nn.Sequential(*(torch.nn.Linear(32, 32, bias=False) for _ in range(4)))
        opt = HierarchicalDiLoCo(torch.optim.SGD(model.parameters(), lr=0.01), model, topology=topo,
                                 intra_period=1, inter_period=4, fragments=fragments,
                                 outer_compression=compression)
        sent = []
        for _ in range(8):
            before = opt.traffic["inter_bytes"]
            opt.zero_grad()
            model(torch.randn(2, 32)).sum().backward()
            opt.step()
            sent.append(opt.traffic["inter_bytes"] - before)
        peaks[fragments, compression] = comm.allreduce(max(sent), op=MPI.MAX)
        totals[compression] = comm.allreduce(sum(sent))
        opt.close()
    topo.close()
    assert peaks[1, "none"] > 0
    assert peaks[2, "none"] <= 0.55 * peaks[1, "none"], peaks
    assert 0 < totals["int8"] * 3.9 <= totals["none"] and 0 < totals["int4"] * 7.5 <= totals["none"], totals


@pytest.mark.parametrize("kwargs,match", [
    (dict(fragments=2), "outer_optimizer"),
    (dict(outer_optimizer=outer_sgd(1.0, 0.0, False), fragment_sync_delay=6), "below the global period"),
    (dict(outer_optimizer=outer_sgd(1.0, 0.0, False), fragment_update_alpha=1.5), "fragment_update_alpha"),
    (dict(outer_optimizer=outer_sgd(1.0, 0.0, False), fragments=5), "fragments <= 4"),
    (dict(outer_optimizer=lambda params: "sgd"), "not a torch.optim.Optimizer"),
    (dict(outer_optimizer=lambda params: torch.optim.SGD(params, lr=-1)), "outer_optimizer"),
    (dict(outer_optimizer=0.7), "callable"),
])
def test_bad_arguments_are_refused_on_every_rank(comm, kwargs, match):
    model = mlp()
    with pytest.raises((ValueError, TypeError), match=match):
        HierarchicalLocalSGD(inner(model.parameters()), model, intra_period=2, inter_period=3, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(outer_compression="int2"), "outer_compression"), (dict(outer_compression=Int4(block=3)), "even"),
    (dict(outer_compression=PowerSGD(rank=2)), "not powersgd"),
    (dict(compression="int8"), "pass outer_compression='int8' instead"),
])
def test_bad_outer_compressions_are_one_error_on_every_rank(comm, kwargs, match):
    model = mlp()
    with pytest.raises(InputError, match=match) as raised:
        HierarchicalDiLoCo(inner(model.parameters()), model, **kwargs)
    assert len(set(comm.allgather(str(raised.value)))) == 1
    with pytest.raises(InputError, match="pass outer_optimizer too"):  # plain local SGD has no pseudo-gradients
        HierarchicalLocalSGD(inner(model.parameters()), model, outer_compression="int8")


@pytest.mark.parametrize("kwargs,match", [
    (dict(outer_lr=0), "outer_lr"), (dict(outer_momentum=1.0), "outer_momentum"),
    (dict(outer_momentum=0.0), "outer_nesterov needs"), (dict(outer_optimizer=outer_sgd(1, 0, False)), "builds"),
])
def test_bad_diloco_arguments_are_refused(comm, kwargs, match):
    model = mlp()
    with pytest.raises((ValueError, TypeError), match=match):
        HierarchicalDiLoCo(inner(model.parameters()), model, **kwargs)
