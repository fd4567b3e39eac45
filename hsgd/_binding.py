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
"""

from __future__ import annotations

from typing import List, Sequence

import torch

__all__ = ["SlotBinding"]


class SlotBinding:
    """Maps ``params``' ``grad`` (``what="grad"``) or values (``"data"``) to slot views."""

    def __init__(self, averager, params: Sequence[torch.nn.Parameter], what: str):
        if what not in ("grad", "data"):
            raise ValueError(f"Invalid binding target: {what!r}")
        self.what = what
        self.params = list(params)
        self.averager = averager
        self.views: List[torch.Tensor] = []
        for p, (seg, off) in zip(self.params, averager.layout.places):
            self.views.append(averager.own(seg)[off:off + p.numel()].view(p.shape))
        self.zero_copy = [p.device.type == "cpu" for p in self.params]
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
            for p, view, zc in zip(self.params, self.views, self.zero_copy):
                cur = self._current(p)
                if cur is None:
                    view.zero_()
                elif zc and cur.data_ptr() == view.data_ptr():
                    continue
                else:
                    view.copy_(cur)
                if zc:
                    self._attach(p, view)

    def scatter(self) -> None:
        """Copy averaged values back to staged (non-CPU) parameters."""
        with torch.no_grad():
            for p, view, zc in zip(self.params, self.views, self.zero_copy):
                if zc:
                    continue
                cur = self._current(p)
                if cur is None:
                    p.grad = view.to(p.device)
                else:
                    cur.copy_(view, non_blocking=False)

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

    def unbind(self) -> None:
        """Give every zero-copy parameter private storage again (before freeing)."""
        with torch.no_grad():
            for p, view, zc in zip(self.params, self.views, self.zero_copy):
                cur = self._current(p)
                if zc and cur is not None and cur.data_ptr() == view.data_ptr():
                    self._attach(p, view.clone())
        self.views = []
