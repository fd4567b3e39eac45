"""int8 and PowerSGD on the node sums: against a one-process simulation of every node, error
feedback over many rounds, the state in state_dict(), skipped rounds and bad values.

The simulations see every rank's values (each rank draws everyone's from the same seeds) and
run the algorithm of hsgd.compression on the nodes' sums, independently written. Collective
objects are closed explicitly at the end (conftest.py).
"""

import copy
import math
import warnings

import pytest
import torch
from _models import LAYOUTS, fixed_batch, mlp, shard
from _quantized import Int8Simulation
from mpi4py import MPI

from hsgd import HierarchicalLocalSGD, HierarchicalSGD, InputError, Topology
from hsgd.compression import Int4, Int8, PowerSGD
from hsgd.hierarchical import HierarchicalAverager
from hsgd.intra_node import Layout, slice_bounds

SHAPES = [(7, 50), (13,), (6, 20), (3,)]  # the last: the used-flags, summed exactly

# on one rank (one node) nothing crosses nodes and no codec runs: the suite's 1-rank job skips these
across_nodes = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="one rank: one node, nothing is compressed")


def layout():
    return Layout([(torch.float32, math.prod(s)) for s in SHAPES], SHAPES, exact=[len(SHAPES) - 1])


def rank_values(rank, round_, shapes=SHAPES):
    """Rank ``rank``'s values in round ``round_``: per entry, of a scale of its own."""
    gen = torch.Generator().manual_seed(1000 * round_ + rank)
    values = [torch.randn(math.prod(s), generator=gen) * 10.0 ** (i - 1) for i, s in enumerate(shapes[:-1])]
    return values + [(torch.rand(shapes[-1][0], generator=gen) < 0.5).float()]  # flags: 0 or 1


def nodes_of(comm, topo):
    """Every node's world ranks, by node index, local ranks in order."""
    where = comm.allgather((topo.node_index, topo.local_rank))
    return [[r for r, (n, _) in sorted(enumerate(where), key=lambda x: x[1][1]) if n == node]
            for node in range(topo.num_nodes)]


def node_sums(nodes, round_, shapes=SHAPES):
    """Each node's sums, added in local-rank order in float32 as in shared memory."""
    sums = []
    for ranks in nodes:
        total = [v.clone() for v in rank_values(ranks[0], round_, shapes)]
        for r in ranks[1:]:
            for t, v in zip(total, rank_values(r, round_, shapes)):
                t += v
        sums.append(total)
    return sums


def write(avg, lay, values):
    for (seg, off), v in zip(lay.places, values):
        avg.own(seg)[off:off + v.numel()] = v


def read(avg, lay):
    return [avg.own(seg)[off:off + n].clone() for (seg, off), n in zip(lay.places, lay.sizes)]


@across_nodes
@pytest.mark.filterwarnings("ignore:inter_node='sharded' needs nodes")
@pytest.mark.parametrize("strategy", ["leader", "sharded"])
@pytest.mark.parametrize("codec", [Int8(block=16), Int4(block=16)], ids=["int8", "int4"])
def test_int8_matches_a_simulation_of_every_node_bit_for_bit(comm, monkeypatch, strategy, codec):
    """Blocks of 16 in chunks of 5 blocks (the chunks' shares uneven), over 3 rounds: the error
    buffers carry over; leader: the whole segment; sharded: each local rank its slice. int4:
    the same in 4 bits, two values a byte."""
    from hsgd import inter_node

    monkeypatch.setattr(inter_node, "CHUNK_BYTES", 5 * (4 + 16 * codec.bits // 8))
    topo = Topology.from_comm(comm, ranks_per_node=LAYOUTS[strategy](comm))
    lay = layout()
    avg = HierarchicalAverager(topo, lay, strategy, codec)
    nodes, total = nodes_of(comm, topo), lay.numels[0]
    parts = [(0, total)] if strategy == "leader" else \
        [slice_bounds(total, topo.local_size, i) for i in range(topo.local_size)]
    levels = 2 ** (codec.bits - 1) - 1
    sims = [Int8Simulation(lay, lo, hi, 16, 5, len(nodes), levels) for lo, hi in parts]
    for round_ in range(3):
        write(avg, lay, rank_values(comm.rank, round_))
        avg.average("global")
        sums = node_sums(nodes, round_)
        want = sums[0]  # one node: nothing crosses, the exact node mean
        if len(nodes) > 1:
            want = [torch.full_like(t, float("nan")) for t in want]
            for sim in sims:  # each its part of every entry
                got = sim.run(sums)
                for (e, a, b) in sim.ranges + sim.exact:
                    want[e][a:b] = got[e][a:b]
        for got, w in zip(read(avg, lay), want):
            assert torch.equal(got, w * (1.0 / comm.size)), (round_, (got - w / comm.size).abs().max())
    avg.close()
    topo.close()


# --- PowerSGD: the algorithm in float64 ------------------------------------------------------
def orthonormal(a):
    q, _ = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(q.t() @ a))  # the signs Gram-Schmidt gives


@across_nodes
def test_powersgd_matches_a_simulation_of_every_node(comm):
    """Rank 2, compressed from the second round (start_step=1); the vectors and the flags go
    uncompressed. To float32's precision of the orthogonalizations."""
    codec = PowerSGD(rank=2, start_step=1, min_compression_rate=1)
    topo = Topology.from_comm(comm, ranks_per_node=2)
    lay = layout()
    avg = HierarchicalAverager(topo, lay, "leader", codec)
    nodes = nodes_of(comm, topo)
    gen = torch.Generator().manual_seed(codec.seed)
    qs = {e: torch.randn(SHAPES[e][1], 2, generator=gen, dtype=torch.float64) for e in (0, 2)}
    errors = {e: [torch.zeros(SHAPES[e], dtype=torch.float64) for _ in nodes] for e in (0, 2)}
    for round_ in range(4):
        write(avg, lay, rank_values(comm.rank, round_))
        avg.average("global")
        sums = [[t.double() for t in s] for s in node_sums(nodes, round_)]
        want = [sum(s[e] for s in sums) for e in range(len(SHAPES))]
        for e in (0, 2) if round_ >= 1 and len(nodes) > 1 else ():
            cs = [s[e].view(SHAPES[e]) + err for s, err in zip(sums, errors[e])]
            q = orthonormal(qs[e])
            p = orthonormal(sum(c @ q for c in cs))
            q_nodes = [c.t() @ p for c in cs]
            errors[e] = [c - p @ qi.t() for c, qi in zip(cs, q_nodes)]
            qs[e] = sum(q_nodes)
            want[e] = (p @ qs[e].t()).reshape(-1)
        for got, w in zip(read(avg, lay), want):
            torch.testing.assert_close(got.double(), w / comm.size, rtol=0, atol=1e-4 * w.abs().max().item())
    avg.close()
    topo.close()


# --- error feedback: the sum of what was applied tracks the true sum -------------------------
@across_nodes
@pytest.mark.parametrize("codec", [Int8(), PowerSGD(rank=1, start_step=0, min_compression_rate=1)])
def test_error_feedback_makes_the_applied_sum_track_the_true_sum(comm, codec):
    """The same values every round: without error feedback every round would miss by the same
    amount (int8: its rounding; rank 1: all but one direction), so the running sum's relative
    error would stay that of one round. With it, the running sum of 60 rounds is within a
    fraction of one round's error."""
    topo = Topology.from_comm(comm, ranks_per_node=1)  # every rank a node
    lay = layout()
    avg = HierarchicalAverager(topo, lay, "leader", codec)
    nodes = [[r] for r in range(comm.size)]
    truth = [sum(s[e] for s in node_sums(nodes, 0)) / comm.size for e in range(len(SHAPES))]
    applied = [torch.zeros_like(t) for t in truth]
    for round_ in range(60):
        write(avg, lay, rank_values(comm.rank, 0))
        avg.average("global")
        for a, got in zip(applied, read(avg, lay)):
            a += got
        if round_ == 0:
            first = max(((a - t).norm() / t.norm()).item() for a, t in zip(applied, truth))
    last = max(((a / 60 - t).norm() / t.norm()).item() for a, t in zip(applied, truth))
    assert first > 1e-3 and last < first / 5, (first, last)
    avg.close()
    topo.close()


# --- the state: in state_dict(), resumed exactly, reset elsewhere, untouched by skipped steps --
def train(comm, opt, model, steps, start, nan_at=None):
    x, y = fixed_batch(torch.float32)
    for step in range(start, start + steps):
        opt.zero_grad()
        xs = shard(x, comm.rank, comm.size) * (1 + step % 3)
        loss = torch.nn.functional.cross_entropy(model(xs), shard(y, comm.rank, comm.size))
        (loss * (comm.rank + 1)).backward()
        if step == nan_at and comm.rank == 0:
            next(model.parameters()).grad[0, 0] = float("nan")
        opt.synchronize()
        if opt.gradients_finite():
            with opt.skip_synchronize():
                opt.step()


def build(comm, codec, rpn=1, **kw):
    topo = Topology.from_comm(comm, ranks_per_node=rpn)
    model = mlp(torch.float32)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, topology=topo,
                          compression=codec, **kw)
    return topo, model, opt


def close(topo, opt):
    opt.close()
    topo.close()


def flat(state):
    """The tensors of a (nested) state, in order."""
    if torch.is_tensor(state):
        return [state]
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else []
    return [t for item in items for t in flat(item)]


CODECS = [Int8(block=64), PowerSGD(rank=2, start_step=2)]


@across_nodes
@pytest.mark.parametrize("codec", CODECS)
def test_a_resumed_run_ends_exactly_as_an_unstopped_one(comm, codec):
    topo, model, opt = build(comm, codec)
    train(comm, opt, model, 4, 0)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(opt.state_dict())  # torch's holds the momentum buffers themselves
    assert "hsgd_codec" in saved and any(t.abs().sum() > 0 for t in flat(saved["hsgd_codec"]))
    train(comm, opt, model, 3, 4)
    whole = [p.detach().clone() for p in model.parameters()]
    close(topo, opt)
    topo, model, opt = build(comm, codec)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved)
    train(comm, opt, model, 3, 4)
    assert all(torch.equal(a, b) for a, b in zip(whole, model.parameters()))
    close(topo, opt)


@across_nodes
@pytest.mark.parametrize("codec", CODECS)
def test_a_state_from_another_node_count_starts_afresh_and_says_so(comm, codec):
    topo, model, opt = build(comm, codec, rpn=1)
    train(comm, opt, model, 3, 0)
    saved = opt.state_dict()
    close(topo, opt)
    topo, model, opt = build(comm, codec, rpn=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved)
    said = [w for w in caught if "starts afresh" in str(w.message)]
    assert len(said) == (comm.rank == 0)  # said once, by rank 0
    fresh = opt.rank_state_dict()["hsgd_codec"]["state"] or {}  # None: not a leader
    assert not any(fresh.get(key) for key in ("parts", "error", "summed")), fresh  # nothing of the other run's
    close(topo, opt)


@across_nodes
@pytest.mark.parametrize("codec", CODECS)
def test_a_step_skipped_as_non_finite_leaves_the_error_buffers_untouched(comm, codec, monkeypatch):
    """The codec's error feedback and the finite guard take one answer: each step scans its
    averages for NaN/Inf once (every rank a node: every rank keeps error feedback)."""
    topo, model, opt = build(comm, codec)
    train(comm, opt, model, 3, 0)
    before = [t.clone() for t in flat(opt.rank_state_dict())]
    params = [p.detach().clone() for p in model.parameters()]
    scanned, isfinite = [], torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: scanned.append(t.numel()) or isfinite(t))
    every = sum(opt.averager.layout.numels)
    train(comm, opt, model, 1, 3, nan_at=3)  # NaN on rank 0: the averages are NaN on every rank
    assert 0 < sum(scanned) <= every, (scanned, every)  # one scan, up to the first NaN
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))  # skipped
    after = flat(opt.rank_state_dict())
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after))
    scanned.clear()
    train(comm, opt, model, 1, 4)
    assert sum(scanned) == every, (scanned, every)  # one whole scan
    moved = flat(opt.rank_state_dict())  # the next finite step moves them again (a leader's)
    assert not all(torch.equal(a, b) for a, b in zip(before, moved)) or topo.local_rank > 0
    close(topo, opt)


@across_nodes
@pytest.mark.parametrize("codec", CODECS)
def test_overlap_gives_the_averages_of_the_plain_step(comm, codec):
    """Every tensor a bucket of its own, summed during backward; the same blocks (int8: exactly)
    or the same factors (PowerSGD, to float32's sums) as one sum per segment after backward."""
    results = []
    for overlap in (False, True):
        topo, model, opt = build(comm, codec, rpn=2, overlap=overlap, bucket_cap_mb=1e-6)
        train(comm, opt, model, 4, 0)
        results.append([p.detach().clone() for p in model.parameters()])
        close(topo, opt)
    for a, b in zip(*results):
        if isinstance(codec, Int8):
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@across_nodes
def test_int8_sends_a_quarter_of_the_bytes_scales_included(comm):
    """Tensors of whole blocks: 8 bits and a 4-byte scale per 256 values, 25.4% of float32's."""
    shapes = [(64, 64), (4096,), (3,)]
    lay = Layout([(torch.float32, math.prod(s)) for s in shapes], shapes, exact=[2])
    sent = []
    for codec in (None, Int8()):
        topo = Topology.from_comm(comm, ranks_per_node=1)
        avg = HierarchicalAverager(topo, lay, "leader", codec)
        write(avg, lay, rank_values(comm.rank, 0, shapes))
        avg.average("global")
        sent.append(comm.allreduce(avg.traffic.inter_bytes))
        avg.close()
        topo.close()
    assert 0.25 * sent[0] < sent[1] <= 0.27 * sent[0], sent


# --- bad values: one error on every rank ----------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"compression": PowerSGD(rank=0)}, "rank"),
    ({"compression": PowerSGD(rank=64)}, "compresses none of the model's matrices"),
    ({"compression": PowerSGD(min_compression_rate=0.5)}, "min_compression_rate"),
    ({"compression": "zstd"}, "compression"),
    ({"compression": Int8}, "codec object"),
    ({"compression": "powersgd", "inter_node": "sharded"}, "whole matrices"),
    ({"compression": "int8", "powersgd_rank": 8}, "powersgd_rank"),
])
def test_bad_codec_settings_are_one_error_on_every_rank(comm, kwargs, match):
    model = mlp(torch.float32)
    with pytest.raises(InputError, match=match) as raised:
        HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs)
    assert getattr(raised.value, "hsgd_agreed", False)
    messages = comm.allgather(str(raised.value))
    assert len(set(messages)) == 1


@pytest.mark.parametrize("compression", ["int8", PowerSGD(rank=2)])
def test_local_sgd_refuses_the_codecs_with_error_feedback(comm, compression):
    model = mlp(torch.float32)
    with pytest.raises(InputError, match="averages parameters"):
        HierarchicalLocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, compression=compression)
