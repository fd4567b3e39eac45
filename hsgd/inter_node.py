"""Level 2: summing the node sums across nodes with MPI.

After level 1 each node's sum sits in slot 0 of its shared window. Two
strategies reduce it across nodes, in place on the shared memory (no
staging copy):

* ``"leader"`` (:class:`LeaderAllreduce`, the HSGD design): the node leader
  allreduces the whole buffer with the other leaders over
  ``Topology.leader_comm`` while its local peers wait. One message per node
  crosses the network; works with nodes of any size.
* ``"sharded"`` (:class:`ShardedAllreduce`, Horovod's hierarchical
  allreduce): local rank ``i`` allreduces its own slice ``i`` with the ranks
  of local index ``i`` on the other nodes, so every local rank drives the
  network at once. The slices must line up, so every node must have the same
  number of ranks; :func:`make_inter_node` falls back to ``"leader"`` with a
  warning otherwise.

Both sum; the caller scales by ``1 / world_size``, so unequal nodes still
give the exact global mean.

Example::

    >>> strategy = make_inter_node("sharded", topo)
    >>> strategy.allreduce_(node_sum, lo, hi)   # node_sum: slot 0's segment
    >>> strategy.close()
"""

from __future__ import annotations

import logging
import warnings

import torch
from mpi4py import MPI

from ._engine.checks import check_choice
from ._engine.traffic import allreduce_bytes
from .errors import InputValueError

__all__ = ["LeaderAllreduce", "ShardedAllreduce", "make_inter_node", "STRATEGIES"]

logger = logging.getLogger(__name__)

STRATEGIES = ("leader", "sharded")


def _allreduce_inplace(comm, tensor: torch.Tensor) -> int:
    """Sum ``tensor`` over ``comm`` in place; returns the bytes this rank sent."""
    if not tensor.numel():
        return 0
    comm.Allreduce(MPI.IN_PLACE, tensor.numpy(), op=MPI.SUM)
    return allreduce_bytes(tensor.numel() * tensor.element_size(), comm.Get_size())


class LeaderAllreduce:
    """Node leaders allreduce the whole node sum; other ranks do nothing."""

    name = "leader"

    def __init__(self, topology):
        self.comm = topology.leader_comm

    def allreduce_(self, node_sum: torch.Tensor, lo: int, hi: int) -> int:
        """Allreduce the node sum (leaders only); returns the bytes sent."""
        return 0 if self.comm is None else _allreduce_inplace(self.comm, node_sum)

    def close(self) -> None:
        pass


class ShardedAllreduce:
    """Every local rank allreduces its slice across nodes (equal nodes only)."""

    name = "sharded"

    def __init__(self, topology):
        if not topology.equal_nodes:
            raise InputValueError(
                f"inter_node='sharded' needs nodes of equal size; got "
                f"{list(topology.node_sizes)}. Use inter_node='leader'")
        # Ranks with the same local index, one per node, ordered by node.
        self.comm = topology.comm.Split(topology.local_rank, topology.node_index)

    def allreduce_(self, node_sum: torch.Tensor, lo: int, hi: int) -> int:
        """Allreduce this rank's slice ``[lo, hi)`` of the node sum; returns the bytes sent."""
        return _allreduce_inplace(self.comm, node_sum[lo:hi])

    def close(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def make_inter_node(name: str, topology):
    """Build the level-2 strategy ``name`` for ``topology`` (collective).

    ``"sharded"`` on nodes of unequal size warns and returns ``"leader"``;
    every rank sees the same node sizes, so every rank makes the same choice.
    """
    check_choice("inter_node", name, STRATEGIES)
    if name == "sharded" and not topology.equal_nodes:
        warnings.warn(
            f"inter_node='sharded' needs nodes of equal size, got "
            f"{list(topology.node_sizes)}; falling back to inter_node='leader'",
            RuntimeWarning, stacklevel=2)
        name = "leader"
    logger.debug("inter-node strategy %s on %s", name, topology)
    return LeaderAllreduce(topology) if name == "leader" else ShardedAllreduce(topology)
