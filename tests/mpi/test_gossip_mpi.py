"""GossipSGD under mpiexec: against a one-process simulation of push-sum gossip, conservation,
consensus, adaptive sends, and bad input.

No ``try/finally: opt.close()``: close is collective, so after a failed
assertion on one rank it would hang; the conftest aborts the job instead.
"""

import math

import numpy as np
import pytest
import torch
from _models import hosts

from hsgd import GossipSGD, InputValueError
from hsgd.gossip.graphs import GRAPHS, make_graph


def model_on(rank, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2).to(dtype)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=dtype).view(p.shape) * (rank + 1) + i)
    return model


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gradient(rank, step, numel):
    """A different gradient per rank and step, so that ranks trigger at different steps."""
    return np.full(numel, (rank + 1) * (1 + step % 3) * 0.1) + np.arange(numel) * 0.01 * rank


def simulate(graph, x0, lr, theta, steps):
    """Push-sum gossip of all ranks in one process, float64: the models after ``steps`` steps."""
    size = len(x0)
    x, w, sent = [v.copy() for v in x0], [1.0] * size, [v.copy() for v in x0]
    sends = [0] * size
    for t in range(steps):
        x = [x[r] - lr * gradient(r, t, x[r].size) for r in range(size)]
        peers = [graph.peers(t, r) for r in range(size)]
        send, share = [False] * size, [0.0] * size
        for r, (outs, _) in enumerate(peers):
            moved = np.linalg.norm(x[r] - sent[r])
            send[r] = bool(outs) and (theta == 0 or moved > theta * np.linalg.norm(sent[r]))
            share[r] = w[r] / (len(outs) + 1) if send[r] else 0.0
        new_x, new_w = [], []
        for r, (_, ins) in enumerate(peers):
            kept = share[r] if send[r] else w[r]
            received = [(x[p], share[p]) for p in ins if send[p]]
            total = kept + sum(s for _, s in received)
            value = x[r] * (kept / total)
            for other, s in received:
                value = value + other * (s / total)
            new_x.append(value if received else x[r])
            new_w.append(total)
            if send[r]:
                sent[r] = x[r].copy()
                sends[r] += 1
        x, w = new_x, new_w
    return x, w, sends


def run(comm, graph, theta, steps, lr=0.5, dtype=torch.float64):
    rank = comm.Get_rank()
    model = model_on(rank, dtype=dtype)
    opt = GossipSGD(torch.optim.SGD(model.parameters(), lr=lr), model, graph=graph, theta=theta,
                    broadcast=False)
    for t in range(steps):
        for p, g in zip(model.parameters(), np.split(gradient(rank, t, 10), [8])):
            p.grad = torch.from_numpy(g).view(p.shape).to(dtype, copy=True)
        opt.step()
    return model, opt


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("theta", [0.0, 0.02, 0.3])
def test_models_follow_the_push_sum_simulation(comm, graph, theta):
    """Every rank's model and weight equal a one-process simulation of the same gossip,
    also when ranks send in different rounds (theta > 0) - and no rank waits forever."""
    rank, size, steps = comm.Get_rank(), comm.Get_size(), 12
    model, opt = run(comm, graph, theta, steps)
    x0 = [flat(model_on(r)).numpy() for r in range(size)]
    want, weights, sends = simulate(make_graph(graph, size), x0, 0.5, theta, steps)
    assert np.allclose(flat(model).numpy(), want[rank], rtol=0, atol=1e-12)
    assert opt.weight == pytest.approx(weights[rank], abs=1e-12)
    assert opt.sends == sends[rank]
    if theta == 0.3 and size > 1:
        assert 0 < sum(sends) < steps * size  # some rounds sent, some did not
    comm.Barrier()
    opt.close()


@pytest.mark.parametrize("theta", [0.0, 0.3])
def test_float32_models_follow_the_simulation(comm, theta):
    """A float32 model travels in the same message as its float64 header (the weight share):
    the models follow the float64 simulation to float32's precision, the weights exactly."""
    rank, size, steps = comm.Get_rank(), comm.Get_size(), 12
    model, opt = run(comm, "exponential", theta, steps, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x0 = [flat(model_on(r)).numpy() for r in range(size)]
    want, weights, sends = simulate(make_graph("exponential", size), x0, 0.5, theta, steps)
    assert np.allclose(flat(model).double().numpy(), want[rank], rtol=1e-5, atol=1e-5)
    assert opt.weight == pytest.approx(weights[rank], abs=1e-12)
    assert opt.sends == sends[rank]
    comm.Barrier()
    opt.close()


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_lr_0_conserves_the_mean_and_reaches_consensus(comm, graph):
    rank, size = comm.Get_rank(), comm.Get_size()
    model = model_on(rank)
    opt = GossipSGD(torch.optim.SGD(model.parameters(), lr=0.0), model, graph=graph, theta=0.0,
                    broadcast=False)
    mean0 = torch.stack([flat(model_on(r)) for r in range(size)]).mean(0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(100):
        opt.step()
        assert torch.allclose(opt.consensus(), mean0, rtol=0, atol=1e-12)
        if make_graph(graph, size).symmetric:  # weights stay 1: the plain mean is kept
            mean = torch.from_numpy(comm.allreduce(flat(model).numpy())) / size
            assert torch.allclose(mean, mean0, rtol=0, atol=1e-12)
    assert torch.allclose(flat(model), mean0, rtol=0, atol=1e-6)  # consensus
    state = opt.shared_state_dict()
    assert torch.allclose(torch.cat([state["weight"].reshape(-1), state["bias"]]), mean0, rtol=0, atol=1e-12)
    comm.Barrier()
    opt.close()


def test_theta_inf_moves_nothing(comm):
    rank = comm.Get_rank()
    model, opt = run(comm, "random", math.inf, 5)
    assert opt.traffic == {"intra_bytes": 0, "inter_bytes": 0} and opt.sends == 0
    alone = model_on(rank)
    for t in range(5):  # plain local SGD
        with torch.no_grad():
            for p, g in zip(alone.parameters(), np.split(gradient(rank, t, 10), [8])):
                p -= 0.5 * torch.from_numpy(g).view(p.shape)
    assert torch.equal(flat(model), flat(alone))
    comm.Barrier()
    opt.close()


def test_traffic_counts_models_and_headers_by_node(comm):
    """Each send is the model and a header, counted across nodes when the peer is on another
    host (the nodes are the hosts: one under a plain mpiexec, several in tests/hosts)."""
    size, steps = comm.Get_size(), 4
    model, opt = run(comm, "exponential", 0.0, steps)
    host = {rank: i for i, ranks in enumerate(hosts(comm)) for rank in ranks}
    graph, want = make_graph("exponential", size), {"intra_bytes": 0, "inter_bytes": 0}
    for t in range(steps):
        for peer in graph.peers(t, comm.rank)[0]:
            want["intra_bytes" if host[peer] == host[comm.rank] else "inter_bytes"] += 10 * 8 + 16
    assert sum(want.values()) == (steps * (10 * 8 + 16) if size > 1 else 0)  # one peer per round
    assert opt.traffic == want
    comm.Barrier()
    opt.close()


def test_state_dict_carries_weight_and_last_sent_model(comm):
    rank = comm.Get_rank()
    model, opt = run(comm, "exponential", 0.1, 6)
    state = opt.state_dict()
    weight, sent = opt.weight, opt.sent.clone()
    fresh = model_on(rank)
    other = GossipSGD(torch.optim.SGD(fresh.parameters(), lr=0.5), fresh, graph="exponential", theta=0.1,
                      broadcast=False)
    other.load_state_dict(state)
    assert other.weight == weight and torch.equal(other.sent, sent) and other.num_steps == 6
    comm.Barrier()
    other.close()
    opt.close()


@pytest.mark.parametrize("kwargs,text", [
    ({"graph": "star"}, "graph"),
    ({"theta": -0.1}, "theta"),
    ({"theta": "often"}, "theta"),
    ({"theta": float("nan")}, "theta"),
    ({"seed": -1}, "seed"),
])
def test_bad_settings_raise_on_every_rank(comm, kwargs, text):
    model = model_on(0)
    with pytest.raises(InputValueError, match=text):
        GossipSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs)
