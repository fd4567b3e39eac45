"""Which samples each rank reads in an epoch, and in which order: pure arithmetic.

Many small scattered reads make training input slow on parallel file systems (the
HSGD paper's I/O argument): :func:`plan_epoch` turns an epoch into a short list of
large contiguous reads per rank, the sample order random, every rank's batch count equal.

Invariants: a plan is a pure function of ``(num_samples, world_size, rank,
batch_size, block_size, seed, epoch, ...)``, so every rank computes every rank's plan
without talking to the others, and tests can simulate any world size in one process.
Over an epoch the ranks' samples together are a permutation of the data set, except
for the remainder: ``drop_last=True`` drops the last ``N - world_size * n`` stream
positions (different samples every epoch); ``drop_last=False`` wraps around, so the
stream's first ``world_size * n - N`` samples are seen twice; ``pad=False``
(evaluation) gives every sample exactly once and lets ranks' counts differ by at most
one sample, hence one batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np
import torch

from .._core.checks import check_int, check_shares
from ..errors import InputValueError

__all__ = ["EpochPlan", "plan_epoch", "rank_range", "shard_range",
           "default_block_size", "default_window_blocks", "DEFAULT_BLOCK_BYTES"]

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


def rank_range(num_samples: int, world_size: int, rank: int, batch_size: int,
               drop_last: bool = True, pad: bool = True, shares=None) -> Tuple[int, int]:
    """Rank ``rank``'s ``(start, count)`` in the epoch's sample stream.

    ``drop_last=True``: ``count = (N // (W * B)) * B`` on every rank.
    ``drop_last=False``: ``count = ceil(N / (W * B)) * B`` on every rank; the
    stream wraps around. Both need ``N >= W * B``. ``pad=False`` (only with
    ``drop_last=False``): :func:`shard_range`, every sample exactly once.
    ``shares``: one batch size per rank instead of ``B`` on every rank (load
    balancing); the global batch is ``sum(shares)``, and every rank still has
    the same number of batches, ``N // sum(shares)`` (or its ceiling).
    """
    _check_counts(num_samples, world_size, batch_size)
    if not 0 <= rank < world_size:
        raise InputValueError(f"Invalid rank: {rank}; it must be in [0, {world_size})")
    if shares is not None:
        check_shares(shares, world_size)
        if not pad:
            raise InputValueError("per-rank batch shares need pad=True (equal batch counts on every rank)")
    if not pad:
        if drop_last:
            raise InputValueError("pad=False only applies with drop_last=False; "
                                  "set drop_last=False for an every-sample-once pass")
        start, stop = shard_range(num_samples, world_size, rank)
        return start, stop - start
    uniform = shares is None
    shares = [batch_size] * world_size if uniform else list(shares)
    global_batch = sum(shares)
    if num_samples < global_batch:
        raise InputValueError(
            f"{num_samples} samples are fewer than world_size x batch_size = "
            f"{world_size} x {batch_size} = {global_batch} needed for one batch "
            f"per rank; use batch_size <= {num_samples // world_size} or fewer ranks" if uniform else
            f"{num_samples} samples are fewer than the {global_batch} of one batch per rank with "
            f"batch shares {shares}")
    batches = (num_samples // global_batch if drop_last
               else -(-num_samples // global_batch))
    return batches * sum(shares[:rank]), batches * shares[rank]


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
        batch_size, shuffle: as given to :func:`plan_epoch`.
        key: ``(seed, epoch, rank)``, the seed of the in-window shuffles.
    """

    segments: np.ndarray
    window_bounds: np.ndarray
    batch_size: int
    shuffle: bool
    key: Tuple[int, int, int]

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

        ``torch.randperm`` (faster than numpy's permutation, which cost more than reading
        the window) seeded from ``(seed, epoch, rank, window)``.
        """
        size = self.window_size(window)
        if not self.shuffle:
            return np.arange(size, dtype=np.int64)
        seed = np.random.SeedSequence([*self.key, window]).generate_state(1, np.uint64)[0]
        generator = torch.Generator().manual_seed(int(seed))
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
    3. **Dealing.** Rank ``r`` takes the contiguous stream range ``[r * n, (r + 1) * n)``;
       every rank gets the same ``n``, a multiple of ``batch_size`` (:func:`rank_range`).
       The range becomes *segments*: file row ranges, each inside one block, one read
       each. Only the ends of a rank's range, the rotation point and the data set's short
       last block give segments shorter than a block.
    4. **Windows.** A rank's segments are grouped ``window_blocks`` at a time. A window is
       read, its samples are shuffled (``torch.randperm`` seeded with ``(seed, epoch,
       rank, window)``), and the result is cut into batches; a batch may span two
       windows. The loader's default window is the fewest blocks that hold 1024 samples,
       at most 16 MiB (:func:`default_window_blocks`).

    Example::

        >>> plan = plan_epoch(103, world_size=3, rank=1, batch_size=4, block_size=10)
        >>> plan.num_batches, len(plan.segments) <= 5
        (8, True)
    """
    for name, value, minimum in (("block_size", block_size, 1), ("window_blocks", window_blocks, 1),
                                 ("seed", seed, 0), ("epoch", epoch, 0)):
        check_int(name, value, minimum)
    start, count = rank_range(num_samples, world_size, rank, batch_size, drop_last, pad, shares)
    batch_size = batch_size if shares is None else int(shares[rank])
    order, offset = _block_order(num_samples, block_size, shuffle, seed, epoch)
    segments = _stream_segments(num_samples, block_size, order, offset, start, count)
    bounds = np.unique(np.r_[np.arange(0, len(segments), window_blocks), len(segments)])
    return EpochPlan(segments, bounds.astype(np.int64), int(batch_size), bool(shuffle),
                     (int(seed), int(epoch), int(rank)))
