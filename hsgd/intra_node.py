"""Level 1: averaging inside a node through one MPI shared-memory window.

Every node allocates one window with ``MPI.Win.Allocate_shared``; each local rank owns
one *slot* in it, laid out by a :class:`Layout` (one aligned segment per dtype).
Gradients are views into the rank's own slot (:class:`hsgd.HierarchicalSGD`), so
backward fills shared memory with no copy. The node reduction is a parallel
reduce-scatter in shared memory: each segment is cut into ``k`` slices and local rank
``i`` sums slice ``i`` over all ``k`` slots, then writes the result into slice ``i`` of
every slot (one node), or leaves it in slot 0 for level 2 and spreads it back after.

Memory model: the window stays in one passive ``Lock_all`` epoch for its whole life;
:meth:`SharedSlots.fence` (``Win.Sync`` + ``Barrier`` + ``Win.Sync``) separates the
phases. A barrier alone does not make stores to shared memory visible on every MPI.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from ._core.closable import Closable
from ._core.meter import Meter
from .errors import InputTypeError

__all__ = ["Layout", "SharedSlots", "SUPPORTED_DTYPES", "slice_bounds"]

SUPPORTED_DTYPES = (torch.float32, torch.float64)
_ALIGN_BYTES = 64          # cache line; every segment and tensor starts on one
_CHUNK_BYTES = 256 * 1024  # reduce in L2-sized chunks so partial sums stay cached


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES


def slice_bounds(numel: int, parts: int, index: int, align: int = 16) -> Tuple[int, int]:
    """``[lo, hi)`` of slice ``index`` when ``numel`` elements are cut in ``parts``.

    Slice starts are multiples of ``align`` elements (cache-line friendly);
    the slices cover ``[0, numel)`` exactly, and some may be empty.
    """
    per = -(-numel // parts)
    per = -(-per // align) * align
    lo = min(numel, index * per)
    return lo, min(numel, lo + per)


class Layout:
    """Where each tensor lives in a slot: one segment per dtype, tensors aligned.

    ``Layout(specs)`` takes ``(dtype, numel)`` pairs in order and assigns each
    a ``(segment, offset)``; tensors of the same dtype share a segment.
    Unsupported dtypes raise ``TypeError``. What the codecs across nodes read
    (:mod:`hsgd.compression`): ``shapes``, each entry's shape (default: flat), and
    ``exact``, the entries every codec sums exactly (the used-flags of a binding).
    """

    def __init__(self, specs: Sequence[Tuple[torch.dtype, int]],
                 shapes: Optional[Sequence[Sequence[int]]] = None, exact: Sequence[int] = ()):
        self.dtypes: List[torch.dtype] = []
        self.numels: List[int] = []
        self.places: List[Tuple[int, int]] = []
        self.sizes: List[int] = [numel for _, numel in specs]  # each entry's elements
        self.shapes: List[Tuple[int, ...]] = ([(n,) for n in self.sizes] if shapes is None
                                              else [tuple(shape) for shape in shapes])
        self.exact = frozenset(exact)
        for dtype, numel in specs:
            if dtype not in SUPPORTED_DTYPES:
                raise InputTypeError(
                    f"hsgd averages {', '.join(map(str, SUPPORTED_DTYPES))} tensors; "
                    f"got {dtype}. Keep master weights in float32 (e.g. torch.autocast "
                    "for mixed precision) or convert the model with .float()")
            if dtype not in self.dtypes:
                self.dtypes.append(dtype)
                self.numels.append(0)
            seg = self.dtypes.index(dtype)
            self.places.append((seg, self.numels[seg]))
            itemsize = torch.empty((), dtype=dtype).element_size()
            self.numels[seg] += _aligned(numel * itemsize) // itemsize
        self.byte_offsets: List[int] = []
        total = 0
        for dtype, numel in zip(self.dtypes, self.numels):
            self.byte_offsets.append(total)
            total += _aligned(numel * torch.empty((), dtype=dtype).element_size())
        self.nbytes = max(total, _ALIGN_BYTES)


    def extent(self, entry: int, numel: int) -> Tuple[int, int]:
        """``[lo, hi)`` of entry ``entry`` (``numel`` elements) in its segment, up to where the
        next entry may start (an aligned boundary)."""
        seg, off = self.places[entry]
        itemsize = torch.empty((), dtype=self.dtypes[seg]).element_size()
        return off, off + _aligned(numel * itemsize) // itemsize


class SharedSlots(Closable):
    """One shared window per node, one slot (a :class:`Layout`) per local rank.

    Collective over ``node_comm`` to build and to ``close()``. ``slot(r, s)``
    is a torch view of segment ``s`` of local rank ``r``'s slot, straight over
    the shared memory. The bytes each pass copies between slots go to ``meter``
    (``intra_bytes``; default a :class:`~hsgd._core.meter.Meter` of its own).

    Example::

        >>> layout = Layout([(torch.float32, 1000)])
        >>> with SharedSlots(topo.node_comm, layout) as slots:
        ...     slots.slot(topo.local_rank, 0).fill_(topo.local_rank)
        ...     slots.fence()               # all slots written
        ...     slots.reduce_broadcast(1.0 / topo.local_size)
        ...     slots.fence()               # every slot holds the mean
    """

    def __init__(self, node_comm, layout: Layout, meter: Optional[Meter] = None):
        self.comm = node_comm
        self.layout = layout
        self.meter = Meter() if meter is None else meter
        self.local_rank = node_comm.Get_rank()
        self.local_size = node_comm.Get_size()
        with contextlib.ExitStack() as undo:  # if the constructor fails: free the window
            self.win = MPI.Win.Allocate_shared(layout.nbytes, 1, comm=node_comm)
            undo.callback(self.win.Free)
            self._slots = [self._map_slot(r) for r in range(self.local_size)]
            # One passive epoch for the window's life; fence() syncs inside it.
            self.win.Lock_all(MPI.MODE_NOCHECK)
            # MPI does not zero a new window (MPICH mallocs it when the node has one rank): the
            # padding between tensors is averaged too, and must not hold NaN bit patterns.
            for view in self._slots[self.local_rank]:
                view.zero_()
            undo.pop_all()
        self._opened()

    def _map_slot(self, rank: int) -> List[torch.Tensor]:
        buf, _ = self.win.Shared_query(rank)
        raw = np.frombuffer(buf, dtype=np.uint8, count=self.layout.nbytes)  # type: ignore[call-overload]  # numpy's stubs take no mpi4py buffer before Python 3.12
        views = []
        for dtype, numel, off in zip(self.layout.dtypes, self.layout.numels,
                                     self.layout.byte_offsets):
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            views.append(torch.from_numpy(raw[off:off + nbytes]).view(dtype))
        return views

    def slot(self, rank: int, segment: int) -> torch.Tensor:
        self._check_open()
        return self._slots[rank][segment]

    def own(self, segment: int) -> torch.Tensor:
        return self.slot(self.local_rank, segment)

    def my_slice(self, segment: int, span: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
        """The ``[lo, hi)`` of ``segment`` (or of its elements ``span``) this local rank reduces."""
        start, stop = (0, self.layout.numels[segment]) if span is None else span
        lo, hi = slice_bounds(stop - start, self.local_size, self.local_rank)
        return start + lo, start + hi

    def sync(self) -> None:
        """``MPI_Win_sync``: this rank's stores and loads on the window stay in program order
        against another window's (a flag board beside it)."""
        self.win.Sync()

    def fence(self) -> None:
        """Order all slot stores before this call against all loads after it."""
        self._check_open()
        self.win.Sync()        # publish this rank's stores to the window
        self.comm.Barrier()    # wait until every local rank has published
        self.win.Sync()        # observe the other ranks' stores

    def _chunks(self, lo: int, hi: int, segment: int):
        step = max(1, _CHUNK_BYTES // self._slots[0][segment].element_size())
        for start in range(lo, hi, step):
            yield slice(start, min(hi, start + step))

    def _pass(self, reduce: bool, scale: float, spread: bool, span=None) -> None:
        """One pass over this rank's slice, chunk by chunk, on slot 0's chunk:
        add the other slots into it (``reduce``), scale it, copy it to the
        other slots (``spread``). ``span``: ``(segment, lo, hi)``, only those
        elements (a bucket); default every segment whole. Counts the bytes
        copied between slots as ``intra_bytes`` (see :mod:`hsgd._core.traffic`)."""
        spans = [(seg, None) for seg in range(len(self.layout.dtypes))] if span is None \
            else [(span[0], span[1:])]
        for seg, elements in spans:
            lo, hi = self.my_slice(seg, elements)
            copies = (self.local_size - 1) * (int(reduce) + int(spread))
            self.meter.add_intra(copies * (hi - lo) * self._slots[0][seg].element_size())
            slots = [s[seg] for s in self._slots]
            for sl in self._chunks(lo, hi, seg):
                acc = slots[0][sl]
                if reduce:
                    for other in slots[1:]:
                        acc.add_(other[sl])
                if scale != 1.0:
                    acc.mul_(scale)
                if spread:
                    for other in slots[1:]:
                        other[sl].copy_(acc)

    def reduce_broadcast(self, scale: float, span=None) -> None:
        """Set slice ``i`` of every slot to ``scale`` times its sum over the slots (one node): after
        one pass every slot holds the whole average. ``span``: ``(segment, lo, hi)``, only those
        elements, cut into slices the same way (a bucket)."""
        self._pass(reduce=True, scale=scale, spread=True, span=span)

    def reduce_to_first(self, span=None) -> None:
        """Set slice ``i`` of slot 0 to the sum of slice ``i`` over all slots."""
        self._pass(reduce=True, scale=1.0, spread=False, span=span)

    def broadcast_from_first(self, scale: float, span=None) -> None:
        """Set slice ``i`` of every slot to ``scale`` times slice ``i`` of slot 0."""
        self._pass(reduce=False, scale=scale, spread=True, span=span)

    def _close(self) -> None:
        """End the lock epoch and free the window (collective). Views returned by :meth:`slot`
        dangle afterwards: copy what you keep."""
        self._slots = []
        self.win.Unlock_all()
        self.win.Free()
