"""The parameter box under mpiexec: ElasticSGD and AsyncSGD against W_g in remote memory.

No ``try/finally: opt.close()``: close is collective, so after a failed
assertion on one rank it would hang; the conftest aborts the job instead.
"""

import time

import pytest
import torch

from hsgd import AsyncSGD, ElasticSGD, InputTypeError, InputValueError


def linear(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2).to(dtype)


def fill(model, value):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.full_like(p, value + i))


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.3])
def test_elastic_round_conserves_the_sum(comm, alpha):
    """One round from a known state on every worker: W_g + sum(W_x) is unchanged; alpha=0 keeps W_g."""
    rank = comm.Get_rank()
    model = linear()
    opt = ElasticSGD(torch.optim.SGD(model.parameters(), lr=0.0), model, alpha=alpha, tau=1)
    w_g0 = flat(opt.global_parameters())  # rank 0's initial parameters
    fill(model, 10.0 * (rank + 1))  # W_x differs from W_g and between ranks
    w_x0 = flat(p.detach() for p in model.parameters())
    total0 = w_g0 + comm.allreduce(w_x0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    moved = sum(opt.traffic.values())
    opt.step()  # lr 0: the inner step changes nothing; the round does
    # this rank took part: one read and one accumulate of W_g (whether W_x moves depends on the
    # other ranks' rounds: with alpha 0.5, two ranks can pull W_g exactly onto a third one's W_x)
    assert sum(opt.traffic.values()) - moved == 2 * w_x0.numel() * w_x0.element_size()
    opt.global_parameters()  # completes this rank's accumulate
    comm.Barrier()
    w_g = flat(opt.global_parameters())
    w_x = flat(p.detach() for p in model.parameters())
    assert torch.allclose(w_g + comm.allreduce(w_x), total0, rtol=0, atol=1e-9)
    if alpha == 0:
        assert torch.equal(w_g, w_g0) and torch.equal(w_x, w_x0)
    comm.Barrier()
    opt.close()


def test_elastic_tau_spaces_the_rounds(comm):
    """Rounds (a read and an accumulate of W_g: this rank's traffic) only on every third step.

    (Whether a round moves W_x depends on the other ranks' rounds: with alpha
    0.5 two ranks can pull W_g exactly onto a third one's W_x.)
    """
    model = linear()
    opt = ElasticSGD(torch.optim.SGD(model.parameters(), lr=0.0), model, alpha=0.5, tau=3)
    fill(model, 5.0 + comm.Get_rank())
    before = flat(p.detach().clone() for p in model.parameters())
    moved = [sum(opt.traffic.values())]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(6):
        opt.step()
        moved.append(sum(opt.traffic.values()))
    round_bytes = 2 * before.numel() * before.element_size()  # one read, one accumulate
    assert [b - a for a, b in zip(moved, moved[1:])] == [0, 0, round_bytes, 0, 0, round_bytes]
    comm.Barrier()
    opt.close()


def test_async_step_adds_every_change_to_w_g(comm):
    """With SGD and known gradients, W_g ends at W_g0 - lr * (sum of all ranks' gradients)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    model = linear()
    lr, steps = 0.5, 3
    opt = AsyncSGD(torch.optim.SGD(model.parameters(), lr=lr), model)
    w_g0 = flat(opt.global_parameters())
    comm.Barrier()
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + 1))
        opt.step()
    comm.Barrier()
    w_g = flat(opt.global_parameters())
    expect = w_g0 - lr * steps * size * (size + 1) / 2
    assert torch.allclose(w_g, expect, rtol=0, atol=1e-9)
    # every rank continued from W_g after its last step: equal to W_g as it was then
    assert opt.traffic["intra_bytes"] + opt.traffic["inter_bytes"] > 0
    comm.Barrier()
    opt.close()


@pytest.mark.parametrize("cls", [ElasticSGD, AsyncSGD])
def test_ranks_ending_apart_lose_no_update_of_w_g(comm, cls):
    """Rank r runs r + 1 steps, the last one late: the W_g that shared_state_dict returns
    (what the trainer evaluates and saves, with no barrier before it) holds every update."""
    rank, size = comm.Get_rank(), comm.Get_size()
    model = linear()
    lr = 0.5 if cls is AsyncSGD else 0.0  # elastic: lr 0, the rounds alone move W_g and W_x
    opt = cls(torch.optim.SGD(model.parameters(), lr=lr), model)
    w_g0 = flat(opt.global_parameters())
    comm.Barrier()
    if cls is ElasticSGD:
        fill(model, 10.0 * (rank + 1))
    total0 = w_g0 + comm.allreduce(flat(p.detach() for p in model.parameters()))
    for step in range(rank + 1):
        if rank == size - 1 and step == rank:
            time.sleep(0.3)  # the others are in shared_state_dict by now
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + 1))
        opt.step()
    state = opt.shared_state_dict()
    w_g = flat([state["weight"], state["bias"]])
    if cls is AsyncSGD:
        expect = w_g0 - lr * sum((r + 1) * (r + 1) for r in range(size))
    else:  # each round conserves W_g + sum(W_x)
        expect = total0 - comm.allreduce(flat(p.detach() for p in model.parameters()))
    assert torch.allclose(w_g, expect, rtol=0, atol=1e-9)
    comm.Barrier()
    opt.close()


def regression_data(rank, size, n_per_rank=256, noise=0.05):
    gen = torch.Generator().manual_seed(123)
    w_true = torch.randn(16, 3, generator=gen)
    x = torch.randn(n_per_rank * size, 16, generator=gen)
    y = x @ w_true + noise * torch.randn(n_per_rank * size, 3, generator=gen)
    return x, y, x[rank::size], y[rank::size]


@pytest.mark.parametrize("cls,kwargs", [(ElasticSGD, {"alpha": 0.2, "tau": 1}), (AsyncSGD, {})])
def test_linear_regression_converges_to_the_noise_floor(comm, cls, kwargs):
    rank, size = comm.Get_rank(), comm.Get_size()
    noise = 0.05
    x_all, y_all, x, y = regression_data(rank, size, noise=noise)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 3)
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.05), model, **kwargs)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(400):
        idx = torch.randint(0, len(x), (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    comm.Barrier()
    weight, bias = opt.global_parameters()
    mse = torch.nn.functional.mse_loss(x_all @ weight.T + bias, y_all).item()
    assert mse <= 1.5 * noise ** 2, (mse, noise ** 2)
    comm.Barrier()
    opt.close()


def test_load_global_parameters_sets_w_g_and_the_replicas(comm):
    model = linear()
    opt = AsyncSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    target = [torch.full_like(p, 7.0) for p in model.parameters()]
    opt.load_global_parameters(target)
    assert all(torch.equal(a, b) for a, b in zip(opt.global_parameters(), target))
    assert all(torch.equal(p.detach(), t) for p, t in zip(model.parameters(), target))
    with pytest.raises(InputValueError, match="one tensor per trainable parameter"):
        opt.load_global_parameters(target[:1])
    comm.Barrier()
    opt.close()
    # after close the parameters own their memory again and keep their values
    assert all(torch.equal(p.detach(), t) for p, t in zip(model.parameters(), target))
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


@pytest.mark.parametrize("cls", [ElasticSGD, AsyncSGD])
def test_shared_state_dict_round_trip_restores_w_g(comm, cls):
    """What a checkpoint holds (W_g as the model's parameters) is what a resume puts back."""
    rank = comm.Get_rank()
    model = linear()
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), model)
    saved = opt.shared_state_dict()
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in
               zip(("weight", "bias"), opt.global_parameters()))
    comm.Barrier()  # every rank has read W_g before it moves on
    opt.box.accumulate(0, torch.ones(opt.box.numel, dtype=torch.float64))  # W_g moves on
    fill(model, float(rank))
    replica = flat(p.detach().clone() for p in model.parameters())
    comm.Barrier()
    opt.load_shared_state_dict(saved)
    assert torch.equal(flat(opt.global_parameters()), flat([saved["weight"], saved["bias"]]))
    assert torch.equal(flat(p.detach() for p in model.parameters()), replica)  # replicas kept
    comm.Barrier()
    opt.close()


@pytest.mark.parametrize("kwargs,error,text", [
    ({"alpha": 1.5}, InputValueError, "alpha"),
    ({"alpha": -0.1}, InputValueError, "alpha"),
    ({"tau": 0}, InputValueError, "tau"),
])
def test_bad_elastic_settings_raise_on_every_rank(comm, kwargs, error, text):
    model = linear()
    with pytest.raises(error, match=text):
        ElasticSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs)
    comm.Barrier()


def test_mixed_parameter_dtypes_are_refused(comm):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(InputTypeError, match="float32 or float64"):
        AsyncSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    comm.Barrier()
