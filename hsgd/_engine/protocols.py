"""The protocols between a mode's layers: ``Engine`` and ``OverlapAverager``.

A :class:`~hsgd._engine.mode.SyncMode` checks and agrees on its arguments, wraps the
inner optimizer and owns the life cycle; its *engine* is the family's machinery behind
it: for :mod:`hsgd.hierarchical` a shared window with two-level averaging, the bound
tensors and the backward overlap; for :mod:`hsgd.box` a flat replica and a
remote-memory region; for :mod:`hsgd.gossip` a flat replica, the peer graph and the
push-sum transport. :class:`OverlapAverager` is what the backward overlap needs from
the averager of the slot, a :class:`~hsgd._engine.binding.SlotOwner` (what a
``SlotBinding`` binds tensors to).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Optional, Protocol, Tuple

from .._core.closable import Closable
from .._core.meter import Meter, PhaseCallback
from .binding import SlotBinding, SlotLayout, SlotOwner

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..topology import Topology

__all__ = ["Engine", "PhaseCallback", "SlotLayout", "SlotOwner", "OverlapAverager", "Span"]

#: ``(segment, start, stop)``: a range of elements in one segment of a slot.
Span = Tuple[int, int, int]


class OverlapAverager(SlotOwner, Protocol):
    """What the backward overlap (``hsgd.hierarchical.overlap.BackwardOverlap``) needs from
    the averager of the slot: the node's ranks, their window's synchronization, the averaging
    of one span in its parts, and the meter. The hierarchical family's
    :class:`~hsgd.hierarchical.averager.HierarchicalAverager` is one."""

    @property
    def topology(self) -> Topology: ...

    @property
    def inter_node(self) -> str: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def local_size(self) -> int: ...

    @property
    def node_comm(self) -> MPI.Intracomm: ...

    def sync(self) -> None:
        """``Win.Sync`` of the slots' window: this rank's stores and loads stay ordered."""

    def fence(self) -> None:
        """Every local rank's writes to the slots are complete and visible."""

    def node_mean_of(self, span: Span, scale: float) -> None:
        """One node: every slot's ``span`` becomes ``scale`` times the mean over the node."""

    def reduce_of(self, span: Span) -> None:
        """This rank's slice of ``span`` in slot 0 becomes its sum over the node's slots."""

    def start_across(self, span: Span) -> Any:
        """Start the inter-node sum of this rank's part of ``span`` in slot 0; returns its
        :class:`~hsgd.inter_node.Pending`."""

    def spread_of(self, span: Span, scale: float) -> None:
        """This rank's slice of ``span``, ``scale`` times slot 0's, into every slot."""

    def settle(self) -> None:
        """The round's averages are in this rank's slot: the codec keeps its error feedback if
        they are finite, else drops it."""

    @property
    def meter(self) -> Meter:
        """What the averaging counts its bytes in and reports its phases to."""


class Engine(Closable, abc.ABC):
    """The base of the families' engines.

    Every engine has ``binding`` (a :class:`~hsgd._engine.binding.SlotBinding`),
    ``meter`` (the mode's :class:`~hsgd._core.meter.Meter`, given at construction, which
    its parts count their bytes in and report their phases to), :meth:`describe` (its
    settings for the mode's ``repr``) and a collective, idempotent ``close()`` after which
    the parameters and gradients keep their values. What the trainer evaluates and saves is
    the mode's, not the engine's.
    """

    binding: SlotBinding
    meter: Meter

    def describe(self) -> Optional[str]:
        """``"key=value, ..."`` for the mode's ``repr``, or ``None``."""
        return None

    @abc.abstractmethod
    def _close(self) -> None:
        """Free what the engine holds, the parameters and gradients keeping their values (collective)."""
