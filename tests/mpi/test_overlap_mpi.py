"""HierarchicalSGD(overlap=True): averaging during backward, bucket by bucket.

Overlap on or off must give the same parameters as single-process SGD (float64, 1e-10), and
bit for bit the same as each other (every element is summed in the same order), with several
buckets, both level-2 strategies, unused parameters, gradient accumulation and clipping between
``synchronize()`` and ``step()``. Collective objects are closed explicitly (see test_hsgd_mpi).
"""

import pytest
import torch
from _models import LAYOUTS, fixed_batch, mlp, shard
from _sgd import OPTIMIZERS, Branchy, assert_params_close, check_binding, reference

from hsgd import HierarchicalSGD, Topology
from hsgd._engine.overlap import plan_buckets
from hsgd.errors import InputValueError

STEPS = 6
TINY = 1e-6  # MiB: every tensor its own bucket


def train(comm, overlap, topo=None, steps=STEPS, make_opt=OPTIMIZERS["momentum_wd"], clip=None,
          micro=1, **kw):
    x, y = fixed_batch()
    xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
    model = mlp(seed=comm.rank)  # different init: the broadcast must fix it
    opt = HierarchicalSGD(make_opt(model.parameters()), model, topology=topo, overlap=overlap,
                          backward_passes_per_step=micro, **kw)
    part = xs.shape[0] // micro
    for _ in range(steps):
        opt.zero_grad()
        for m in range(micro):
            rows = slice(m * part, (m + 1) * part)
            torch.nn.functional.cross_entropy(model(xs[rows]), ys[rows]).backward()
        if clip is None:
            opt.step()
        else:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
    return model, opt


@pytest.mark.parametrize("cap", [TINY, 25.0])
@pytest.mark.parametrize("layout", ["one node", "leader", "sharded"])
def test_overlap_equals_single_process_and_no_overlap_bit_for_bit(comm, layout, cap, binding):
    rpn = None if layout == "one node" else LAYOUTS[layout](comm.size)
    inter = "sharded" if layout == "sharded" else "leader"
    topo = Topology.from_comm(comm, ranks_per_node=rpn)
    on, opt_on = train(comm, True, topo, inter_node=inter, bucket_cap_mb=cap)
    buckets = opt_on._overlap.buckets
    assert len(buckets) == (5 if cap == TINY else 2)  # 4 tensors (+ the used-flags)
    off, opt_off = train(comm, False, topo, inter_node=inter)
    assert_params_close(on, reference(torch.float64, OPTIMIZERS["momentum_wd"], STEPS), torch.float64)
    for a, b in zip(on.parameters(), off.parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    check_binding(opt_on, binding)
    opt_on.close()
    opt_off.close()
    topo.close()


def test_clip_between_synchronize_and_step(comm, binding):
    model, opt = train(comm, True, make_opt=OPTIMIZERS["sgd"], clip=0.05, bucket_cap_mb=TINY)
    assert_params_close(model, reference(torch.float64, OPTIMIZERS["sgd"], STEPS, clip=0.05), torch.float64)
    check_binding(opt, binding)
    opt.close()


@pytest.mark.parametrize("how", ["backward_passes_per_step", "no_sync"])
def test_accumulation_over_micro_batches(comm, how, binding):
    if how == "backward_passes_per_step":
        model, opt = train(comm, True, micro=2, bucket_cap_mb=TINY)
    else:  # DDP's way: the first pass inside no_sync(), the last one averages
        x, y = fixed_batch()
        xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
        model = mlp()
        opt = HierarchicalSGD(OPTIMIZERS["momentum_wd"](model.parameters()), model, overlap=True,
                              bucket_cap_mb=TINY)
        half = xs.shape[0] // 2
        for _ in range(STEPS):
            opt.zero_grad()
            with opt.no_sync():
                (torch.nn.functional.cross_entropy(model(xs[:half]), ys[:half]) / 2).backward()
            (torch.nn.functional.cross_entropy(model(xs[half:]), ys[half:]) / 2).backward()
            opt.step()
    assert_params_close(model, reference(torch.float64, OPTIMIZERS["momentum_wd"], STEPS), torch.float64)
    check_binding(opt, binding)
    opt.close()


def test_unused_parameters(comm, binding):
    """A branch used on rank 0 only counts as zero elsewhere; one no rank uses keeps None."""
    model = Branchy()
    model.spare = torch.nn.Linear(2, 2).double()  # never used
    x = torch.ones(2, 4, dtype=torch.float64)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.0), model, overlap=True,
                          bucket_cap_mb=TINY)
    for _ in range(2):
        opt.zero_grad()
        model(x, use_branch=comm.rank == 0).backward()
        opt.step()
    with_branch, without = Branchy(), Branchy()
    with_branch(x, use_branch=True).backward()
    without(x, use_branch=False).backward()
    torch.testing.assert_close(model.branch.weight.grad, with_branch.branch.weight.grad / comm.size)
    trunk = (with_branch.trunk.weight.grad + (comm.size - 1) * without.trunk.weight.grad) / comm.size
    torch.testing.assert_close(model.trunk.weight.grad, trunk)
    assert model.spare.weight.grad is None and model.spare.bias.grad is None
    check_binding(opt, binding)
    opt.close()


def test_zero_grad_after_backward_keeps_the_ranks_in_step(comm):
    """A batch thrown away after backward (zero_grad, no step) ends the round on every rank;
    training then goes on as if that batch had never been."""
    x, y = fixed_batch()
    xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
    model = mlp()
    opt = HierarchicalSGD(OPTIMIZERS["momentum_wd"](model.parameters()), model, overlap=True,
                          bucket_cap_mb=TINY)
    for step in range(STEPS):
        if step == 2:
            torch.nn.functional.cross_entropy(model(xs * 3), ys).backward()  # discarded
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
    assert_params_close(model, reference(torch.float64, OPTIMIZERS["momentum_wd"], STEPS), torch.float64)
    opt.close()


def test_more_backward_passes_than_declared_raise(comm):
    x, y = fixed_batch()
    model = mlp()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, overlap=True)
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(InputValueError, match="backward_passes_per_step=1"):
        opt.step()
    opt.zero_grad()  # the round is over: usable again
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.close()


def test_grad_scaler_and_skip_without_synchronize_are_refused(comm):
    x, y = fixed_batch()
    model = mlp()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, overlap=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    with pytest.raises(InputValueError, match="overlap=False"):
        scaler.step(opt)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(InputValueError, match="synchronize\\(\\) first"):
        with opt.skip_synchronize():
            opt.step()
    opt.zero_grad()
    opt.close()


@pytest.mark.parametrize("bad", [{"overlap": 1}, {"bucket_cap_mb": 0}, {"bucket_cap_mb": float("nan")},
                                 {"bucket_cap_mb": True}])
def test_bad_overlap_settings_raise_on_every_rank(comm, bad):
    model = mlp()
    with pytest.raises((InputValueError, TypeError), match="overlap|bucket_cap_mb"):
        HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, **bad)


def test_buckets_go_in_reverse_order_first_one_small():
    from hsgd.intra_node import Layout
    numels = [300_000, 1000, 300_000, 10, 300_000, 5]  # float32: 1.2 MB, 4 kB, ... + 5 flags
    layout = Layout([(torch.float32, n) for n in numels])
    buckets = plan_buckets(layout, numels, cap_bytes=2.5e6, first_cap_bytes=1e6, tail=1)
    assert [b.params for b in buckets] == [(4,), (3, 2, 1, 0), ()]
    for b in buckets[:-1]:  # contiguous spans, from the first tensor's start to the last's end
        assert b.lo == layout.places[b.params[-1]][1]
        assert b.hi == (layout.places[b.params[0] + 1][1] if b.params[0] + 1 < len(numels)
                        else layout.numels[0])
