"""Load balancing for workers of different speed: per-rank batch sizes whose steps end together.

In synchronous SGD every step waits for the slowest rank. :class:`LoadBalancer` gives
each rank a batch size (its *share* of the unchanged global batch) such that all ranks
take equally long per step, and gives the optimizer the same ``batch_shares``, so a
gradient average weighted by batch is still exactly the gradient of the global batch.
``python -m hsgd.train --balance`` does this (docs/balancing.md). With a ``pad=True`` loader::

    >>> balancer = LoadBalancer(loader, opt)
    >>> balancer.calibrate(lambda b: loss_fn(model(x[:b]), y[:b]).backward())
    >>> for epoch in range(epochs):
    ...     loader.set_epoch(epoch)
    ...     busy = ...                              # this rank's seconds computing, not waiting
    ...     for batch in loader: ...
    ...     balancer.rebalance(busy, len(loader))   # the next epoch's shares
"""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

from ._core.agree import check_all
from ._core.checks import check_int
from .errors import InputValueError

if TYPE_CHECKING:  # at run time these import MPI and h5py
    from mpi4py import MPI

    from ._engine.mode import SyncMode
    from .parallel_io import ContiguousH5Loader

__all__ = ["LoadBalancer", "balanced_shares"]

#: Timed repetitions of each batch size in :meth:`LoadBalancer.calibrate` (their median counts).
CALIBRATION_REPEATS = 5
#: :meth:`LoadBalancer.rebalance` changes the shares only if the model predicts steps this much shorter.
HYSTERESIS = 0.05


def balanced_shares(fixed: Sequence[float], per_sample: Sequence[float], total: int) -> List[int]:
    """Integer batch sizes, at least 1 each and summing to ``total``, that make the
    step times ``fixed[r] + per_sample[r] * b[r]`` as equal as they can be.

    A rank whose fixed cost alone exceeds the others' step time gets 1 sample.
    Pure and deterministic: every rank computes the same shares from the same lists.
    """
    n = len(fixed)
    if n == 0 or len(per_sample) != n:
        raise InputValueError(f"balanced_shares needs one fixed and one per-sample cost per rank, "
                              f"got {len(fixed)} and {len(per_sample)}")
    check_int("total", total, minimum=n)
    if not all(math.isfinite(a) and a >= 0 for a in fixed) or \
            not all(math.isfinite(c) and c > 0 for c in per_sample):
        raise InputValueError(f"costs must be finite, fixed >= 0 and per-sample > 0; got fixed {list(fixed)}, "
                              f"per-sample {list(per_sample)}")

    def sizes(step_time: float) -> List[float]:
        return [max(1.0, (step_time - a) / c) for a, c in zip(fixed, per_sample)]

    lo = min(a + c for a, c in zip(fixed, per_sample))  # nobody beyond 1 sample: sum(sizes) <= total
    hi = max(a + c * total for a, c in zip(fixed, per_sample))  # everybody at total: sum >= total
    for _ in range(200):  # bisection on the common step time
        mid = (lo + hi) / 2
        if sum(sizes(mid)) < total:
            lo = mid
        else:
            hi = mid
    exact = sizes(hi)
    scale = total / sum(exact)  # closes the bisection's last gap
    exact = [max(1.0, b * scale) for b in exact]
    shares = [max(1, math.floor(b)) for b in exact]
    # Largest remainders first (ties to the lower rank) until the shares sum to total.
    order = sorted(range(n), key=lambda r: (shares[r] - exact[r], r))
    i = 0
    while sum(shares) < total:
        shares[order[i % n]] += 1
        i += 1
    order = sorted(range(n), key=lambda r: (exact[r] - shares[r], r))
    i = 0
    while sum(shares) > total:
        r = order[i % n]
        if shares[r] > 1:
            shares[r] -= 1
        i += 1
    return shares


class LoadBalancer:
    """Per-rank batch sizes for ``loader`` that equalize the ranks' step times; collective.

    Args:
        loader: a :class:`~hsgd.ContiguousH5Loader` with ``pad=True``; its
            ``set_shares`` takes effect at its next epoch.
        optimizer: a mode whose averages take ``batch_shares`` (:class:`~hsgd.HierarchicalSGD`,
            :class:`~hsgd.HierarchicalLocalSGD`); given the loader's shares whenever they change.
        comm: the ranks (default the loader's communicator).

    A rank's step time is modelled as ``a + c * b`` for batch ``b``: a fixed cost (kernel
    launches, the optimizer update, Python) plus a cost per sample. Samples per second
    alone would not do: with a fixed cost a smaller batch measures as fewer samples per
    second, and shares set in proportion to that drift apart epoch after epoch. So
    :meth:`calibrate` (collective, a short warm-up) times ``work(b)`` at two batch sizes
    and fits ``a`` and ``c``; ``balanced_shares`` finds the shares that equalize
    ``a_r + c_r * b_r`` (water-filling: one common step time, every rank at least one
    sample); :meth:`rebalance` (collective, between epochs) rescales each rank's ``a`` and
    ``c`` halfway (geometrically) towards measured over predicted, so a rank that slows
    down gets less within a few epochs while one noisy epoch moves little. The shares
    change only when the model predicts steps at least ``HYSTERESIS`` shorter. When the
    cost per sample dominates, the shares are in proportion to the ranks' speeds.
    """

    def __init__(self, loader: ContiguousH5Loader, optimizer: SyncMode, comm: Optional[MPI.Comm] = None) -> None:
        if not getattr(type(optimizer), "balances", False):
            raise InputValueError(f"{type(optimizer).__name__} does not weight ranks by batch size; "
                                  "load balancing needs HierarchicalSGD or HierarchicalLocalSGD")
        self.loader, self.optimizer = loader, optimizer
        self.comm = loader.comm if comm is None else comm
        self.total = loader.global_batch
        self.fixed: Optional[List[float]] = None  # every rank's model, after calibrate()
        self.per_sample: Optional[List[float]] = None
        self.apply_shares()

    @property
    def shares(self) -> List[int]:
        """The batch sizes of the loader's next epoch, one per rank."""
        return self.loader.batch_shares

    def apply_shares(self) -> None:
        """Give the optimizer the loader's shares (also after a resume, and the even split of a
        global batch that the rank count does not divide), to weight its averages."""
        shares = self.loader.batch_shares
        self.optimizer.batch_shares = shares if len(set(shares)) > 1 else None

    def calibrate(self, work: Callable[[int], object], repeats: int = CALIBRATION_REPEATS) -> List[int]:
        """Time ``work(b)`` (one step's computation on ``b`` samples, no communication) on
        every rank at the loader's ``batch_size`` and at a quarter of it, fit the step-time model and
        set balanced shares for the loader's next epoch; returns them. Collective.

        Mid-epoch (``loader.position > 0``, after a resume) the loader keeps its
        shares until the next :meth:`rebalance`.
        """
        check_int("repeats", repeats, minimum=1)
        big = self.loader.batch_size  # the mean batch, whatever the current shares
        small = max(1, big // 4)
        fit = check_all(self.comm, _time_work, work, small, big, repeats)
        models = self.comm.allgather(fit)
        self.fixed, self.per_sample = [m[0] for m in models], [m[1] for m in models]
        return self._set()

    def rebalance(self, busy_seconds: float, steps: int) -> List[int]:
        """Shares for the next epoch from this rank's ``busy_seconds`` over its last ``steps``
        steps (time computing, not waiting for the others). Collective; call between epochs."""
        fixed, per_sample = self._model("rebalance")
        size = self.loader.rank_batch_size  # the batch the time was measured at
        measured = busy_seconds / steps if steps > 0 and busy_seconds > 0 else None
        everyone = self.comm.allgather((size, measured))
        sizes = [b for b, _ in everyone]
        for r, (b, t) in enumerate(everyone):
            if t is not None and math.isfinite(t):
                # Halfway (geometrically) to the measurement: one noisy epoch moves little.
                scale = math.sqrt(t / (fixed[r] + per_sample[r] * b))
                fixed[r] *= scale
                per_sample[r] *= scale
        candidate = balanced_shares(fixed, per_sample, self.total)
        if self.step_time(candidate) > (1 - HYSTERESIS) * self.step_time(sizes):
            return sizes  # not worth a change: shares that stay put measure more cleanly
        return self._set(candidate)

    def step_time(self, shares: Sequence[int]) -> float:
        """The model's step time (the slowest rank's) for ``shares``, in seconds."""
        fixed, per_sample = self._model("step_time")
        return max(a + c * b for a, c, b in zip(fixed, per_sample, shares))

    def _model(self, what: str) -> Tuple[List[float], List[float]]:
        """``(fixed, per_sample)`` of every rank; raises ``RuntimeError`` before :meth:`calibrate`."""
        if self.fixed is None or self.per_sample is None:
            raise RuntimeError(f"LoadBalancer.{what} before calibrate(): the step-time model is unset")
        return self.fixed, self.per_sample

    def _set(self, shares: Optional[List[int]] = None) -> List[int]:
        if self.loader.position != 0:  # resumed mid-epoch: the saved shares finish the epoch
            return self.shares
        shares = shares or balanced_shares(*self._model("calibrate"), self.total)
        self.loader.set_shares(shares)
        self.apply_shares()
        return shares


def _time_work(work: Callable[[int], object], small: int, big: int, repeats: int) -> Tuple[float, float]:
    """The step-time model ``(fixed, per_sample)`` fitted to the median times of ``work(small)``
    and ``work(big)`` over ``repeats``, after one untimed call of each."""
    for size in (small, big):  # untimed: first-call costs (allocation, caching) out of the way
        work(size)
    times: Dict[int, List[float]] = {small: [], big: []}
    for _ in range(repeats):
        for size in (small, big):
            start = time.perf_counter()
            work(size)
            times[size].append(time.perf_counter() - start)
    return _fit(small, statistics.median(times[small]), big, statistics.median(times[big]))


def _fit(small: int, t_small: float, big: int, t_big: float) -> Tuple[float, float]:
    """``(a, c)`` of ``t = a + c * b`` through two timings, kept non-negative (c positive)."""
    if big == small or t_big <= t_small:  # one size, or noise: all of it per sample
        return 0.0, max(t_big, t_small, 1e-9) / big
    per_sample = (t_big - t_small) / (big - small)
    return max(0.0, t_small - per_sample * small), per_sample
