"""Bytes moved by a synchronization mode, inside a node and across nodes, per rank.

Counted where the data moves, from the sizes of the buffers, not on the wire.
``intra_bytes``: bytes this rank copies between slots of *different* local ranks in
the shared window; a node mean over ``k`` ranks of ``n`` bytes adds ``2 (k - 1) n / k``
per rank (as an allreduce among ``k``), one rank on a node adds 0. ``inter_bytes``:
bytes this rank sends across nodes; an allreduce of ``n`` bytes among ``p`` parties
counts ``2 (p - 1) n / p`` per party, what the bandwidth-optimal algorithms send.

Example::

    >>> traffic = Traffic()
    >>> traffic.add_inter(allreduce_bytes(1000, parties=2))
    >>> traffic.as_dict()
    {'intra_bytes': 0, 'inter_bytes': 1000}
"""

from __future__ import annotations

__all__ = ["Traffic", "allreduce_bytes", "sum_splits"]


def allreduce_bytes(nbytes: int, parties: int) -> int:
    """Bytes each of ``parties`` sends in a bandwidth-optimal allreduce of ``nbytes``."""
    return 2 * (parties - 1) * nbytes // parties if parties > 1 else 0


def sum_splits(parties: int) -> bool:
    """Whether hsgd's level-2 sum among ``parties`` goes as an all-to-all reduce-scatter and an
    allgather (:mod:`hsgd._transport.sums`): more than two parties, not a power of two (where
    ``MPI_Allreduce`` is bandwidth-optimal itself). Free of MPI, for the cost model too."""
    return parties > 2 and parties & (parties - 1) != 0


class Traffic:
    """Running totals of this rank's ``intra_bytes`` and ``inter_bytes``."""

    __slots__ = ("intra_bytes", "inter_bytes")

    def __init__(self):
        self.intra_bytes = 0
        self.inter_bytes = 0

    def add_intra(self, nbytes: int) -> None:
        self.intra_bytes += int(nbytes)

    def add_inter(self, nbytes: int) -> None:
        self.inter_bytes += int(nbytes)

    def as_dict(self) -> dict:
        """A snapshot: ``{"intra_bytes": ..., "inter_bytes": ...}``."""
        return {"intra_bytes": self.intra_bytes, "inter_bytes": self.inter_bytes}
