"""Binding parameters' gradients (or values) to this rank's shared slot.

For a CPU parameter the slot *is* the storage: ``p.grad`` (or ``p.data``) is a view
into the rank's slot of the shared window, so backward (or the optimizer step) writes
straight into shared memory and averaging needs no copy in or out (the idea of DDP's
``gradient_as_bucket_view``). A parameter on another device (CUDA) is *staged*:
copied into the slot before averaging and back after.

Invariants: after :meth:`SlotBinding.gather` the slot holds every parameter's current
gradient, whatever the user did to the views (a missing gradient counts as zero);
with ``flags=True`` the slot carries one "used" flag per parameter, averaged with the
gradients, and parameters no rank used get ``p.grad = None`` after averaging, as in
single-process torch, so the optimizer leaves them alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from .._core.agree import collective_error
from ..errors import InputTypeError
from .staging import Staging
from .torch_compat import version

__all__ = ["SlotBinding", "SlotOwner", "SlotLayout", "FlatSlot", "FlatLayout", "slot_views"]


class SlotLayout(Protocol):
    """Where each bound tensor lives: ``places[i]`` is tensor ``i``'s ``(segment, offset)`` in
    elements, and ``dtypes[segment]`` the segment's dtype."""

    @property
    def places(self) -> Sequence[Tuple[int, int]]: ...

    @property
    def dtypes(self) -> Sequence[torch.dtype]: ...


class SlotOwner(Protocol):
    """What a :class:`~hsgd._engine.binding.SlotBinding` binds tensors to: a layout and this
    rank's segments (a shared window's slot, or a flat private buffer)."""

    @property
    def layout(self) -> SlotLayout: ...

    def own(self, segment: int) -> torch.Tensor:
        """This rank's segment ``segment``, a flat tensor."""
        ...


def _own_tensor(segment: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """``segment[offset:offset + numel]`` as a new tensor with its own version counter.

    A plain slice shares the segment's counter, so a write into one
    parameter's gradient would look like a write into all of them.
    """
    return torch.from_numpy(segment.numpy()[offset:offset + numel])


def slot_views(averager: SlotOwner, params) -> List[torch.Tensor]:
    """One tensor per parameter, shaped like it, over its place in ``averager``'s own slot
    (the layout's first ``len(params)`` entries), each with its own version counter."""
    return [_own_tensor(averager.own(seg), off, p.numel()).view(p.shape)
            for p, (seg, off) in zip(params, averager.layout.places)]


@dataclass
class FlatLayout:
    """A :class:`SlotLayout` of one segment: each tensor's place, unpadded."""

    places: List[Tuple[int, int]]
    dtypes: List[torch.dtype]


class FlatSlot:
    """A flat private CPU buffer that :class:`SlotBinding` binds ``params`` to (one segment, no
    padding), for the modes that keep each rank's parameters outside the shared window.

    All of ``params`` must share one dtype, float32 or float64; else ``who``
    (the mode) raises an agreed ``InputTypeError`` (the dtypes match on every rank).

    With ``header_bytes`` the buffer is the tail of a ``frame`` that starts with that many
    bytes (a multiple of 8) of the mode's own: a message can carry both in one piece.
    """

    def __init__(self, params, who: str, header_bytes: int = 0):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float64):
            raise collective_error(InputTypeError, f"{who} needs all trainable parameters in one of "
                                   f"float32 or float64, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        offsets = np.cumsum([0] + [p.numel() for p in params])
        self.header = header_bytes // self.dtype.itemsize  # elements before the buffer
        self.frame = torch.zeros(self.header + int(offsets[-1]), dtype=self.dtype)
        self.buffer = self.frame[self.header:]
        self.layout = FlatLayout(places=[(0, int(o)) for o in offsets[:-1]], dtypes=[self.dtype])

    def own(self, segment: int) -> torch.Tensor:
        return self.buffer


class SlotBinding:
    """Maps ``params``' ``grad`` (``what="grad"``) or values (``"data"``) to slot views.

    The averager's layout holds one entry per parameter, in order, then (with
    ``flags=True``) one float32 entry of ``len(params)`` used-flags.

    Zeroing a gradient in shared memory would be a memset of the whole model per step,
    with backward then adding its fresh gradient into it. So ``zero_grad()``
    (``set_to_none=True``, torch's default) sets CPU gradients to ``None``, and a
    pre-hook on each parameter's gradient accumulator copies backward's fresh gradient
    into the slot and hands autograd a view of the slot as the new ``p.grad``: one copy,
    no memset, no addition (:meth:`_into_slot`; it runs in ``backward()``, not in
    ``autograd.grad``). Once ``p.grad`` is such a view, further backward passes
    accumulate into it in place. ``zero_grad(set_to_none=False)`` zeroes the slot and
    keeps the views.

    A parameter counts as used when ``p.grad`` was written since the last zeroing: in
    place (backward accumulating into the view, or ``p.grad.copy_(g)``), by the hook
    (another tensor over the same memory), or by assigning a new tensor. Each view is
    its own tensor with its own version counter, so an in-place write shows as a changed
    version counter and an assignment as another data pointer (:meth:`gather`).

    With ``zero_copy=False`` CPU tensors are staged too, as tensors on any other device
    always are (the GPU path, run on the CPU). Staged tensors cross in runs, through a flat
    buffer on their device and, on a GPU, page-locked slot pages (:mod:`hsgd._engine.staging`).
    """

    def __init__(self, averager: SlotOwner, params: Sequence[torch.nn.Parameter], what: str,
                 flags: bool = False, zero_copy: bool = True):
        if what not in ("grad", "data"):
            raise ValueError(f"Invalid binding target: {what!r}")
        self.what = what
        self.params = list(params)
        self.averager = averager
        places = averager.layout.places
        self.views: List[torch.Tensor] = slot_views(averager, self.params)
        self._versions = [version(view) for view in self.views]
        self.zero_copy = [zero_copy and p.device.type == "cpu" for p in self.params]
        self.staging = Staging(places, self.params, [not zc for zc in self.zero_copy], averager.own)
        self.flags = None
        if flags:
            seg, off = places[len(self.params)]
            self.flags = averager.own(seg)[off:off + len(self.params)]
        self._accumulators: List[torch.autograd.graph.Node] = []
        self._hooks: List[torch.utils.hooks.RemovableHandle] = []
        if what == "grad":
            self._hook_accumulators()
        self.gather()

    def _hook_accumulators(self) -> None:
        """A pre-hook on each zero-copy parameter's ``AccumulateGrad`` node (:meth:`_into_slot`).
        The nodes are kept: a leaf holds its accumulator weakly, and a new one has no hook."""
        with torch.enable_grad():
            for i, (p, zc) in enumerate(zip(self.params, self.zero_copy)):
                if zc and p.requires_grad:
                    grad_fn = p.expand_as(p).grad_fn
                    assert grad_fn is not None  # p requires grad and grad is enabled
                    node = grad_fn.next_functions[0][0]  # as DDP's reducer finds it
                    assert node is not None  # a leaf that requires grad has an AccumulateGrad
                    self._accumulators.append(node)
                    self._hooks.append(node.register_prehook(functools.partial(self._into_slot, i)))

    def _into_slot(self, i: int, grad_outputs):
        """Before backward sets ``p.grad`` of a parameter that has none: copy the gradient into
        the slot and give autograd a fresh view of it, which it takes as ``p.grad`` without a
        copy (it is referenced nowhere else). Otherwise (accumulating into an existing
        ``p.grad``, or ``create_graph=True``) autograd goes its usual way."""
        p, grad = self.params[i], grad_outputs[0]
        if (p.grad is not None or torch.is_grad_enabled() or grad is None
                or grad.layout != torch.strided or grad.shape != p.shape or grad.dtype != p.dtype):
            return None
        fresh = self.views[i].detach()  # a new tensor object over the view's memory: autograd keeps it
        fresh.copy_(grad)
        return (fresh, *grad_outputs[1:])

    def _current(self, p):
        return p.grad if self.what == "grad" else p.data

    def _attach(self, p, view) -> None:
        if self.what == "grad":
            p.grad = view
        else:
            p.data = view

    def gather(self, indices: Optional[Sequence[int]] = None) -> None:
        """Make the slot hold every parameter's current gradient (or value); ``indices``: only
        those parameters' (a bucket, ``hsgd.hierarchical.overlap``)."""
        staged = {}
        with torch.no_grad():
            for i in range(len(self.params)) if indices is None else indices:
                p, view, zc = self.params[i], self.views[i], self.zero_copy[i]
                cur, used = self._current(p), False
                if not zc:
                    staged[i] = cur  # None: zero
                    used = cur is not None
                elif cur is None:
                    view.zero_()
                elif cur.data_ptr() != view.data_ptr():
                    view.copy_(cur)
                    used = True  # assigned by the user, or a fresh tensor from backward
                elif cur is not view or version(cur) != self._versions[i]:
                    used = True  # written in place (backward's accumulation, or the user)
                if zc:
                    self._attach(p, view)
                if self.flags is not None:
                    self.flags[i] = 1.0 if used else 0.0
                self._versions[i] = version(view)
        if staged:
            self.staging.gather(staged)

    def scatter(self) -> None:
        """After averaging: give staged parameters the result, unused ones ``None``."""
        self.staging.scatter()
        with torch.no_grad():
            for i, (p, zc) in enumerate(zip(self.params, self.zero_copy)):
                if self.flags is not None and self.flags[i] == 0:
                    p.grad = None  # no rank produced a gradient for it
                elif zc:
                    continue  # the view itself was averaged; gather() attached it
                elif self._current(p) is None:
                    p.grad = self.staging.device_view(i).clone()  # private, never the staging buffer
                else:
                    self._current(p).copy_(self.staging.device_view(i))

    def scale_(self, factor: float) -> None:
        """Multiply the gathered values in the slot by ``factor`` (not a use of any parameter)."""
        with torch.no_grad():
            for view in self.views:
                view.mul_(factor)
        self._versions = [version(view) for view in self.views]

    def scale_range(self, segment: int, lo: int, hi: int, factor: float) -> None:
        """Multiply elements ``[lo, hi)`` of segment ``segment`` of this rank's slot by ``factor``."""
        with torch.no_grad():
            self.averager.own(segment)[lo:hi].mul_(factor)

    def zero_(self, set_to_none: bool = True) -> None:
        """``set_to_none``: every bound gradient becomes ``None`` (backward then fills the
        slot through :meth:`_into_slot`); else they are zeroed, CPU ones as views into the slot."""
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        for seg in range(len(self.averager.layout.dtypes)):
            self.averager.own(seg).zero_()
        for p, view, zc in zip(self.params, self.views, self.zero_copy):
            if zc:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is not None:
                p.grad.zero_()
        self._versions = [version(view) for view in self.views]

    def unbind(self) -> None:
        """Give every zero-copy parameter private storage again (before freeing)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._accumulators = [], []
        self.staging.close()
        with torch.no_grad():
            for p, view, zc in zip(self.params, self.views, self.zero_copy):
                cur = self._current(p)
                # a sparse gradient (hsgd.horovod hands averaged sparse gradients back sparse) is not the view
                if zc and cur is not None and cur.layout == torch.strided and cur.data_ptr() == view.data_ptr():
                    self._attach(p, view.clone())
        self.views = []
