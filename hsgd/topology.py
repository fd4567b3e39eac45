"""Which ranks share a node, and who speaks for each node.

:class:`Topology` holds the communicators of hsgd's two levels: ranks on one node (a
shared-memory window) and the nodes (MPI). Physical nodes come from
``comm.Split_type(MPI.COMM_TYPE_SHARED)``. A *virtual* node size (``ranks_per_node``, or
``HSGD_RANKS_PER_NODE``) sub-splits every physical node into groups of that many
consecutive ranks, so that a single host can run and test the inter-node path; the last
group of a physical node may be smaller (5 ranks with 2 per node: nodes of 2, 2 and 1).

Example::

    >>> topo = Topology.from_comm(ranks_per_node=2)   # under mpiexec -n 4
    >>> topo.num_nodes, topo.node_index, topo.local_rank, topo.is_leader
    (2, 1, 0, True)                                   # on world rank 2
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union, cast

from mpi4py import MPI

from ._core.agree import check_all, collective_error
from ._core.closable import Closable
from ._core.leftovers import unlink_mpi_files
from .errors import InputValueError

__all__ = ["Topology", "ENV_RANKS_PER_NODE", "parse_ranks_per_node"]

ENV_RANKS_PER_NODE = "HSGD_RANKS_PER_NODE"


def parse_ranks_per_node(value: object, source: str) -> Optional[int]:
    """Validate a ranks-per-node setting; ``None`` or ``""`` means unset."""
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    if isinstance(value, bool):
        raise InputValueError(f"Invalid {source}: {value!r}; use a positive integer")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise InputValueError(
                f"Invalid {source}: {value!r} is not an integer; set it to the "
                "number of ranks per (virtual) node, e.g. 2, or unset it"
            ) from None
    if not isinstance(value, int):
        raise InputValueError(f"Invalid {source}: {value!r} is not an integer")
    if value <= 0:
        raise InputValueError(
            f"Invalid {source}: {value}; it must be a positive number of ranks "
            "per node, or unset to use the physical nodes"
        )
    return value


class Topology(Closable):
    """Communicators and coordinates of this rank in a two-level layout.

    Attributes:
        comm: the world communicator the topology was built from.
        rank: this rank in ``comm``.
        size: the number of ranks in ``comm``.
        node_comm: the ranks of this (virtual) node, ordered by world rank.
        node_ranks: their world ranks, in that order.
        local_rank: this rank's place in ``node_comm``.
        local_size: the size of ``node_comm``.
        node_index: which node this is (0-based, ordered by the node's lowest world rank).
        num_nodes: how many nodes there are.
        node_sizes: the size of every node, indexed by ``node_index``.
        is_leader: ``local_rank == 0``.
        leader_comm: the leaders of all nodes (``None`` on non-leaders).
        ranks_per_node: the virtual node size in force, or ``None``.

    Build it with :meth:`from_comm`; call :meth:`close` (collective) to free
    the communicators, or use it as a context manager.
    """

    def __init__(self, comm: MPI.Intracomm, node_comm: MPI.Intracomm, leader_comm: Optional[MPI.Intracomm],
                 node_index: int, node_sizes: Sequence[int], ranks_per_node: Optional[int],
                 node_ranks: Sequence[int]) -> None:
        self.comm = comm
        self.node_comm = node_comm
        self.node_ranks = tuple(node_ranks)
        self.leader_comm = leader_comm
        self.node_index = node_index
        self.node_sizes = tuple(node_sizes)
        self.ranks_per_node = ranks_per_node
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.local_rank = node_comm.Get_rank()
        self.local_size = node_comm.Get_size()
        self._opened()

    @property
    def num_nodes(self) -> int:
        """How many (virtual) nodes there are."""
        return len(self.node_sizes)

    @property
    def is_leader(self) -> bool:
        """Whether this rank leads its node (``local_rank == 0``): it is in ``leader_comm``."""
        return self.local_rank == 0

    @property
    def equal_nodes(self) -> bool:
        """True when every node has the same number of ranks."""
        return len(set(self.node_sizes)) == 1

    @classmethod
    def from_comm(cls, comm: Optional[MPI.Intracomm] = None, ranks_per_node: Union[int, str, None] = None) -> Topology:
        """Build the two-level layout of ``comm`` (default ``MPI.COMM_WORLD``).

        Collective over ``comm``. ``ranks_per_node`` overrides the environment
        variable ``HSGD_RANKS_PER_NODE``; both unset means physical nodes.
        A bad value raises ``ValueError`` on every rank.
        """
        comm = MPI.COMM_WORLD if comm is None else comm
        if ranks_per_node is not None:
            rpn = check_all(comm, parse_ranks_per_node, ranks_per_node, "ranks_per_node")
        else:
            rpn = check_all(comm, parse_ranks_per_node, os.environ.get(ENV_RANKS_PER_NODE), ENV_RANKS_PER_NODE)
        # Every rank must use the same virtual node size, or the splits differ.
        settings = set(comm.allgather(rpn))
        if len(settings) > 1:
            raise collective_error(InputValueError,
                f"ranks disagree on ranks_per_node / {ENV_RANKS_PER_NODE}: "
                f"{sorted(settings, key=str)}; set the same value on every rank")
        # As early as hsgd runs collectively: MPI's files unlinked once attached, so that a job
        # that aborts from here on (before any mode is built) leaves nothing (hsgd._core.leftovers).
        unlink_mpi_files(comm)
        return cls._build(comm, rpn)

    @classmethod
    def _build(cls, comm: MPI.Intracomm, rpn: Optional[int]) -> Topology:
        rank = comm.Get_rank()
        # cast: mpi4py's stubs type the splits of an Intracomm as Comm; they are Intracomms
        physical = cast(MPI.Intracomm, comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank))
        try:
            if rpn is None:
                node_comm = physical.Dup()
            else:
                node_comm = cast(MPI.Intracomm, physical.Split(physical.Get_rank() // rpn, rank))
        finally:
            physical.Free()
        is_leader = node_comm.Get_rank() == 0
        split = comm.Split(0 if is_leader else MPI.UNDEFINED, rank)
        leader_comm = None if split == MPI.COMM_NULL else cast(MPI.Intracomm, split)
        if is_leader:
            assert leader_comm is not None  # a leader is in the split
            node_index = leader_comm.Get_rank()
            node_sizes = leader_comm.allgather(node_comm.Get_size())
        else:
            node_index, node_sizes = None, None
        node_index, node_sizes = node_comm.bcast((node_index, node_sizes), root=0)
        return cls(comm, node_comm, leader_comm, node_index, node_sizes, rpn,
                   node_comm.allgather(rank))

    def _close(self) -> None:
        """Free the node and leader communicators (collective)."""
        self.node_comm.Free()
        if self.leader_comm is not None:
            self.leader_comm.Free()

    def __repr__(self) -> str:
        return (f"Topology(rank={self.rank}/{self.size}, node={self.node_index}/"
                f"{self.num_nodes}, local_rank={self.local_rank}/{self.local_size}, "
                f"node_sizes={list(self.node_sizes)})")
