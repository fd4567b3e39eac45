"""Binding parameters' gradients (or values) to this rank's shared slot.

For a CPU parameter the slot *is* the storage: ``p.grad`` (or ``p.data``) is
replaced by a view into the rank's slot of the shared window, so backward (or
the optimizer step) writes straight into shared memory and averaging needs no
copy in or out, the idea of DDP's ``gradient_as_bucket_view``. A parameter on
another device (CUDA) is *staged*: copied into the slot before averaging and
back after.

Users may break a view (``zero_grad(set_to_none=True)`` on the model, or
assigning ``p.grad``); :meth:`SlotBinding.gather` notices by comparing data
pointers, copies the value in, and restores the view. A missing gradient
(an unused branch) counts as zero.

With ``flags=True`` (gradient binding) the slot also carries one "used" flag
per parameter. A parameter counts as used on a rank when ``p.grad`` was
written since the last zeroing: in place (backward accumulating into the
view, or ``p.grad.copy_(g)`` from a hand-written estimator) or by assigning a
new tensor (backward after ``set_to_none``). Each view is its own tensor over
the shared memory with its own version counter, so an in-place write shows as
a changed ``_version``; an assignment shows as another data pointer. The
flags are averaged with the gradients, so after averaging every rank knows
which parameters no rank used; those get ``p.grad = None``, as in
single-process torch, and the optimizer leaves them alone (no momentum or
weight decay step).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List, Sequence

import numpy as np
import torch

from ..errors import InputTypeError
from .agree import collective_error

__all__ = ["SlotBinding", "FlatSlot"]


def _own_tensor(segment: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """``segment[offset:offset + numel]`` as a new tensor with its own version counter.

    A plain slice shares the segment's counter, so a write into one
    parameter's gradient would look like a write into all of them.
    """
    return torch.from_numpy(segment.numpy()[offset:offset + numel])


class FlatSlot:
    """A flat private CPU buffer that :class:`SlotBinding` binds ``params`` to (one segment, no
    padding), for the modes that keep each rank's parameters outside the shared window.

    All of ``params`` must share one dtype, float32 or float64; else ``who``
    (the mode) raises an agreed ``InputTypeError`` (the dtypes match on every rank).
    """

    def __init__(self, params, who: str):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, torch.float64):
            raise collective_error(InputTypeError, f"{who} needs all trainable parameters in one of "
                                   f"float32 or float64, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        offsets = np.cumsum([0] + [p.numel() for p in params])
        self.buffer = torch.zeros(int(offsets[-1]), dtype=self.dtype)
        self.layout = SimpleNamespace(places=[(0, int(o)) for o in offsets[:-1]], dtypes=[self.dtype])

    def own(self, segment: int) -> torch.Tensor:
        return self.buffer


class SlotBinding:
    """Maps ``params``' ``grad`` (``what="grad"``) or values (``"data"``) to slot views.

    The averager's layout holds one entry per parameter, in order, then (with
    ``flags=True``) one float32 entry of ``len(params)`` used-flags.
    """

    #: Device types whose tensors become views into the slot; any other is staged. The tests
    #: empty it to run the staged path (what CUDA tensors take) on the CPU.
    zero_copy_devices = ("cpu",)

    def __init__(self, averager, params: Sequence[torch.nn.Parameter], what: str,
                 flags: bool = False):
        if what not in ("grad", "data"):
            raise ValueError(f"Invalid binding target: {what!r}")
        self.what = what
        self.params = list(params)
        self.averager = averager
        places = averager.layout.places
        self.views: List[torch.Tensor] = [
            _own_tensor(averager.own(seg), off, p.numel()).view(p.shape)
            for p, (seg, off) in zip(self.params, places)]
        self._versions = [view._version for view in self.views]
        self.zero_copy = [p.device.type in self.zero_copy_devices for p in self.params]
        self.flags = None
        if flags:
            seg, off = places[len(self.params)]
            self.flags = averager.own(seg)[off:off + len(self.params)]
        self.gather()

    def _current(self, p):
        return p.grad if self.what == "grad" else p.data

    def _attach(self, p, view) -> None:
        if self.what == "grad":
            p.grad = view
        else:
            p.data = view

    def gather(self) -> None:
        """Make the slot hold every parameter's current gradient (or value)."""
        with torch.no_grad():
            for i, (p, view, zc) in enumerate(zip(self.params, self.views, self.zero_copy)):
                cur, used = self._current(p), False
                if cur is None:
                    view.zero_()
                elif not (zc and cur.data_ptr() == view.data_ptr()):
                    view.copy_(cur)
                    used = True  # assigned by the user, or a fresh tensor from backward
                elif cur._version != self._versions[i]:
                    used = True  # written in place (backward's accumulation, or the user)
                if zc:
                    self._attach(p, view)
                if self.flags is not None:
                    self.flags[i] = 1.0 if used else 0.0
            self._versions = [view._version for view in self.views]

    def scatter(self) -> None:
        """After averaging: give staged parameters the result, unused ones ``None``."""
        with torch.no_grad():
            for i, (p, view, zc) in enumerate(zip(self.params, self.views, self.zero_copy)):
                if self.flags is not None and self.flags[i] == 0:
                    p.grad = None  # no rank produced a gradient for it
                elif zc:
                    continue  # the view itself was averaged; gather() attached it
                elif self._current(p) is None:
                    p.grad = view.to(p.device, copy=True)  # private, never the slot itself
                else:
                    self._current(p).copy_(view)

    def scale_(self, factor: float) -> None:
        """Multiply the gathered values in the slot by ``factor`` (not a use of any parameter)."""
        with torch.no_grad():
            for view in self.views:
                view.mul_(factor)
        self._versions = [view._version for view in self.views]

    def zero_(self, set_to_none: bool = False) -> None:
        """Zero all bound gradients; CPU ones stay views into the slot."""
        for seg in range(len(self.averager.layout.dtypes)):
            self.averager.own(seg).zero_()
        for p, view, zc in zip(self.params, self.views, self.zero_copy):
            if zc:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._versions = [view._version for view in self.views]

    def unbind(self) -> None:
        """Give every zero-copy parameter private storage again (before freeing)."""
        with torch.no_grad():
            for p, view, zc in zip(self.params, self.views, self.zero_copy):
                cur = self._current(p)
                if zc and cur is not None and cur.data_ptr() == view.data_ptr():
                    self._attach(p, view.clone())
        self.views = []
