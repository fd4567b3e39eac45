"""Shared fixtures for the MPI tests: a fixed batch, its shards, small models."""

import torch
from mpi4py import MPI

GLOBAL_BATCH = 120  # divisible by 2 x every world size the driver runs (1-5)


def on(binding: str) -> torch.device:
    """The device of a ``binding`` test's model and batches (tests/mpi/conftest.py)."""
    return torch.device("cuda" if binding == "cuda" else "cpu")


def fixed_batch(dtype=torch.float64, n=GLOBAL_BATCH, features=8, classes=3, seed=1234, device="cpu"):
    """Drawn on the CPU (the same numbers whatever the device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen, dtype=dtype)
    y = torch.randint(0, classes, (n,), generator=gen)
    return x.to(device), y.to(device)


def shard(tensor, rank, size):
    per = tensor.shape[0] // size
    return tensor[rank * per:(rank + 1) * per]


def mlp(dtype=torch.float64, features=8, hidden=16, classes=3, seed=0, device="cpu"):
    """Initialized on the CPU (the same weights whatever the device), then moved to ``device``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, classes)).to(dtype).to(device)


def hosts(comm):
    """The world ranks on each host, hosts ordered by their lowest rank: from the host names,
    independently of hsgd's ``Topology`` (one host under a plain ``mpiexec``; the emulated
    hosts of ``tests/hosts``, each with its own hostname)."""
    names = comm.allgather(MPI.Get_processor_name())
    ranks = {}
    for rank, name in enumerate(names):
        ranks.setdefault(name, []).append(rank)
    return sorted(ranks.values())


def expected_nodes(comm, ranks_per_node):
    """The nodes ``Topology.from_comm(comm, ranks_per_node)`` must make, as lists of world
    ranks ordered by their lowest rank: each host (``None``), or each host cut into groups of
    ``ranks_per_node`` consecutive ranks, the last one of a host possibly smaller."""
    nodes = []
    for ranks in hosts(comm):
        per = ranks_per_node or len(ranks)
        nodes += [ranks[i:i + per] for i in range(0, len(ranks), per)]
    return sorted(nodes)


def equal_nodes(comm):
    """A ``ranks_per_node`` that splits the ranks into nodes of equal size, more than one
    node when there is more than one rank (2 x 2 at 4 ranks, on one host or on two hosts of 2;
    else nodes of one rank): ``inter_node='sharded'`` then runs at every world size instead of
    falling back to ``'leader'``."""
    even = all(len(ranks) % 2 == 0 for ranks in hosts(comm))
    return 2 if comm.size > 2 and even else 1


# The virtual node size each strategy is tested with: 'leader' on nodes of 2, uneven at 3 and 5
# ranks; 'sharded' on equal nodes (it needs them).
LAYOUTS = {"leader": lambda comm: 2, "sharded": equal_nodes}
