"""Which samples each rank reads in an epoch, and in which order: pure arithmetic.

Many small scattered reads make training input slow on parallel file systems (the
HSGD paper's I/O argument): :func:`plan_epoch` turns an epoch into a short list of
large contiguous reads per rank, the sample order random.

Invariants: a plan is a pure function of its arguments, so every rank computes every
rank's plan without talking to the others, and tests simulate any world size in one
process. A training plan (``pad=True``) is world-size independent: the epoch's order of
samples, cut into global batches of ``G = sum(shares)``, depends on the data, ``G``,
the seed, the epoch and the block and window sizes only, never on the ranks; a rank
takes a slice of each global batch, fixed by the shares of the world at that moment.
So a run stopped after ``k`` global batches goes on at any rank count from batch ``k``,
and every sample is used once per epoch (``drop_last=True`` drops the last ``N mod G``
stream positions, ``drop_last=False`` wraps around to the stream's start). ``pad=False``
(evaluation): contiguous shards, every sample exactly once, counts differing by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from .._core.checks import check_int, check_shares
from ..errors import InputValueError

__all__ = ["EpochPlan", "plan_epoch", "check_plan", "epoch_batches", "even_shares", "window_batches",
           "shard_range", "default_block_size", "default_window_blocks", "DEFAULT_BLOCK_BYTES"]

DEFAULT_BLOCK_BYTES = 4 << 20
DEFAULT_WINDOW_BYTES = 16 << 20


def default_block_size(sample_bytes: int, chunk_rows=None,
                       target_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    """Samples per block: about ``target_bytes``, a multiple of ``chunk_rows``.

    Aligning blocks to the HDF5 chunk layout means no chunk is read (and, when
    compressed, decompressed) by two reads.
    """
    rows = max(1, target_bytes // max(1, int(sample_bytes)))
    if chunk_rows:
        rows = max(1, round(rows / chunk_rows)) * int(chunk_rows)
    return int(rows)


def default_window_blocks(block_size: int, sample_bytes: int, min_samples: int = 1024,
                          max_bytes: int = DEFAULT_WINDOW_BYTES) -> int:
    """Blocks shuffled together: the fewest that hold ``min_samples`` samples,
    but at most ``max_bytes`` (and at least one block).

    The shuffle gathers random rows from the window; a window that outgrows
    the CPU caches makes that gather several times slower (measured: 10 GB/s
    at 4 MiB, 2-6 GB/s at 16-64 MiB for 160-byte rows), while ~1000 samples
    already mix a pre-shuffled file well (WebDataset's and FFCV's
    quasi-random defaults are of that order).
    """
    wanted = -(-min_samples // block_size)
    cap = max(1, max_bytes // max(1, block_size * sample_bytes))
    return int(max(1, min(wanted, cap)))


def shard_range(num_samples: int, world_size: int, rank: int) -> Tuple[int, int]:
    """Rank ``rank``'s contiguous ``(start, stop)`` in an even split of ``num_samples``.

    The shards cover every sample exactly once; sizes differ by at most one.
    """
    return (rank * num_samples // world_size,
            (rank + 1) * num_samples // world_size)


def _check_counts(num_samples, world_size, batch_size) -> None:
    for name, value in (("num_samples", num_samples), ("world_size", world_size),
                        ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputValueError(f"Invalid {name}: {value!r}; it must be a positive integer")


def even_shares(global_batch: int, world_size: int) -> List[int]:
    """The default split of a global batch over ``world_size`` ranks: as even as it can be, the
    first ``global_batch mod world_size`` ranks taking one sample more (``[43, 43, 43, 43, 42, 42]``
    for 256 over 6)."""
    check_int("world_size", world_size, 1)
    check_int("global_batch", global_batch, world_size)
    return [global_batch // world_size + (r < global_batch % world_size) for r in range(world_size)]


def epoch_batches(num_samples: int, global_batch: int, drop_last: bool = True) -> int:
    """Global batches in an epoch: ``N // G`` (``drop_last``), else ``ceil(N / G)``."""
    return num_samples // global_batch if drop_last else -(-num_samples // global_batch)


def window_batches(global_batch: int, block_size: int, window_blocks: int) -> int:
    """Global batches per window: the fewest whose samples fill ``window_blocks`` blocks (at
    least one). The ranks' reads and the shuffle go a window at a time; the window depends on
    the global batch, never on the rank count."""
    return max(1, -(-window_blocks * block_size // global_batch))


def check_plan(num_samples: int, world_size: int, rank: int, batch_size: int, drop_last: bool = True,
               pad: bool = True, shares=None) -> List[int]:
    """Check a plan's counts; returns the per-rank shares (``[batch_size] * world_size``
    without ``shares``). A training plan (``pad``) needs one global batch of samples;
    ``pad=False`` (evaluation, with ``drop_last=False``) needs nothing more."""
    _check_counts(num_samples, world_size, batch_size)
    if not 0 <= rank < world_size:
        raise InputValueError(f"Invalid rank: {rank}; it must be in [0, {world_size})")
    uniform = shares is None
    shares = [batch_size] * world_size if uniform else list(shares)
    check_shares(shares, world_size)
    if not pad:
        if drop_last:
            raise InputValueError("pad=False only applies with drop_last=False; "
                                  "set drop_last=False for an every-sample-once pass")
        if not uniform:
            raise InputValueError("per-rank batch shares need pad=True (equal batch counts on every rank)")
        return shares
    if num_samples < sum(shares):
        raise InputValueError(
            f"{num_samples} samples are fewer than world_size x batch_size = "
            f"{world_size} x {batch_size} = {sum(shares)} needed for one batch "
            f"per rank; use batch_size <= {num_samples // world_size} or fewer ranks" if uniform else
            f"{num_samples} samples are fewer than the global batch of {sum(shares)} (batch shares {shares}); "
            f"use a smaller batch or more data")
    return shares


def _block_order(num_samples, block_size, shuffle, seed, epoch):
    """The epoch's block permutation and stream rotation, the same on every rank."""
    num_blocks = -(-num_samples // block_size)
    if not shuffle:
        return np.arange(num_blocks, dtype=np.int64), 0
    rng = np.random.default_rng([seed, epoch])
    return rng.permutation(num_blocks).astype(np.int64), int(rng.integers(num_samples))


def _stream_segments(num_samples, block_size, order, offset, start, count):
    """File row ranges ``(k, 2)`` that hold stream positions ``[start, start + count)``."""
    lengths = np.minimum(block_size, num_samples - order * block_size)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    pieces = []
    pos = (start + offset) % num_samples
    while count > 0:
        stop = min(num_samples, pos + count)
        i0 = np.searchsorted(ends, pos, side="right")
        i1 = np.searchsorted(starts, stop, side="left")
        base = order[i0:i1] * block_size - starts[i0:i1]
        lo = np.maximum(starts[i0:i1], pos) + base
        hi = np.minimum(ends[i0:i1], stop) + base
        pieces.append(np.stack([lo, hi], axis=1))
        count -= stop - pos
        pos = 0
    if not pieces:
        return np.empty((0, 2), dtype=np.int64)
    return np.concatenate(pieces).astype(np.int64)


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """One rank's reads and sample order for one epoch (see the module docstring).

    Attributes:
        segments: ``(k, 2)`` int64 file row ranges ``[start, stop)`` in read order.
        window_bounds: ``(w + 1,)`` segment indices: window ``i`` is
            ``segments[window_bounds[i]:window_bounds[i + 1]]``.
        batch_size: this rank's batch (its share of the global batch).
        shuffle: as given to :func:`plan_epoch`.
        key: ``(seed, epoch, rank)``, the seed of the in-window shuffles.
        lanes: ``(first slot, global batch)`` of a shuffled training plan, whose windows are
            laid out in lanes (:func:`plan_epoch`, step 4); ``None`` otherwise.
    """

    segments: np.ndarray
    window_bounds: np.ndarray
    batch_size: int
    shuffle: bool
    key: Tuple[int, int, int]
    lanes: Optional[Tuple[int, int]] = None

    @property
    def num_samples(self) -> int:
        """Samples this rank yields in the epoch."""
        return int((self.segments[:, 1] - self.segments[:, 0]).sum())

    @property
    def num_batches(self) -> int:
        return -(-self.num_samples // self.batch_size)

    @property
    def num_windows(self) -> int:
        return len(self.window_bounds) - 1

    def window_segments(self, window: int) -> np.ndarray:
        lo, hi = self.window_bounds[window], self.window_bounds[window + 1]
        return self.segments[lo:hi]

    def window_size(self, window: int) -> int:
        segs = self.window_segments(window)
        return int((segs[:, 1] - segs[:, 0]).sum())

    def window_order(self, window: int) -> np.ndarray:
        """Positions in the window's read buffer, in yield order.

        Lanes: batch ``j`` of the window takes, from every lane ``t`` of this rank, its
        element ``sigma_t(j)``; ``sigma`` is row ``t`` of a key matrix drawn for the whole
        window from ``(seed, epoch, window)`` (the same at every rank count). Otherwise
        ``torch.randperm`` (faster than numpy's permutation, which cost more than reading the
        window) seeded from ``(seed, epoch, rank, window)``, or read order without shuffle.
        """
        size = self.window_size(window)
        if not self.shuffle:
            return np.arange(size, dtype=np.int64)
        if self.lanes is not None:
            first, global_batch = self.lanes
            share, batches = self.batch_size, size // self.batch_size
            keys = torch.rand((global_batch, batches), dtype=torch.float64,
                              generator=_generator(self.key[0], self.key[1], window))[first:first + share]
            sigma = torch.argsort(keys, dim=1, stable=True) + torch.arange(share).unsqueeze(1) * batches
            return sigma.t().reshape(-1).numpy()
        generator = _generator(*self.key, window)
        return torch.randperm(size, generator=generator).numpy()

    def window_indices(self, window: int, order=None) -> np.ndarray:
        """Global sample indices of the window, in yield order (``order``: its
        :meth:`window_order`, if already computed)."""
        segs = self.window_segments(window)
        rows = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in segs])
        return rows[self.window_order(window) if order is None else order]

    def indices(self) -> np.ndarray:
        """Every global sample index this rank yields in the epoch, in order."""
        if self.num_windows == 0:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([self.window_indices(w) for w in range(self.num_windows)])

    def locate(self, batch: int) -> Tuple[int, int]:
        """``(window, skip)``: batch ``batch`` starts ``skip`` samples into ``window``."""
        if not 0 <= batch <= self.num_batches:
            raise InputValueError(f"Invalid batch position {batch}; this epoch has "
                                  f"{self.num_batches} batches")
        position = batch * self.batch_size
        sizes = [self.window_size(w) for w in range(self.num_windows)]
        window = int(np.searchsorted(np.cumsum(sizes), position, side="right"))
        return window, position - int(sum(sizes[:window]))


def _generator(*key: int) -> torch.Generator:
    seed = np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(seed))


def plan_epoch(num_samples: int, world_size: int, rank: int, batch_size: int,
               block_size: int, seed: int = 0, epoch: int = 0, drop_last: bool = True,
               *, shuffle: bool = True, pad: bool = True,
               window_blocks: int = 4, shares=None) -> EpochPlan:
    """Plan rank ``rank``'s reads and sample order for ``epoch``, in four steps.

    1. **Blocks.** The samples are cut into blocks of ``block_size`` consecutive samples
       (the last block may be shorter).
    2. **Stream.** Each epoch the blocks are permuted by a generator seeded with
       ``(seed, epoch)`` (the same on every rank), laid end to end, and the result is
       rotated by a random sample offset, so that rank boundaries move between epochs
       even when there are only a few blocks. ``shuffle=False`` keeps file order and no
       rotation.
    3. **Global batches.** Rank ``r`` takes ``shares[r]`` samples of every global batch
       (default ``batch_size`` each), the global batch being ``G = sum(shares)``; an epoch
       has :func:`epoch_batches` of them, and the stream is cut into windows of
       :func:`window_batches` global batches.
    4. **Lanes.** A window of ``m`` global batches is ``G`` lanes of ``m`` consecutive stream
       positions; global batch ``j`` of the window takes one sample of every lane, lane
       ``t``'s ``sigma_t(j)``-th (:meth:`EpochPlan.window_order`), and rank ``r`` takes
       lanes ``sum(shares[:r])`` to ``sum(shares[:r + 1])``: one contiguous range of the
       stream, read in a few segments, each inside one block. Which samples form a global
       batch depends neither on ``world_size`` nor on the shares. ``shuffle=False``: global
       batch ``k`` is stream positions ``[kG, (k + 1)G)``, file order. ``pad=False``
       (evaluation): rank ``r`` reads :func:`shard_range`, ``window_blocks`` blocks at a time,
       shuffled with ``torch.randperm`` seeded from ``(seed, epoch, rank, window)``.

    Example::

        >>> plan = plan_epoch(103, world_size=3, rank=1, batch_size=4, block_size=10)
        >>> plan.num_batches, len(plan.segments) <= 5
        (8, True)
    """
    for name, value, minimum in (("block_size", block_size, 1), ("window_blocks", window_blocks, 1),
                                 ("seed", seed, 0), ("epoch", epoch, 0)):
        check_int(name, value, minimum)
    shares = check_plan(num_samples, world_size, rank, batch_size, drop_last, pad, shares)
    order, offset = _block_order(num_samples, block_size, shuffle, seed, epoch)
    key = (int(seed), int(epoch), int(rank))
    if not pad:
        start, stop = shard_range(num_samples, world_size, rank)
        segments = _stream_segments(num_samples, block_size, order, offset, start, stop - start)
        bounds = np.unique(np.r_[np.arange(0, len(segments), window_blocks), len(segments)])
        return EpochPlan(segments, bounds.astype(np.int64), int(batch_size), bool(shuffle), key)
    global_batch, first, share = sum(shares), sum(shares[:rank]), shares[rank]
    batches = epoch_batches(num_samples, global_batch, drop_last)
    per_window = window_batches(global_batch, block_size, window_blocks)
    pieces: List[np.ndarray] = []
    ends = [0]  # segment index at which each window ends
    for w0 in range(0, batches, per_window):
        m, base = min(per_window, batches - w0), w0 * global_batch
        if shuffle:  # this rank's lanes: one range of the stream
            ranges = [(base + first * m, share * m)]
        else:  # file order: this rank's slice of each global batch
            ranges = [(base + j * global_batch + first, share) for j in range(m)]
        window = [_stream_segments(num_samples, block_size, order, offset, a, n) for a, n in ranges]
        pieces += window
        ends.append(ends[-1] + sum(len(piece) for piece in window))
    segments = np.concatenate(pieces) if pieces else np.empty((0, 2), dtype=np.int64)
    return EpochPlan(segments, np.asarray(ends, dtype=np.int64), int(share), bool(shuffle), key,
                     (first, global_batch) if shuffle else None)
