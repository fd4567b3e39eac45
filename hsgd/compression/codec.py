"""The codec interface: what a compression of the node sums across nodes is made of.

A :class:`Codec` is a compression's settings, immutable (one object may serve several
modes); :meth:`~hsgd.compression.Codec.open` makes its :class:`Channel`, the running state on one rank that
takes part in the sums across nodes (a node leader, or every rank with
``inter_node="sharded"``). The level-2 strategy hands the channel one :class:`Part` at a
time, the span of the node sums this rank sums across nodes; the channel returns the
non-blocking steps of that sum (:class:`hsgd.inter_node.Pending` runs them one after
another) and the bytes it sends. Invariants: every rank of ``comm`` sums the same parts in
the same order; the sums end the same, to the bit, on every rank; error feedback stays
with the rank that computed the node's message, as one state per node, and a round whose
sums are not finite leaves it as it was (:meth:`~hsgd.compression.Channel.settle`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._core.settings import Choice
from ..errors import InputTypeError

if TYPE_CHECKING:  # importing mpi4py.MPI initializes MPI: not at import time
    from mpi4py import MPI

    from ..intra_node import Layout

__all__ = ["Codec", "Channel", "Part", "Step", "CodecChoice", "entry_ranges", "Gathered", "sum_steps"]

#: One step in a sum across nodes, ``fn() -> (request, finish or None)``, started once the
#: step before it completed; ``finish()`` runs once its request completed.
Step = Callable[[], Tuple["MPI.Request", Optional[Callable[[], None]]]]


class Part(NamedTuple):
    """Elements ``[lo, hi)`` of segment ``segment`` of the node sums (slot 0 of the shared
    window), ``values`` a view of them: what one rank sums across nodes, in place."""

    segment: int
    lo: int
    hi: int
    values: torch.Tensor


class Channel:
    """A codec's running state on one rank of ``comm`` (the parties of the sums across nodes).
    A codec's channel implements :meth:`steps`, and the rest where it keeps state."""

    def steps(self, part: Part) -> Tuple[List[Step], int]:
        """The non-blocking steps that sum ``part`` over ``comm`` in place (once the last one
        completed and finished), and the bytes this rank sends for it, scales included."""
        raise NotImplementedError

    def settle(self, finite: bool, spans: Optional[Sequence[Tuple[int, int, int]]] = None) -> None:
        """The sums started since the last call are complete, and their results are finite on
        every rank (``finite``) or not. Keep the error feedback they computed, or drop it: a
        step skipped for non-finite averages leaves the error buffers as they were. A part
        summed again before a call keeps its last round's. ``spans``: only the parts inside
        these ``(segment, lo, hi)`` (a streaming fragment's), the others' sums still running."""

    @property
    def pending(self) -> bool:
        """Whether sums await :meth:`settle`."""
        return False

    def state_dict(self) -> Dict[str, Any]:
        """This rank's error feedback and whatever else a resumed run needs (tensors, numbers)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict`, on the same rank of the same layout."""

    def close(self) -> None:
        """Free MPI objects (local)."""


class FeedbackChannel(Channel):
    """A channel with error feedback: what a round changes is held by a state with ``commit()``,
    kept once :meth:`settle` says the round was finite. A state summed again before that keeps
    its last round's."""

    def __init__(self) -> None:
        self._pending: Dict[Any, Tuple[Part, Any]] = {}  # key -> (its part, its state), summed since settle()

    def _hold(self, key: Any, state: Any, part: Part) -> None:
        """``state``'s round (under ``key``, for ``part``) awaits :meth:`settle`; its last round,
        if it still waits, stands."""
        if key in self._pending:
            self._pending[key][1].commit()
        self._pending[key] = (part, state)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def settle(self, finite: bool, spans: Optional[Sequence[Tuple[int, int, int]]] = None) -> None:
        for key, (part, state) in list(self._pending.items()):
            if spans is None or any(seg == part.segment and lo <= part.lo and part.hi <= hi for seg, lo, hi in spans):
                if finite:
                    state.commit()
                del self._pending[key]


@dataclasses.dataclass(frozen=True)
class Codec:
    """A compression of the node sums across nodes: its settings (a frozen dataclass, compared
    across ranks by ``repr``), what it needs, and :meth:`open`. A codec implements
    :attr:`name` and :meth:`open`, and the checks where it has settings or needs.

    Attributes:
        feedback: it keeps error feedback, which suits sums of gradients (or pseudo-gradients),
            not of parameters.
        whole_tensors: it compresses whole tensors (matrices), so it needs the node sums of
            each tensor on one rank: ``inter_node="leader"``.
    """

    feedback = False
    whole_tensors = False

    @property
    def name(self) -> str:
        """Its name as ``compression=`` takes it (``"int8"``)."""
        raise NotImplementedError

    def check(self, name: str) -> None:
        """Raise an :class:`~hsgd.errors.InputError` naming ``name`` for a bad setting."""

    def check_layout(self, layout: Layout) -> None:
        """Raise an :class:`~hsgd.errors.InputError` if it cannot serve the tensors of ``layout``."""

    def open(self, comm: MPI.Comm, layout: Layout, chunk_bytes: int) -> Channel:
        """Its :class:`Channel` on this rank of ``comm``, for the node sums laid out by ``layout``
        (sums of at most ``chunk_bytes`` on the wire at a time, where it cuts them)."""
        raise NotImplementedError


class CodecChoice(Choice):
    """``compression``'s check: one of the names, or a :class:`Codec` with good settings."""

    def __call__(self, name: str, value: Any) -> None:
        if isinstance(value, Codec):
            value.check(name)
            return
        if isinstance(value, type) and issubclass(value, Codec):
            raise InputTypeError(f"{name} takes a codec object, got the class {value.__name__}; "
                                 f"pass {value.__name__}()")
        super().__call__(name, value)


def entry_ranges(layout: Layout, part: Part) -> List[Tuple[int, int, int]]:
    """``(entry, lo, hi)`` for every entry of ``layout`` that overlaps ``part``: the overlap's
    bounds in the segment (the padding between entries left out), in order."""
    ranges = []
    for entry, ((seg, offset), size) in enumerate(zip(layout.places, layout.sizes)):
        lo, hi = max(offset, part.lo), min(offset + size, part.hi)
        if seg == part.segment and lo < hi:
            ranges.append((entry, lo, hi))
    return ranges


class Gathered:
    """Ranges of a part copied into one flat buffer, summed exactly there, copied back:
    what a codec sends uncompressed (the used-flags, small tensors, a tensor cut by a part)."""

    def __init__(self, part: Part, ranges: Sequence[Tuple[int, int]], extra: int = 0):
        self.part, self.ranges = part, list(ranges)
        self.numel = sum(hi - lo for lo, hi in self.ranges)
        self.flat = torch.empty(self.numel + extra, dtype=part.values.dtype)  # ``extra``: the codec's own

    def gather(self) -> None:
        """Copy the ranges from the part into the buffer."""
        at = 0
        for lo, hi in self.ranges:
            self.flat[at:at + hi - lo] = self.part.values[lo - self.part.lo:hi - self.part.lo]
            at += hi - lo

    def scatter(self) -> None:
        """Copy the buffer back into the ranges of the part."""
        at = 0
        for lo, hi in self.ranges:
            self.part.values[lo - self.part.lo:hi - self.part.lo] = self.flat[at:at + hi - lo]
            at += hi - lo


def sum_steps(comm, flat: torch.Tensor, before: Optional[Callable[[], None]] = None,
              after: Optional[Callable[[], None]] = None) -> List[Step]:
    """The exact sum of ``flat`` over ``comm`` as steps (:func:`hsgd._transport.sums.start_sum`):
    ``before()`` runs as the first starts (it may fill ``flat``), ``after()`` once the last completed."""
    from .._transport.sums import splits, start_sum

    count = 2 if splits(comm) else 1
    started: List[Callable[[], Any]] = []

    def step(i: int):
        if i == 0:
            if before is not None:
                before()
            started.extend(start_sum(comm, flat.numpy()))
        return started[i](), (after if i == count - 1 else None)
    return [functools.partial(step, i) for i in range(count)]
