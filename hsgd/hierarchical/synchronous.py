"""``HierarchicalSGD``: synchronous SGD with any torch optimizer, averaged in two levels.

``step()`` averages the gradients over all ranks, inside the node through shared
memory and across nodes with MPI, then runs the inner step. With ``k`` ranks on one
node this is ``k``-rank synchronous SGD, bit for bit up to summation order. The
gradients *are* views into this rank's slot of the shared window: after
``zero_grad()`` they are ``None``, and backward's gradient is copied once into the
slot by a hook on each parameter's gradient accumulator (:mod:`hsgd._engine.binding`).

Gradient accumulation needs nothing special: backward never communicates (unless
``overlap=True``), so call ``backward()`` several times and ``step()`` once; with
``backward_passes_per_step=N`` the sum is also divided by ``N`` (folded into the
averaging), giving the mean over all ``N * world`` micro-batches. Usage, clipping and
``GradScaler``: the class docstring and docs/sync.md.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Iterator, List, Optional

import numpy as np
import torch
from mpi4py import MPI

from .._core.agree import collective_error
from .._core.settings import Boolean, Integer, Real, setting
from .._engine.torch_compat import leave_grad_scaler
from ..errors import InputValueError
from .engine import HierarchicalEngine, HierarchicalMode
from .overlap import BackwardOverlap

__all__ = ["HierarchicalSGD", "DEFAULT_BUCKET_MB"]

DEFAULT_BUCKET_MB = 25.0  # as DDP's bucket_cap_mb


class HierarchicalSGD(HierarchicalMode):
    """Wraps ``optimizer`` so that every ``step()`` averages the gradients over all ranks.

    Args:
        optimizer, model, topology, broadcast, stall: see :class:`~hsgd._engine.mode.SyncMode`.
        **settings: the fields of :class:`HierarchicalSGD.Settings` (``inter_node``,
            ``compression``, ``backward_passes_per_step``, ``overlap``, ``bucket_cap_mb``).

    With ``overlap=True`` the gradients are averaged in buckets while backward still runs
    (``hsgd.hierarchical.overlap``), the same averages as without. ``backward()`` then returns
    with the averages, as with DDP (clipping after it clips the average), is collective, and
    must run exactly ``backward_passes_per_step`` times per step (earlier passes inside
    :meth:`no_sync`); a ``GradScaler`` is refused. It pays only where averaging can run
    beside backward (docs/benchmarks.md).

    Construction is collective. It raises the same error on every rank if the
    ranks' models differ (names, shapes, dtypes) or the settings differ.

    With ``overlap=True`` each bucket of gradients is averaged as soon as every rank's
    backward produced it, and backward returns with the averages, so pass
    ``backward_passes_per_step`` or run the earlier passes inside :meth:`no_sync`.

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
    optimizer hooks take it directly (``StepLR(opt, 10)``; ``scaler.step(opt)``). With a
    ``GradScaler``, ``scaler.step(opt)`` averages the scaled gradients with each rank's own
    scale divided out, and steps only if the averages are finite, on every rank. To
    clip, average first, then unscale the (identical) averages::

        >>> scaler.scale(loss).backward()
        >>> opt.synchronize()
        >>> scaler.unscale_(opt)
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> with opt.skip_synchronize():
        ...     scaler.step(opt)
        >>> scaler.update()
    """

    @dataclass(frozen=True)
    class Settings(HierarchicalMode.Settings):
        """:class:`HierarchicalSGD`'s settings."""

        backward_passes_per_step: int = setting(
            1, "divide the accumulated gradient by this (with overlap, also the backward passes after which "
               "a gradient is final)", Integer(), flag=None)
        overlap: bool = setting(False, "average the gradients in buckets while backward still runs "
                                       "(HierarchicalSGD(overlap=True)); docs/benchmarks.md says where it pays",
                                Boolean())
        bucket_cap_mb: float = setting(DEFAULT_BUCKET_MB, "--overlap: bucket size in MiB (the first bucket is 1 MiB "
                                                          "at most)",
                                       Real(0, open_low=True, finite=True, hint=f"(MiB; default {DEFAULT_BUCKET_MB})"))

    settings: Settings
    name = "sync"
    bind = "grad"
    balances = True
    finite_guard = True
    _synchronized = False
    _skip = False

    def _make_engine(self, params: List[torch.nn.Parameter]) -> HierarchicalEngine:
        with contextlib.ExitStack() as undo:  # if the overlap fails to start: free the engine
            engine = super()._make_engine(params)
            undo.callback(engine.close)
            if self.settings.overlap:
                if not all(engine.binding.zero_copy) and MPI.Query_thread() < MPI.THREAD_SERIALIZED:
                    raise collective_error(InputValueError, (
                        "overlap=True with parameters on a GPU averages from autograd's device threads, "
                        "which needs MPI initialized with MPI_THREAD_SERIALIZED or more (mpi4py's default, "
                        "mpi4py.rc.thread_level = 'multiple'); or pass overlap=False"))
                engine.start_overlap(bucket_cap_mb=self.settings.bucket_cap_mb,
                                     passes=self.settings.backward_passes_per_step,
                                     weight=lambda: self.step_weight("global"),
                                     waiting=lambda what, count=True: self.stall.waiting(self.num_steps, what,
                                                                                         count))
            undo.pop_all()
        return engine

    @property
    def _overlap(self) -> Optional[BackwardOverlap]:
        return self.engine.overlap

    def synchronize(self) -> None:
        """Average the gradients over all ranks now. A second call before ``step()`` does nothing."""
        self._check_open()
        if self._synchronized:
            return
        if self._overlap is not None:
            self._finish_overlap()
            return
        # batch_shares: the average weights rank r by its batch; under GradScaler.step() each
        # rank's gradients are unscaled by its own loss scale before they are summed
        with self.stall.waiting(self.num_steps, "synchronize()"):
            self.engine.average_bound("global", self.step_weight("global"), self.settings.backward_passes_per_step)
        self._synchronized = True

    def _finish_overlap(self) -> None:
        """``synchronize()`` with ``overlap=True``: backward has averaged (or, on a rank whose
        backward reached no parameter, average now); agree whether a gradient came too late."""
        overlap = self._overlap
        assert overlap is not None  # called with overlap=True only
        with self.stall.waiting(self.num_steps, "synchronize()"):
            overrun = np.array([overlap.consume()], dtype=np.int8)
            self.topology.comm.Allreduce(MPI.IN_PLACE, overrun, op=MPI.MAX)
        self._synchronized = True
        if overrun[0]:
            raise collective_error(InputValueError, (
                f"with overlap=True a backward pass ran after the average of the "
                f"backward_passes_per_step={self.settings.backward_passes_per_step} before it and before "
                "step(): its gradients are not averaged. Pass backward_passes_per_step=<backward "
                "passes per step>, or run the earlier passes inside opt.no_sync()"))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block backward does not average (``overlap=True``): the gradients
        accumulate on this rank, to be averaged by the next backward outside the block or by
        ``synchronize()``/``step()``, as in DDP's ``no_sync()``. Without overlap backward never
        averages, and this changes nothing."""
        self._check_open()
        if self._overlap is None:
            yield
            return
        self._overlap.paused = True
        try:
            yield
        finally:
            self._overlap.paused = False

    def gradients_finite(self) -> bool:
        """Whether every averaged gradient is finite (no NaN or Inf). Call after
        :meth:`synchronize`: the averages are the same on every rank, so is the answer,
        and a caller may skip the step on every rank with no communication."""
        self._check_open()
        if not self._synchronized:
            raise RuntimeError("gradients_finite() before synchronize(): the gradients are not averaged yet")
        # the codec's error feedback asked the same of this round's averages (settle()): one scan
        # answers both, so a step skipped here is one whose feedback was dropped
        known = self.averager.finite
        if known is not None:
            return known
        return all(bool(torch.isfinite(self.averager.own(seg)).all())
                   for seg in range(len(self.averager.layout.dtypes)))

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not average (call ``synchronize()`` first)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def _step(self) -> None:
        """Average unless averaged already (``synchronize()``, or backward with overlap) or told
        not to (``skip_synchronize()``); under ``GradScaler.step()`` unscale what was not, and
        step only on finite averages; then the inner step."""
        if self._overlap is not None and self._under_scaler:
            leave_grad_scaler(self)  # GradScaler removes its attributes only after a step
            raise InputValueError("with overlap=True backward averages the gradients before "
                                  "GradScaler.step() tells their loss scale; use a GradScaler with "
                                  "overlap=False")
        # with overlap, backward averaged already: skip_synchronize() has nothing to skip
        skipped = self._skip and self._overlap is None and not self._synchronized
        if skipped:
            warnings.warn("step() inside skip_synchronize() without synchronize(): "
                          "each rank steps on its own gradients", stacklevel=3)
        if self._synchronized or skipped:
            self._unscale_local()  # under GradScaler.step(): not averaged under its loss scale
        else:
            self.synchronize()  # weighted by the loss scale, under GradScaler.step()
        if self._under_scaler and self._synchronized:
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
        if self._overlap is not None:  # a backward with no step: end its averaging as the others do
            with self.stall.waiting(self.num_steps, "zero_grad()"):
                self._overlap.discard()
        self._synchronized = False
        self._binding.zero_(set_to_none)
