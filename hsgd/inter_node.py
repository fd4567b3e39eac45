"""Level 2: summing the node sums across nodes with MPI.

After level 1 each node's sum sits in slot 0 of its shared window; it is reduced across
nodes in place (no staging copy) by ``"leader"`` (:class:`LeaderAllreduce`, the HSGD
design: the node leader allreduces the whole buffer with the other leaders; nodes of
any size) or ``"sharded"`` (:class:`ShardedAllreduce`, Horovod's hierarchical allreduce:
local rank ``i`` allreduces its slice ``i`` with the ranks of local index ``i`` on the other
nodes; equal nodes only, else :func:`make_inter_node` falls back to ``"leader"``). Both
sum (the caller scales by ``1 / world_size``: the exact mean, nodes equal or not), exactly or
through a codec (:mod:`hsgd.compression`), counting the bytes sent in ``meter``::

    >>> strategy = make_inter_node("sharded", topo, meter=meter)
    >>> strategy.allreduce_(node_sums, (segment, lo, hi), mine)   # node_sums: slot 0's segment
    >>> strategy.close()
"""

from __future__ import annotations

import collections
import functools
import logging
import warnings
from typing import TYPE_CHECKING, Callable, List, Literal, Optional, Tuple, get_args

import torch

from ._core.checks import check_choice
from ._core.meter import Meter
from ._core.traffic import allreduce_bytes
from ._transport.sums import start_sum, sum_
from .compression import Channel, Codec, Part
from .errors import InputValueError

if TYPE_CHECKING:  # importing mpi4py.MPI initializes MPI: not at import time
    from mpi4py import MPI

__all__ = ["LeaderAllreduce", "ShardedAllreduce", "Pending", "make_inter_node", "STRATEGIES", "CHUNK_BYTES"]

Span = Tuple[int, int, int]  # (segment, lo, hi) of the node sums

logger = logging.getLogger(__name__)

#: The inter-node strategies, as a type: what ``inter_node`` takes.
InterNode = Literal["leader", "sharded"]
STRATEGIES: Tuple[str, ...] = get_args(InterNode)  # the same names, for checks and --inter-node's choices
# The largest single inter-node sum. Across two hosts at 1 Gbit/s with two ranks each, one 8 MB
# MPI_Allreduce between the leaders ran well below the wire rate where two of 4 MB reached it
# (docs/benchmarks.md, training steps across emulated hosts).
CHUNK_BYTES = 4 << 20


class Pending:
    """Sums under way (``_Strategy.start_allreduce``), one step after another: ``test()``
    moves them on and says whether all are done, ``wait()`` blocks until they are. Each step
    is a ``fn() -> (request, finish or None)``, started when the one before it completed (a
    chunk's sum is one or two steps, :mod:`hsgd._transport.sums`): on a link the chunks
    share the wire anyway, and one at a time each crosses at the link rate, the first done
    soonest."""

    def __init__(self, chunks):
        self._chunks = collections.deque(chunks)
        self._request: Optional[MPI.Request] = None
        self._finish: Optional[Callable[[], None]] = None
        self._then: List[Callable[[], None]] = []
        self.done = False
        self._next()

    def _next(self) -> None:
        """Start the next chunk, or complete."""
        if self._chunks:
            self._request, self._finish = self._chunks.popleft()()
            return
        self._request, self.done = None, True
        for fn in self._then:
            fn()
        self._then = []

    def _finished(self) -> None:
        if self._finish is not None:
            self._finish()
        self._next()

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the sums are done (at once if they are)."""
        if self.done:
            fn()
        else:
            self._then.append(fn)

    def test(self) -> bool:
        while not self.done and self._request is not None and self._request.Test():  # set until done
            self._finished()
        return self.done

    def wait(self) -> None:
        while not self.done:
            assert self._request is not None  # set until done
            self._request.Wait()
            self._finished()


def _no_finish(start):
    return start(), None


class _Strategy:
    """Sums over ``self.comm`` in place, exactly or through a codec (:mod:`hsgd.compression`),
    whose channel on this rank holds its state; the bytes sent go to ``meter``."""

    name = ""
    comm: Optional[MPI.Comm] = None  # None on a rank that takes no part (not a leader)

    def __init__(self, codec: Optional[Codec], meter: Optional[Meter], layout):
        self.codec, self.layout = codec, layout
        self.meter = Meter() if meter is None else meter
        self.channel: Optional[Channel] = None

    def _open(self) -> None:
        """The codec's channel, on a rank that takes part (once ``comm`` is set)."""
        if self.codec is not None and self.comm is not None:
            self.channel = self.codec.open(self.comm, self.layout, CHUNK_BYTES)

    def _comm(self) -> MPI.Comm:
        """``comm``, on a rank that takes part in the sums (every caller is one)."""
        assert self.comm is not None, f"{type(self).__name__}: this rank takes no part in the sums"
        return self.comm

    @property
    def compression(self) -> str:
        return "none" if self.codec is None else self.codec.name

    @staticmethod
    def _chunks(tensor: torch.Tensor):
        """``tensor`` in consecutive views of at most ``CHUNK_BYTES``."""
        step = max(1, CHUNK_BYTES // max(1, tensor.element_size()))
        return [tensor[lo:lo + step] for lo in range(0, tensor.numel(), step)]

    def _sent(self, part: torch.Tensor) -> int:
        """The bytes this rank sends to sum ``part`` exactly."""
        return allreduce_bytes(part.numel() * part.element_size(), self._comm().Get_size())

    def _allreduce(self, part: Part) -> None:
        """Sum ``part`` over ``comm`` in place (exactly: in chunks of at most ``CHUNK_BYTES``),
        counting the bytes this rank sends."""
        if self.channel is not None:
            self.start_allreduce(part).wait()
            return
        for chunk in self._chunks(part.values):
            sum_(self._comm(), chunk.numpy())
            self.meter.add_inter(self._sent(chunk))

    def start_allreduce(self, part: Part) -> Pending:
        """:meth:`_allreduce` without waiting: the non-blocking steps of each chunk's sum
        (``Iallreduce``, or ``Ialltoallv`` then ``Iallgatherv``), or of the codec's, one after
        another, in the same order on every rank of ``comm``; ``part`` holds the sums once the
        returned :class:`Pending` is done. The bytes are counted now."""
        if self.channel is not None:
            steps, sent = self.channel.steps(part)
            self.meter.add_inter(sent)
            return Pending(steps)
        chunks = self._chunks(part.values)
        self.meter.add_inter(sum(map(self._sent, chunks)))
        return Pending([functools.partial(_no_finish, step) for chunk in chunks
                        for step in start_sum(self._comm(), chunk.numpy())])

    # --- the codec's error feedback (none without a channel)
    def settle(self, finite: Callable[[], bool], spans=None) -> None:
        """After a round of sums: keep the codec's error feedback if ``finite()`` (the round's
        averages are finite: asked only here, where there is feedback to keep), else drop it.
        ``spans``: only that of the parts inside these ``(segment, lo, hi)`` (default all)."""
        if self.channel is not None and self.channel.pending:
            self.channel.settle(finite(), spans)

    def state_dict(self) -> Optional[dict]:
        """The channel's state on this rank (``None``: none)."""
        return None if self.channel is None else self.channel.state_dict()

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.channel is not None and state is not None:
            self.channel.load_state_dict(state)

    def reset(self) -> None:
        """The codec's state as at construction: a new channel (local)."""
        self._close_channel()
        self._open()

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def close(self) -> None:
        self._close_channel()


class LeaderAllreduce(_Strategy):
    """Node leaders allreduce the whole node sum; other ranks do nothing."""

    name = "leader"

    def __init__(self, topology, codec: Optional[Codec] = None, meter: Optional[Meter] = None, layout=None):
        super().__init__(codec, meter, layout)
        self.comm = topology.leader_comm
        self._open()

    def allreduce_(self, node_sums: torch.Tensor, span: Span, mine: Tuple[int, int]) -> None:
        """Allreduce ``span`` = ``(segment, lo, hi)`` of the node sums (``node_sums``: that segment
        of slot 0), on leaders only."""
        if self.comm is not None:
            self._allreduce(Part(span[0], span[1], span[2], node_sums[span[1]:span[2]]))

    def start_allreduce_(self, node_sums: torch.Tensor, span: Span, mine: Tuple[int, int]) -> Pending:
        """:meth:`allreduce_` without waiting (leaders only; the others get a done ``Pending``)."""
        if self.comm is None:
            return Pending(())
        return self.start_allreduce(Part(span[0], span[1], span[2], node_sums[span[1]:span[2]]))


class ShardedAllreduce(_Strategy):
    """Every local rank allreduces its slice across nodes (equal nodes only)."""

    name = "sharded"

    def __init__(self, topology, codec: Optional[Codec] = None, meter: Optional[Meter] = None, layout=None):
        if not topology.equal_nodes:
            raise InputValueError(
                f"inter_node='sharded' needs nodes of equal size; got "
                f"{list(topology.node_sizes)}. Use inter_node='leader'")
        super().__init__(codec, meter, layout)
        # Ranks with the same local index, one per node, ordered by node.
        self.comm = topology.comm.Split(topology.local_rank, topology.node_index)
        self._open()

    def allreduce_(self, node_sums: torch.Tensor, span: Span, mine: Tuple[int, int]) -> None:
        """Allreduce this rank's slice ``mine`` = ``(lo, hi)`` of ``span`` of the node sums."""
        self._allreduce(Part(span[0], mine[0], mine[1], node_sums[mine[0]:mine[1]]))

    def start_allreduce_(self, node_sums: torch.Tensor, span: Span, mine: Tuple[int, int]) -> Pending:
        """:meth:`allreduce_` without waiting."""
        return self.start_allreduce(Part(span[0], mine[0], mine[1], node_sums[mine[0]:mine[1]]))

    def close(self) -> None:
        super().close()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def make_inter_node(name: str, topology, codec: Optional[Codec] = None, meter: Optional[Meter] = None,
                    layout=None):
    """Build the level-2 strategy ``name`` for ``topology`` (collective), summing through ``codec``
    (:mod:`hsgd.compression`; ``None``: exactly) the node sums laid out by ``layout`` (an
    :class:`~hsgd.intra_node.Layout`), and counting the bytes it sends in ``meter`` (default a
    :class:`~hsgd._core.meter.Meter` of its own).

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
    return (LeaderAllreduce if name == "leader" else ShardedAllreduce)(topology, codec, meter, layout)
