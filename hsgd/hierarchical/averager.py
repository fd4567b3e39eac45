"""Two-level averaging of one flat buffer per rank: the engine under HierarchicalSGD.

:class:`HierarchicalAverager` owns a node's :class:`~hsgd.intra_node.SharedSlots` and a
level-2 strategy from :mod:`hsgd.inter_node`. Each rank fills its own slot
(``averager.own(segment)``); :meth:`~HierarchicalAverager.average` then leaves the mean
in every slot: over the node (``level="node"``, one fused pass) or over all ranks
(``level="global"``, every rank weighing ``1/world``; with a single node the fused
node mean). Its ``meter`` (:mod:`hsgd._core.meter`) counts the bytes of both levels and
hears of every ``"intra"`` and ``"inter"`` phase, for the trainer's time breakdown.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from mpi4py import MPI

from .._core.agree import check_all
from .._core.checks import check_choice
from .._core.closable import Closable
from .._core.meter import Meter
from ..compression import Codec, codec_of
from ..errors import InputValueError
from ..inter_node import make_inter_node
from ..intra_node import Layout, SharedSlots

__all__ = ["HierarchicalAverager", "LEVELS"]

LEVELS = ("node", "global")
Span = Tuple[int, int, int]  # (segment, lo, hi) of a slot


def _check_codec(codec: Codec, layout: Layout, inter_node: str) -> None:
    """What a codec needs: good settings, whole tensors on one rank, tensors it can compress."""
    codec.check("compression")
    if codec.whole_tensors and inter_node == "sharded":
        raise InputValueError(f"compression={codec.name!r} compresses whole matrices, which inter_node='sharded' "
                              "cuts into element-even slices; use inter_node='leader'")
    codec.check_layout(layout)


class HierarchicalAverager(Closable):
    """Averages each rank's slot over its node or over all ranks. Collective.

    ``level="node"``, one fused pass: fence; slice ``i`` of every slot becomes the mean over
    the slots ``j`` of their slice ``i``; fence. ``level="global"``: fence; slice ``i`` of
    slot 0 becomes the sum over ``j`` of slice ``i`` of slot ``j`` (level 1); fence; slot 0
    is summed over the nodes (leader or sharded, level 2); fence; slice ``i`` of every slot
    becomes slice ``i`` of slot 0 over ``world`` (the spread back); fence. ``meter``: the
    :class:`~hsgd._core.meter.Meter` that both levels count their bytes in and that hears of
    every phase (default one of its own); the mode's, under a mode.

    Example::

        >>> avg = HierarchicalAverager(topo, Layout([(torch.float64, 17)]))
        >>> avg.own(0).fill_(topo.rank)
        >>> avg.average("global")
        >>> avg.own(0)[0].item() == (topo.size - 1) / 2
        True
        >>> avg.close()
    """

    def __init__(self, topology, layout: Layout, inter_node: str = "leader",
                 compression: Union[None, str, Codec] = None, meter: Optional[Meter] = None):
        self.topology = topology
        self.layout = layout
        self.meter = Meter() if meter is None else meter
        # the last round's averages all finite, where its codec asked (settle()); else None
        self.finite: Optional[bool] = None
        codec = codec_of(compression)
        if codec is not None:
            check_all(topology.comm, _check_codec, codec, layout, inter_node)
        with contextlib.ExitStack() as undo:  # if the constructor fails: free what it built
            self.slots = SharedSlots(topology.node_comm, layout, self.meter)
            undo.callback(self.slots.close)
            self.inter = make_inter_node(inter_node, topology, codec, self.meter, layout)
            undo.pop_all()
        self._opened()

    @property
    def traffic(self) -> Meter:
        """The bytes this rank moved (``intra_bytes``, ``inter_bytes``): its meter's counts."""
        return self.meter

    @property
    def inter_node(self) -> str:
        return self.inter.name

    # What the backward overlap needs of the node's slots (hsgd._engine.protocols.OverlapAverager).
    @property
    def local_rank(self) -> int:
        return self.slots.local_rank

    @property
    def local_size(self) -> int:
        return self.slots.local_size

    @property
    def node_comm(self) -> MPI.Intracomm:
        return self.slots.comm

    def sync(self) -> None:
        """``Win.Sync`` of the slots' window."""
        self.slots.sync()

    def fence(self) -> None:
        """Every local rank's writes to the slots are complete and visible."""
        self.slots.fence()

    def own(self, segment: int) -> torch.Tensor:
        """This rank's slot, segment ``segment``: write the values to average here."""
        return self.slots.own(segment)

    def average(self, level: str = "global", scale: float = 1.0) -> None:
        """Replace every rank's slot by ``scale`` times the node or world mean."""
        check_choice("level", level, LEVELS)
        if self.slots.closed:
            raise RuntimeError("HierarchicalAverager is closed; its shared window was freed")
        topo, meter = self.topology, self.meter
        self.finite = None  # a new round: settle() answers for it, if its codec asks
        if level == "node" or topo.num_nodes == 1:
            with meter.phase("intra"):
                self._node_mean(scale)
            return
        with meter.phase("intra"):
            self._reduce_to_leader()
        with meter.phase("inter"):
            self._across_nodes()
        with meter.phase("intra"):
            self._spread(scale / topo.size)

    def _node_mean(self, scale: float) -> None:
        if self.slots.local_size == 1:
            self.node_mean_of(None, scale)  # no other rank to wait for
            return
        self.slots.fence()   # every local rank has written its slot
        self.node_mean_of(None, scale)
        self.slots.fence()   # every slot holds the mean before anyone reuses it

    def _reduce_to_leader(self) -> None:
        self.slots.fence()   # every local rank has written its slot
        self.reduce_of(None)
        self.slots.fence()   # slot 0 holds the complete node sum

    def _across_nodes(self) -> None:
        for seg in range(len(self.layout.dtypes)):
            self.across_of((seg, 0, self.layout.numels[seg]))

    def _spread(self, scale: float) -> None:
        self.slots.fence()   # the global sum in slot 0 is complete on this node
        self.spread_of(None, scale)
        self.slots.fence()   # every slot holds the mean before anyone reuses it
        self.settle()

    def settle(self, spans: Optional[Sequence[Span]] = None) -> None:
        """A round of sums across nodes is over (:meth:`average`, or the backward overlap's
        buckets) and its averages are in this rank's slot (``spans``, default every segment):
        the codec keeps the error feedback of the round if they are finite, else drops it (the
        step is skipped). The averages are the same on every rank, so is the decision. Given
        ``spans``, only the sums inside them are settled (a streaming fragment's: others may run on).
        Where the codec asked about a whole round, ``finite`` holds the answer until the next."""
        own = self.slots.own
        every = spans or [(seg, 0, self.layout.numels[seg]) for seg in range(len(self.layout.dtypes))]
        self.finite = None

        def finite() -> bool:
            answer = all(bool(torch.isfinite(own(seg)[lo:hi]).all()) for seg, lo, hi in every)
            if spans is None:
                self.finite = answer
            return answer

        self.inter.settle(finite, spans)

    @property
    def feedback(self) -> bool:
        """Whether its codec keeps error feedback (:meth:`state_dict` is then not ``None``)."""
        codec = self.inter.codec
        return codec is not None and codec.feedback

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """The codec's state on this rank (its error feedback; ``None`` for a codec without) and
        where it belongs: the world's ranks and nodes, the strategy, this rank."""
        if not self.feedback:
            return None
        return {"where": self._where(), "codec": repr(self.inter.codec), "state": self.inter.state_dict()}

    def _where(self) -> list:
        topo = self.topology
        return [topo.size, list(topo.node_sizes), self.inter_node, topo.rank]

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> bool:
        """Load :meth:`state_dict`'s output (collective). A state saved elsewhere (another number
        of ranks or nodes, another strategy, codec or rank), or none, starts the error feedback
        afresh on every rank; returns whether the state was loaded."""
        codec = self.inter.codec
        fits = (state is not None and codec is not None and state.get("where") == self._where()
                and state.get("codec") == repr(codec))
        fits = bool(self.topology.comm.allreduce(fits, op=MPI.LAND))
        if codec is not None and codec.feedback:
            self.inter.reset()
            if fits:
                assert state is not None
                self.inter.load_state_dict(state["state"])
        return fits

    # --- the phases on their own, on ``span`` = ``(segment, lo, hi)`` (a bucket) or ``None``
    # (every segment whole). No fences: the caller orders the ranks (average() above, or the
    # per-bucket flags of hsgd.hierarchical.overlap).
    def node_mean_of(self, span, scale: float) -> None:
        """Set this rank's slice of ``span`` in every slot to their sum times ``scale`` / local size."""
        if self.slots.local_size == 1 and scale == 1.0:
            return
        self.slots.reduce_broadcast(scale / self.slots.local_size, span)

    def reduce_of(self, span) -> None:
        """Set this rank's slice of ``span`` in slot 0 to its sum over the node's slots."""
        self.slots.reduce_to_first(span)

    def across_of(self, span) -> None:
        """Sum ``span`` of slot 0 over the nodes (the whole span by the leader, or this rank's
        slice of it: the level-2 strategy's part)."""
        self.inter.allreduce_(self.slots.slot(0, span[0]), span, self.slots.my_slice(span[0], span[1:]))

    def start_across(self, span):
        """:meth:`across_of` without waiting: returns the level-2 strategy's
        :class:`~hsgd.inter_node.Pending`; its time from now to its completion is reported as
        the ``"inter"`` phase when it completes."""
        start = time.perf_counter()
        pending = self.inter.start_allreduce_(self.slots.slot(0, span[0]), span,
                                              self.slots.my_slice(span[0], span[1:]))
        pending.then(lambda: self.meter.report("inter", start, time.perf_counter()))
        return pending

    def spread_of(self, span, scale: float) -> None:
        """Set this rank's slice of ``span`` in every slot to ``scale`` times that of slot 0."""
        self.slots.broadcast_from_first(scale, span)

    def _close(self) -> None:
        """Free the level-2 communicator and the shared window (collective)."""
        self.inter.close()
        self.slots.close()
