"""``HierarchicalSGD``: synchronous SGD with any torch optimizer, averaged in two levels.

``step()`` averages the gradients over all ranks, inside the node through
shared memory and across nodes with MPI, then runs the inner step. With
``k`` ranks on one node this is ``k``-rank synchronous SGD, bit for bit up to
summation order. The gradients *are* views into this rank's slot of the
shared window: after ``zero_grad()`` they are ``None``, and backward's
gradient is copied once into the slot by a hook on each parameter's gradient
accumulator (:mod:`hsgd._engine.binding`).

Gradient accumulation needs nothing special: backward never communicates, so
call ``backward()`` several times and ``step()`` once. With
``backward_passes_per_step=N`` the summed gradient is also divided by ``N``
(folded into the averaging), giving the mean over all ``N * world`` micro-batches.

Example::

    >>> model = Net()
    >>> opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    >>> for x, y in loader:
    ...     opt.zero_grad()
    ...     loss_fn(model(x), y).backward()
    ...     opt.synchronize()                            # optional: average now,
    ...     torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    ...     with opt.skip_synchronize():                 # then step without
    ...         opt.step()                               # averaging again
    >>> opt.close()

The wrapper is a ``torch.optim.Optimizer``: LR schedulers, ``GradScaler`` and
optimizer hooks take it directly (``StepLR(opt, 10)``; ``scaler.step(opt)``).
With a ``GradScaler``, ``scaler.step(opt)`` averages the scaled gradients with
each rank's own scale divided out, and steps only if the averages are finite,
on every rank alike. To clip, average first, then unscale the (identical)
averages::

    >>> scaler.scale(loss).backward()
    >>> opt.synchronize()
    >>> scaler.unscale_(opt)
    >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    >>> with opt.skip_synchronize():
    ...     scaler.step(opt)
    >>> scaler.update()
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .._engine.checks import check_int
from .._engine.mode import SyncMode

__all__ = ["HierarchicalSGD"]


class HierarchicalSGD(SyncMode):
    """Wraps ``optimizer`` so that every ``step()`` averages the gradients over all ranks.

    Args:
        optimizer, model, topology, inter_node, broadcast: see :class:`~hsgd._engine.mode.SyncMode`.
        backward_passes_per_step: divide the accumulated gradient by this.

    Construction is collective. It raises the same error on every rank if the
    ranks' models differ (names, shapes, dtypes) or the settings differ.
    """

    name = "sync"
    bind = "grad"
    balances = True
    config_fields = ("inter_node", "compression")

    def __init__(self, optimizer, model=None, *, named_parameters=None, topology=None, inter_node="leader",
                 compression=None, backward_passes_per_step=1, broadcast=True, stall_timeout=None,
                 stall_abort=None):
        self.backward_passes_per_step = backward_passes_per_step
        self._synchronized = False
        self._skip = False
        super().__init__(optimizer, model, named_parameters=named_parameters, topology=topology,
                         inter_node=inter_node, compression=compression, broadcast=broadcast,
                         settings={"backward_passes_per_step": backward_passes_per_step},
                         stall_timeout=stall_timeout, stall_abort=stall_abort)

    def _check(self, backward_passes_per_step) -> None:
        check_int("backward_passes_per_step", backward_passes_per_step)

    def synchronize(self) -> None:
        """Average the gradients over all ranks now. A second call before ``step()`` does nothing."""
        self._check_open()
        if self._synchronized:
            return
        self._binding.gather()
        # batch_shares: the average weights rank r by its batch; under GradScaler.step() each
        # rank's gradients are unscaled by its own loss scale before they are summed
        weight = self._weight("global") * self._amp_inverse_scale()
        if weight != 1.0:
            self._binding.scale_(weight)
        with self.stall.waiting(self.num_steps, "synchronize()"):
            self.averager.average("global", 1.0 / self.backward_passes_per_step)
        self._binding.scatter()
        self._synchronized = True

    def gradients_finite(self) -> bool:
        """Whether every averaged gradient is finite (no NaN or Inf). Call after
        :meth:`synchronize`: the averages are the same on every rank, so is the answer,
        and a caller may skip the step on every rank alike with no communication."""
        self._check_open()
        if not self._synchronized:
            raise RuntimeError("gradients_finite() before synchronize(): the gradients are not averaged yet")
        return all(bool(torch.isfinite(self.averager.own(seg)).all())
                   for seg in range(len(self.averager.layout.dtypes)))

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not average (call ``synchronize()`` first)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def _step(self) -> None:
        if self._skip and not self._synchronized:
            warnings.warn("step() inside skip_synchronize() without synchronize(): "
                          "each rank steps on its own gradients", stacklevel=3)
            self._unscale_local()
        elif not self._synchronized:
            self.synchronize()  # unscales too, under GradScaler.step()
        elif hasattr(self, "found_inf"):  # GradScaler.step() after synchronize()
            self._unscale_local()
        if hasattr(self, "found_inf") and self._synchronized:
            # the averages are the same on every rank: all step or all skip, with the scaler
            self._skip_inner = not self.gradients_finite()
        self._optimizer_step()
        self._synchronized = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: ``set_to_none=True`` (the default) sets the gradients to ``None``, and
        the next backward writes them straight into shared memory; ``False`` zeroes them in
        place, as views into shared memory (for code that writes into ``p.grad`` without a
        backward pass)."""
        self._check_open()
        self._synchronized = False
        self._binding.zero_(set_to_none)
