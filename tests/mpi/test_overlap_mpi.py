"""HierarchicalSGD(overlap=True): averaging during backward, bucket by bucket.

Overlap on or off must give the same parameters as single-process SGD (float64, 1e-10), and
bit for bit the same as each other (every element is summed in the same order), with several
buckets, both level-2 strategies, unused parameters, gradient accumulation and clipping between
``synchronize()`` and ``step()``. Collective objects are closed explicitly (see test_hsgd_mpi).
"""

import pytest
import torch
from _models import LAYOUTS, fixed_batch, mlp, on, shard
from _sgd import OPTIMIZERS, Branchy, assert_params_close, check_binding, reference

from hsgd import HierarchicalSGD, Topology
from hsgd.errors import InputValueError
from hsgd.hierarchical.overlap import plan_buckets

STEPS = 6
TINY = 1e-6  # MiB: every tensor its own bucket


@pytest.fixture(params=["hosts", "leader", "sharded"])
def layout(request, comm):
    """Where the hooks communicate: the hosts as nodes (one host: shared memory only), or 2+
    virtual nodes with either level-2 strategy (MPI calls inside backward). Yields
    HierarchicalSGD's arguments."""
    rpn = None if request.param == "hosts" else LAYOUTS[request.param](comm)
    topo = Topology.from_comm(comm, ranks_per_node=rpn)
    yield {"topology": topo, "inter_node": "sharded" if request.param == "sharded" else "leader"}
    topo.close()


def train(comm, overlap, steps=STEPS, make_opt=OPTIMIZERS["momentum_wd"], clip=None, micro=1, device="cpu", **kw):
    """``steps`` steps on this rank's shard in ``micro`` backward passes, on ``device``; with
    ``clip``, clipped between synchronize() and step()."""
    x, y = fixed_batch(device=device)
    xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
    model = mlp(seed=comm.rank, device=device)  # different init: the broadcast must fix it
    opt = HierarchicalSGD(make_opt(model.parameters()), model, overlap=overlap,
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


def assert_same(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q) and (p.grad is None) == (q.grad is None)
        assert p.grad is None or torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("cap", [TINY, 25.0])
def test_overlap_equals_single_process_and_no_overlap(comm, layout, cap, binding):
    kw = {"zero_copy": binding == "zero_copy", "device": on(binding), **layout}
    with_overlap, opt_on = train(comm, True, bucket_cap_mb=cap, **kw)
    assert len(opt_on.engine.overlap.buckets) == (5 if cap == TINY else 2)  # 4 tensors (+ the used-flags)
    without, opt_off = train(comm, False, **kw)
    assert_params_close(with_overlap, reference(torch.float64, OPTIMIZERS["momentum_wd"], STEPS, device=on(binding)),
                        torch.float64)
    assert_same(with_overlap, without)  # the same summation order, bit for bit (MPI's is the same at these sizes)
    check_binding(opt_on, binding)
    opt_on.close()
    opt_off.close()


def test_clip_between_synchronize_and_step(comm, layout, binding):
    model, opt = train(comm, True, make_opt=OPTIMIZERS["sgd"], clip=0.05, bucket_cap_mb=TINY,
                       zero_copy=binding == "zero_copy", device=on(binding), **layout)
    want = reference(torch.float64, OPTIMIZERS["sgd"], STEPS, clip=0.05, device=on(binding))
    assert_params_close(model, want, torch.float64)
    check_binding(opt, binding)
    opt.close()


def test_backward_returns_with_the_average_as_with_ddp(comm, layout):
    """Between backward and step the gradients are the averages already: clipping there clips
    the average (single-process clipping), and a collective there does not deadlock with
    averaging still under way, even with a branch that only rank 0 uses."""
    x, y = fixed_batch()
    xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
    model = mlp()
    opt = HierarchicalSGD(OPTIMIZERS["sgd"](model.parameters()), model, overlap=True, bucket_cap_mb=TINY,
                          **layout)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert torch.equal(torch.stack(comm.allgather(grads)).amax(0), grads)  # the same on every rank
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    assert_params_close(model, reference(torch.float64, OPTIMIZERS["sgd"], STEPS, clip=0.05), torch.float64)
    opt.close()
    branchy = Branchy()
    opt = HierarchicalSGD(torch.optim.SGD(branchy.parameters(), lr=0.1), branchy, overlap=True,
                          bucket_cap_mb=TINY, **layout)
    for _ in range(3):
        opt.zero_grad()
        branchy(torch.ones(2, 4, dtype=torch.float64), use_branch=comm.rank == 0).backward()
        assert comm.allreduce(1) == comm.size  # would hang if a rank still waited in a hook
        opt.step()
    opt.close()


@pytest.mark.parametrize("how", ["backward_passes_per_step", "no_sync"])
def test_accumulation_over_micro_batches(comm, layout, how, binding):
    if how == "backward_passes_per_step":
        model, opt = train(comm, True, micro=2, bucket_cap_mb=TINY, zero_copy=binding == "zero_copy",
                           device=on(binding), **layout)
    else:  # DDP's way: the first pass inside no_sync(), the last one averages
        x, y = fixed_batch(device=on(binding))
        xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
        model = mlp(device=on(binding))
        opt = HierarchicalSGD(OPTIMIZERS["momentum_wd"](model.parameters()), model, overlap=True,
                              bucket_cap_mb=TINY, zero_copy=binding == "zero_copy", **layout)
        half = xs.shape[0] // 2
        for _ in range(STEPS):
            opt.zero_grad()
            with opt.no_sync():
                (torch.nn.functional.cross_entropy(model(xs[:half]), ys[:half]) / 2).backward()
            (torch.nn.functional.cross_entropy(model(xs[half:]), ys[half:]) / 2).backward()
            opt.step()
    assert_params_close(model, reference(torch.float64, OPTIMIZERS["momentum_wd"], STEPS, device=on(binding)),
                        torch.float64)
    check_binding(opt, binding)
    opt.close()


def test_unused_parameters(comm, layout, binding):
    """A branch used on rank 0 only counts as zero elsewhere; one no rank uses keeps None."""
    model = Branchy()
    model.spare = torch.nn.Linear(2, 2).double()  # never used
    model.to(on(binding))
    x = torch.ones(2, 4, dtype=torch.float64, device=on(binding))
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.0), model, overlap=True,
                          bucket_cap_mb=TINY, zero_copy=binding == "zero_copy", **layout)
    for _ in range(2):
        opt.zero_grad()
        model(x, use_branch=comm.rank == 0).backward()
        opt.step()
    with_branch, without = Branchy().to(on(binding)), Branchy().to(on(binding))
    with_branch(x, use_branch=True).backward()
    without(x, use_branch=False).backward()
    torch.testing.assert_close(model.branch.weight.grad, with_branch.branch.weight.grad / comm.size)
    trunk = (with_branch.trunk.weight.grad + (comm.size - 1) * without.trunk.weight.grad) / comm.size
    torch.testing.assert_close(model.trunk.weight.grad, trunk)
    assert model.spare.weight.grad is None and model.spare.bias.grad is None
    check_binding(opt, binding)
    opt.close()


def test_zero_grad_after_backward_keeps_the_ranks_in_step(comm, layout):
    """A batch thrown away after backward (zero_grad, no step) is averaged and dropped on every
    rank alike; training then goes on as if that batch had never been."""
    x, y = fixed_batch()
    xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
    model = mlp()
    opt = HierarchicalSGD(OPTIMIZERS["momentum_wd"](model.parameters()), model, overlap=True,
                          bucket_cap_mb=TINY, backward_passes_per_step=2, **layout)
    half = xs.shape[0] // 2
    for step in range(STEPS):
        if step == 2:  # one pass of two: the round is still open at zero_grad()
            torch.nn.functional.cross_entropy(model(xs * 3), ys).backward()
        opt.zero_grad()
        for rows in (slice(0, half), slice(half, None)):
            torch.nn.functional.cross_entropy(model(xs[rows]), ys[rows]).backward()
        opt.step()
    assert_params_close(model, reference(torch.float64, OPTIMIZERS["momentum_wd"], STEPS), torch.float64)
    opt.close()


class Mixed(torch.nn.Module):
    """float32 and float64 parameters (two slot segments), registered in another order than
    backward reaches them (``late`` is used first, so its gradient comes last)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(6, 3).double()
        self.late = torch.nn.Linear(8, 6)  # float32

    def forward(self, x):
        return self.head(self.late(x.float()).double().tanh())


def test_mixed_dtypes_and_order_and_batch_shares_bit_for_bit(comm, layout):
    shares = [2 + r for r in range(comm.size)]
    runs = []
    for overlap in (True, False):
        model = Mixed()
        opt = HierarchicalSGD(OPTIMIZERS["momentum_wd"](model.parameters()), model, overlap=overlap,
                              bucket_cap_mb=TINY, **layout)
        opt.batch_shares = shares
        runs.append((model, opt))
        x, y = fixed_batch()
        xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
    assert {b.segment for b in runs[0][1].engine.overlap.buckets} == {0, 1}  # float64 and float32 segments
    assert_same(runs[0][0], runs[1][0])
    for _, opt in runs:
        opt.close()


def test_more_backward_passes_than_declared_raise_on_every_rank(comm, layout):
    x, y = fixed_batch()
    model = mlp()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, overlap=True, **layout)
    for _ in range(2 if comm.rank == 0 else 1):  # the others are told too
        torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(InputValueError, match="backward_passes_per_step=1"):
        opt.step()
    opt.zero_grad()  # the round is over: usable again
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.close()


def test_grad_scaler_is_refused_and_the_optimizer_stays_usable(comm):
    x, y = fixed_batch()
    model = mlp()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, overlap=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    with pytest.raises(InputValueError, match="GradScaler with overlap=False"):
        scaler.step(opt)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with opt.skip_synchronize():  # backward averaged already: nothing to skip, and no warning
        opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
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
    mixed = Layout([(torch.float32, 10), (torch.float64, 20), (torch.float32, 30), (torch.float64, 40),
                    (torch.float32, 4)])
    spans = plan_buckets(mixed, [10, 20, 30, 40, 4], cap_bytes=1e9, tail=1)
    assert [(b.segment, b.params) for b in spans] == [(1, (3,)), (0, (2,)), (1, (1,)), (0, (0,)), (0, ())]
    covered = {0: [], 1: []}
    for b in spans:
        covered[b.segment].append((b.lo, b.hi))
    for seg, parts in covered.items():  # disjoint, and together the whole segment
        parts.sort()
        assert parts[0][0] == 0 and parts[-1][1] == mixed.numels[seg]
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    for b in buckets[:-1]:  # contiguous spans, from the first tensor's start to the last's end
        assert b.lo == layout.places[b.params[-1]][1]
        assert b.hi == (layout.places[b.params[0] + 1][1] if b.params[0] + 1 < len(numels)
                        else layout.numels[0])
