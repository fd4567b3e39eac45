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
