"""Shared fixtures for the MPI tests: a fixed batch, its shards, small models."""

import torch

GLOBAL_BATCH = 120  # divisible by 2 x every world size the driver runs (1-5)


def fixed_batch(dtype=torch.float64, n=GLOBAL_BATCH, features=8, classes=3, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen, dtype=dtype)
    y = torch.randint(0, classes, (n,), generator=gen)
    return x, y


def shard(tensor, rank, size):
    per = tensor.shape[0] // size
    return tensor[rank * per:(rank + 1) * per]


def mlp(dtype=torch.float64, features=8, hidden=16, classes=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, classes)).to(dtype)


def equal_nodes(size):
    """A ``ranks_per_node`` that splits ``size`` ranks into nodes of equal size, more than one
    node when ``size > 1`` (2 x 2 at 4 ranks, else nodes of one rank): ``inter_node='sharded'``
    then runs at every world size instead of falling back to ``'leader'``."""
    return 2 if size > 2 and size % 2 == 0 else 1


# The virtual node size each strategy is tested with: 'leader' on nodes of 2, uneven at 3 and 5
# ranks; 'sharded' on equal nodes (it needs them).
LAYOUTS = {"leader": lambda size: 2, "sharded": equal_nodes}
