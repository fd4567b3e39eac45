"""Load balancing (``hsgd.LoadBalancer``) on however many ranks mpiexec started.

The ranks' speeds are set by sleeping in proportion to the batch (rank 1
twice as long per sample), so the calibration measures known speeds without
competing for the CPU; later epochs' times are given as numbers.
"""

import statistics
import time

import numpy as np
import pytest
import torch
from _files import write_on_root
from _models import mlp

from hsgd import ContiguousH5Loader, GossipSGD, HierarchicalSGD, LoadBalancer

PER_RANK, FEATURES, SECONDS_PER_SAMPLE = 32, 8, 200e-6


@pytest.fixture
def setup(comm, shared_dir):
    size = comm.Get_size()
    if size == 1:
        pytest.skip("balancing needs a second rank")
    n = PER_RANK * size * 4
    gen = np.random.default_rng(7)
    path = write_on_root(shared_dir / "balance.h5", x=gen.standard_normal((n, FEATURES)),
                         y=gen.integers(0, 3, n))
    model = mlp(torch.float64)
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    loader = ContiguousH5Loader(path, batch_size=PER_RANK, block_size=8, seed=3, return_indices=True)
    yield model, opt, loader
    loader.close()
    opt.close()


def others_mean(shares):
    return statistics.mean(b for r, b in enumerate(shares) if r != 1)


def test_a_rank_half_as_fast_gets_half_the_share_and_weights_follow(comm, setup):
    _, opt, loader = setup
    slow = 2.0 if comm.Get_rank() == 1 else 1.0
    shares = LoadBalancer(loader, opt).calibrate(lambda b: time.sleep(b * SECONDS_PER_SAMPLE * slow))
    assert sum(shares) == PER_RANK * comm.Get_size() and min(shares) >= 1
    assert comm.allgather(shares) == [shares] * comm.Get_size()
    assert 0.4 <= shares[1] / others_mean(shares) <= 0.6, shares  # within 20% of the speed ratio 1/2
    assert loader.shares == shares and loader.rank_batch_size == shares[comm.Get_rank()]
    assert opt.batch_shares == shares


def test_a_rank_that_slows_down_later_gets_less(comm, setup):
    _, opt, loader = setup
    balancer = LoadBalancer(loader, opt)
    balancer.calibrate(lambda b: time.sleep(b * SECONDS_PER_SAMPLE))
    steps, slow = 10, 4.0 if comm.Get_rank() == 1 else 1.0
    for _ in range(12):  # epochs in which rank 1 is 4x slower per sample
        shares = balancer.rebalance(steps * loader.rank_batch_size * SECONDS_PER_SAMPLE * slow, steps)
    assert 0.2 <= shares[1] / others_mean(shares) <= 0.3, shares  # within 20% of 1/4
    settled = balancer.rebalance(steps * loader.rank_batch_size * SECONDS_PER_SAMPLE * slow, steps)
    assert settled == shares  # the model already agrees with the times: no change


def test_balanced_average_is_the_global_batch_gradient(comm, setup):
    model, opt, loader = setup
    slow = 3.0 if comm.Get_rank() == 1 else 1.0
    shares = LoadBalancer(loader, opt).calibrate(lambda b: time.sleep(b * SECONDS_PER_SAMPLE * slow))
    assert len(set(shares)) > 1  # uneven batches
    x, y, indices = next(iter(loader))
    assert len(x) == shares[comm.Get_rank()]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    # The reference: one process, the union of every rank's batch, the same initial model.
    every = comm.allgather((x, y))
    reference = mlp(torch.float64)
    xs, ys = torch.cat([b[0] for b in every]), torch.cat([b[1] for b in every])
    torch.nn.functional.cross_entropy(reference(xs), ys).backward()
    for mine, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-12, atol=1e-12)


def test_modes_that_do_not_weight_by_batch_are_refused(comm, setup):
    _, _, loader = setup
    model = mlp(torch.float64)
    opt = GossipSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="weight ranks by batch size"):
        LoadBalancer(loader, opt)
    with pytest.raises(ValueError, match="weight ranks by batch size"):
        opt.batch_shares = [PER_RANK] * comm.Get_size()
    opt.close()
