"""The wrapper is a torch.optim.Optimizer, and Horovod's signatures work.

LR schedulers, GradScaler and optimizer hooks attached to the wrapper must
give the same parameters as when attached to the inner optimizer (the
README's recipes), and a GradScaler that finds Inf on one rank only must
skip the step on every rank, not hang.
"""

import warnings

import pytest
import torch
from _models import fixed_batch, mlp, shard

import hsgd
from hsgd import AsyncSGD, ElasticSGD, GossipSGD, HierarchicalLocalSGD, HierarchicalSGD, InputTypeError, InputValueError

STEPS = 6


def batches(comm, steps=STEPS, device="cpu"):
    x, y = fixed_batch(torch.float64, device=device)
    rank, size = comm.Get_rank(), comm.Get_size()
    for t in range(steps):  # a different half of the batch each step, sharded over ranks
        lo = (t % 2) * (x.shape[0] // 2)
        yield shard(x[lo:lo + x.shape[0] // 2], rank, size), shard(y[lo:lo + y.shape[0] // 2], rank, size)


def params_of(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(comm, attach, steps=STEPS, device="cpu", **kwargs):
    """Train on ``device`` with ``attach(opt) -> step_fn(loss)``; returns the final parameters."""
    model = mlp(torch.float64, device=device)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), model, **kwargs)
    step = attach(opt)
    for x, y in batches(comm, steps, device):
        opt.zero_grad()
        step(torch.nn.functional.cross_entropy(model(x), y), model)
    opt.close()
    return params_of(model)


def plain(opt):
    def step(loss, model):
        loss.backward()
        opt.step()
    return step


def test_the_wrapper_is_an_optimizer_sharing_the_inner_groups(comm):
    model = mlp(torch.float64)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = HierarchicalSGD(inner, model)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    opt.param_groups[0]["lr"] = 0.3
    assert inner.param_groups[0]["lr"] == 0.3
    inner.param_groups[0]["lr"] = 0.4
    assert opt.param_groups[0]["lr"] == 0.4
    with pytest.raises(InputValueError, match="add the group to the inner optimizer"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(InputTypeError, match="already a HierarchicalSGD"):
        HierarchicalSGD(opt, model)
    opt.close()


def test_an_lr_scheduler_on_the_wrapper_equals_one_on_the_inner_optimizer(comm):
    def on_wrapper(opt):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

        def step(loss, model):
            loss.backward()
            opt.step()
            sched.step()
        return step

    def on_inner(opt):
        sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=2, gamma=0.5)

        def step(loss, model):
            loss.backward()
            opt.step()
            sched.step()
        return step

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        scheduled = train(comm, on_wrapper)
    assert torch.equal(scheduled, train(comm, on_inner))
    assert not torch.equal(scheduled, train(comm, plain))  # the schedule did change something


def test_step_and_state_dict_hooks_run_on_the_wrapper(comm):
    model = mlp(torch.float64)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o.num_steps)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o.num_steps)))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    loaded = []
    opt.register_load_state_dict_post_hook(lambda o: loaded.append(o.num_steps))
    for x, y in batches(comm, 2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert calls == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)]
    state = opt.state_dict()
    assert state["extra"] == 1 and state["hsgd_steps"] == 2
    state.pop("extra")
    opt.load_state_dict(state)
    assert loaded == [2]
    opt.close()


def scaled(scaler_step, device="cpu"):
    def attach(opt):
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0 ** 12)

        def step(loss, model):
            scaler.scale(loss).backward()
            scaler_step(scaler, opt, model)
            scaler.update()
        return step
    return attach


def plain_step(scaler, opt, model):
    scaler.step(opt)


def recipe_with_clipping_on_the_wrapper(scaler, opt, model):
    opt.synchronize()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with opt.skip_synchronize():
        scaler.step(opt)


def recipe_with_clipping_on_the_inner_optimizer(scaler, opt, model):
    opt.synchronize()
    scaler.unscale_(opt.optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with opt.skip_synchronize():
        scaler.step(opt.optimizer)


def test_a_grad_scaler_on_the_wrapper_equals_one_on_the_inner_optimizer(comm, device):
    # a power-of-two scale divides out exactly, so every path gives unscaled SGD's parameters
    reference = train(comm, plain, device=device)
    assert torch.equal(train(comm, scaled(plain_step, device), device=device), reference)
    clipped = train(comm, scaled(recipe_with_clipping_on_the_wrapper, device), device=device)
    assert torch.equal(clipped, train(comm, scaled(recipe_with_clipping_on_the_inner_optimizer, device),
                                      device=device))
    assert not torch.equal(clipped, reference)  # the clipping did act


@pytest.mark.parametrize("mode", [HierarchicalSGD, HierarchicalLocalSGD])
def test_inf_on_one_rank_skips_the_step_on_every_rank(comm, mode, device):
    """The scaler on the last rank alone sees Inf: no rank steps, none hangs, replicas stay equal."""
    size, rank = comm.Get_size(), comm.Get_rank()
    model = mlp(torch.float64, device=device)
    opt = mode(torch.optim.SGD(model.parameters(), lr=0.2), model)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12)
    for t, (x, y) in enumerate(batches(comm, 4, device)):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if t == 2 and rank == size - 1:
            loss = loss * float("inf")
        before = params_of(model)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if mode is HierarchicalSGD:  # the average holds Inf: every rank skips
            assert torch.equal(before, params_of(model)) == (t == 2), t
        assert torch.isfinite(params_of(model)).all(), t  # (local SGD: that rank skips, the average goes on)
    assert opt.num_steps == 4
    every = comm.allgather(params_of(model))
    if mode is HierarchicalSGD:
        assert all(torch.equal(p, every[0]) for p in every)
    opt.close()


def test_named_parameters_in_place_of_the_model(comm):
    reference = train(comm, plain)
    for how in ("named", "optimizer only"):
        model = mlp(torch.float64)
        inner = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        if how == "named":
            opt = HierarchicalSGD(inner, named_parameters=model.named_parameters())
            assert list(opt.shared_state_dict()) == [name for name, _ in model.named_parameters()]
        else:
            opt = HierarchicalSGD(inner)
        step = plain(opt)
        for x, y in batches(comm):
            opt.zero_grad()
            step(torch.nn.functional.cross_entropy(model(x), y), model)
        opt.close()
        assert torch.equal(params_of(model), reference), how
    model = mlp(torch.float64)
    with pytest.raises(InputValueError, match="not both"):
        HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model,
                        named_parameters=model.named_parameters())
    with pytest.raises(InputTypeError, match="named_parameters must"):
        HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.state_dict())


def test_broadcasts_take_horovod_arguments(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    root = size - 1
    for kind in ("module", "state dict", "named parameters"):
        torch.manual_seed(rank)  # a different model on every rank
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
        model[1].running_mean.fill_(rank)
        params = {"module": model, "state dict": model.state_dict(),
                  "named parameters": model.named_parameters()}[kind]
        hsgd.broadcast_parameters(params, root_rank=root)
        sent = model.parameters() if kind == "named parameters" else model.state_dict().values()
        every = comm.allgather([t.detach().clone() for t in sent])
        for theirs in every:
            assert all(torch.equal(a, b) for a, b in zip(theirs, every[root], strict=True)), kind
        assert model[1].running_mean.eq(root if kind != "named parameters" else rank).all(), kind
    with pytest.raises(InputTypeError, match="root_rank=0"):
        hsgd.broadcast_parameters(model.state_dict(), 0)  # Horovod's positional root
    with pytest.raises(InputValueError, match="disagree"):
        hsgd.broadcast_parameters(model, root=1, root_rank=0)
    model = mlp(torch.float64)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    for x, y in batches(comm, 1):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.num_steps = 10 + rank
    opt.param_groups[0]["lr"] = 0.01 * (rank + 1)
    hsgd.broadcast_optimizer_state(opt, root_rank=root)
    assert opt.num_steps == 10 + root and opt.param_groups[0]["lr"] == 0.01 * (root + 1)
    assert opt.state_dict()["state"], "no momentum buffers to compare"
    opt.close()


@pytest.mark.parametrize("mode", [HierarchicalLocalSGD, ElasticSGD, AsyncSGD, GossipSGD])
def test_every_mode_takes_named_parameters_and_is_an_optimizer(comm, mode):
    model = mlp(torch.float64)
    opt = mode(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in batches(comm, 2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    assert opt.num_steps == 2 and opt.optimizer.param_groups[0]["lr"] == 0.025
    assert list(opt.shared_state_dict()) == [name for name, _ in model.named_parameters()]
    opt.close()
