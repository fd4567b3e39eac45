"""How a :class:`~hsgd.remote.RemoteMemory` region lies on its owners.

The region's arguments, checked and agreed on every rank; the default
owners (one per node, its leader); the contiguous shard of each owner; and
the pieces a transfer at a global offset splits into.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .._core.agree import check_all, collective_error
from .._core.checks import check_int
from ..errors import InputTypeError, InputValueError
from ..topology import Topology

__all__ = ["DTYPES", "agree_owners", "shard_bounds", "pieces"]

#: The element types a region can hold (``MPI_Accumulate`` sums them natively).
DTYPES = {
    torch.float32: (np.float32, MPI.FLOAT),
    torch.float64: (np.float64, MPI.DOUBLE),
    torch.int32: (np.int32, MPI.INT32_T),
    torch.int64: (np.int64, MPI.INT64_T),
}


def _check_args(comm, numel, dtype, owners, chunk_bytes) -> Tuple[int, ...]:
    check_int("numel", numel, minimum=1)
    if dtype not in DTYPES:
        raise InputTypeError(f"dtype must be one of {', '.join(map(str, DTYPES))}, got {dtype!r}")
    check_int("chunk_bytes", chunk_bytes, minimum=torch.empty(0, dtype=dtype).element_size())
    size = comm.Get_size()
    if owners is None:
        return ()
    if isinstance(owners, (str, bytes)) or not isinstance(owners, Sequence):
        raise InputTypeError(f"owners must be a sequence of ranks or None, got {type(owners).__name__}")
    if not owners:
        raise InputValueError("owners must name at least one rank (or be None: one owner per node)")
    for rank in owners:
        check_int("each of owners", rank, minimum=0)
        if rank >= size:
            raise InputValueError(f"owners holds rank {rank}, but the communicator has {size} ranks")
    if len(set(owners)) != len(owners):
        raise InputValueError(f"owners lists a rank twice: {list(owners)}")
    return tuple(sorted(int(r) for r in owners))


def agree_owners(comm, numel, dtype, owners, chunk_bytes,
                 topology: Optional[Topology]) -> Tuple[Tuple[int, ...], Set[int]]:
    """The checked owners (default: each node's leader) and the ranks on this rank's node.

    Collective: a bad or differing argument raises the same ``InputError`` on every rank.
    """
    owners = check_all(comm, _check_args, comm, numel, dtype, owners, chunk_bytes)
    mine = (int(numel), str(dtype), owners, int(chunk_bytes))
    if len(set(comm.allgather(mine))) > 1:
        raise collective_error(InputValueError, "ranks were given different RemoteMemory arguments "
                               "(numel, dtype, owners, chunk_bytes); pass the same on every rank")
    own_topology = topology is None
    topo = Topology.from_comm(comm) if topology is None else topology
    try:
        node_ranks = set(topo.node_comm.allgather(comm.Get_rank()))
        if not owners:
            owners = tuple(sorted(r for r in comm.allgather(comm.Get_rank() if topo.is_leader else None)
                                  if r is not None))
    finally:
        if own_topology:
            topo.close()
    return owners, node_ranks


def shard_bounds(numel: int, parts: int) -> np.ndarray:
    """``bounds``: shard ``i`` holds elements ``[bounds[i], bounds[i + 1])``, sizes differing by at most 1."""
    base, extra = divmod(numel, parts)
    return np.cumsum([0] + [base + (i < extra) for i in range(parts)])


def pieces(starts: np.ndarray, owners: Sequence[int], offset: int,
           count: int) -> Iterator[Tuple[int, int, int, int]]:
    """``(owner, first, stop, disp)``: elements [first, stop) of a transfer of ``count``
    elements at global ``offset`` go to displacement ``disp`` of ``owner``."""
    index = int(np.searchsorted(starts, offset, side="right")) - 1
    done = 0
    while done < count:
        start, stop = int(starts[index]), int(starts[index + 1])
        take = min(count - done, stop - (offset + done))
        if take > 0:
            yield owners[index], done, done + take, offset + done - start
            done += take
        index += 1
