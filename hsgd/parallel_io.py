"""Parallel training input from one HDF5 file: large contiguous reads, random order.

A map-style ``Dataset`` reading ``f["x"][i]`` behind a random sampler issues one small
scattered read per sample, which stalls training on parallel file systems.
:class:`ContiguousH5Loader` reads each rank's share of an epoch as a few large
contiguous row ranges and shuffles in memory instead (the HSGD paper's I/O design).
The in-memory shuffle spans a window, not the data set, so the file itself should
be in random order: ``python -m hsgd.data convert`` writes it so.

Invariants: every rank yields exactly ``len(loader)`` batches (except the evaluation
mode, ``drop_last=False, pad=False``); which samples form each global batch depends on
``(seed, epoch)`` and the global batch, not on the rank count, so a saved position
continues at any rank count; batches are views that stay valid as long as they are kept;
the loader is stateful (:attr:`~ContiguousH5Loader.position`, ``state_dict``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._core.agree import agree, attempt, check_all
from ._core.checks import check_int, check_shares
from ._io.loader_setup import check_settings_agree, loader_block_size, open_checked, scan_labels
from ._io.plan import EpochPlan, default_block_size, epoch_batches, even_shares, plan_epoch, shard_range
from ._io.prefetch import Prefetcher, iter_windows
from .errors import InputValueError

if TYPE_CHECKING:  # importing mpi4py.MPI initializes MPI: not at import time
    import os

    import torch
    from mpi4py import MPI

    from ._io.h5source import H5Source
    from .topology import Topology

__all__ = ["ContiguousH5Loader", "EpochPlan", "plan_epoch", "shard_range",
           "default_block_size", "loader_block_size"]

logger = logging.getLogger(__name__)

# What fixes the order of the global batches; the rank count and the per-rank batch do not.
_ORDER_KEYS = ("num_samples", "global_batch", "block_size", "seed", "shuffle", "drop_last", "pad", "window_blocks")


def _resolve_comm(comm, topology):
    if comm is not None and topology is not None:
        raise InputValueError("pass comm or topology, not both")
    if topology is not None:
        return topology.comm
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    return comm


class ContiguousH5Loader:
    """Batches of ``(x, y)`` read from HDF5 in large contiguous blocks.

    The data set is cut into blocks of ``block_size`` consecutive samples. Each epoch the
    blocks are permuted the same way on every rank (seeded by ``seed`` and the epoch), and
    the permuted stream is cut into global batches, whose samples do not depend on the rank
    count; each rank takes its share of every global batch, a slice of one contiguous
    stream range per window of ``window_blocks`` blocks (:mod:`hsgd._io.plan`,
    ``plan_epoch``). A rank reads each of its blocks with one contiguous read into a
    preallocated buffer (``os.preadv`` at the data's file offset when the data set is
    uncompressed, h5py's ``read_direct`` otherwise), in a background thread ``prefetch``
    windows ahead, and shuffles in memory. The file is opened read-only by every rank with
    the ordinary h5py; chunked, contiguous and compressed data sets all work.

    Remainder: ``drop_last=True`` drops ``N mod global_batch`` samples (a different
    set every epoch); ``drop_last=False`` pads by wrapping around to the stream's start.
    ``drop_last=False, pad=False`` is the evaluation mode: every sample exactly once,
    contiguous shards, and batch counts that may differ by one between ranks, so reduce
    results once after the loop, never per batch.

    Batches are ``(x, y)`` (``(x, y, idx)`` with ``return_indices=True``): x in the file's
    dtype and sample shape, y and the global sample indices idx as int64. Labels are one
    integer per sample, ``(N,)``, or one per position, ``(N, *label_shape)`` (the
    next-token targets of ``python -m hsgd.data text``); ``sample_shape`` and
    ``label_shape`` say which. Batches are views of per-window arrays, and an array is
    refilled only once every batch of it has been released.

    Like a checkpointable sampler, iteration continues from :attr:`position` (the batches
    of the current epoch handed out so far), a finished epoch moves on to the next by
    itself, and :meth:`state_dict` / :meth:`load_state_dict` save and restore that place,
    also into a loader over another number of ranks (with the same global batch).

    Example::

        with ContiguousH5Loader("mnist1d.h5", "x_train", "y_train", batch_size=64) as loader:
            loader.load_state_dict(checkpoint["loader"])      # when resuming
            for epoch in range(start_epoch, epochs):
                loader.set_epoch(epoch)          # keeps the position after a resume
                for x, y in loader:              # len(loader) batches on every rank
                    ...
                checkpoint["loader"] = loader.state_dict()

        # evaluation: every test sample exactly once, reduced after the loop
        with ContiguousH5Loader("mnist1d.h5", "x_test", "y_test", batch_size=256,
                                shuffle=False, drop_last=False, pad=False) as test:
            correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in test)
        correct = comm.allreduce(correct)

    Args:
        path, x_key, y_key: the file and the sample and label data sets (paths
            inside the file such as ``"train/x"`` work).
        batch_size: samples per batch on each rank (the global batch is ``world_size`` times it).
        global_batch: instead of ``batch_size``: samples per batch on all ranks together, split
            as evenly as it goes (the first ``global_batch mod world_size`` ranks take one
            more; :attr:`batch_shares`); ``batch_size`` is then the smallest share.
        comm, topology: the ranks that share the epoch (default
            ``MPI.COMM_WORLD``; a single process is a world of one). The
            constructor is collective over them; nothing else is.
        shuffle, seed: random block and sample order, the same on every rank
            for a given ``(seed, epoch)``; ``shuffle=False`` keeps file order.
        block_size: samples per contiguous read (default: about 4 MiB,
            aligned to the chunk rows).
        window_blocks: blocks of the stream shuffled together (default: the
            fewest holding 1024 samples, at most 16 MiB; see
            :func:`~hsgd._io.plan.default_window_blocks`); a rank holds its share of them.
        drop_last, pad: the remainder rule (above).
        prefetch: windows read ahead in a background thread (0: no thread).
        return_indices: also yield the int64 global sample indices per batch.
        check_labels: scan the labels once for negative values (each rank
            scans ``1 / world_size`` of them).
        direct_reads: read uncompressed data sets with ``os.preadv`` at their
            file offsets (faster, releases the GIL; :mod:`hsgd._io.h5source`);
            ``False`` reads everything through h5py.
    """

    def __init__(self, path: Union[str, os.PathLike[str]], x_key: str = "x", y_key: str = "y", *,
                 batch_size: Optional[int] = None, global_batch: Optional[int] = None,
                 comm: Optional[MPI.Comm] = None, topology: Optional[Topology] = None,
                 shuffle: bool = True, seed: int = 0, block_size: Optional[int] = None,
                 window_blocks: Optional[int] = None, drop_last: bool = True, pad: bool = True,
                 prefetch: int = 2, return_indices: bool = False, check_labels: bool = True,
                 direct_reads: bool = True) -> None:
        self.comm = _resolve_comm(comm, topology)
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.path, self.x_key, self.y_key = path, x_key, y_key
        self.shuffle, self.seed = shuffle, seed
        self.drop_last, self.pad = drop_last, pad
        self.prefetch, self.return_indices = prefetch, return_indices
        self.direct_reads = direct_reads
        # a bad file or argument: raised on every rank by agree, after this rank closed its file
        opened, error = attempt(open_checked, self, batch_size, global_batch, block_size, window_blocks)
        self._source: Optional[H5Source] = None
        self.batch_size: int
        self.global_batch: int
        self.block_size: int
        self.window_blocks: int
        if opened is not None:  # else agree() raises: the object is never used
            self._source, (self.batch_size, self.global_batch), self.block_size, self.window_blocks = opened
        try:
            agree(self.comm, error)
            assert self._source is not None  # opened, since no rank had an error
            self.num_samples = len(self._source.y)  # the data set's, not this rank's share
            self.sample_shape = self._source.sample_shape
            self.label_shape = self._source.label_shape
            check_settings_agree(self.comm, self._settings())
            if check_labels:
                check_all(self.comm, scan_labels, self._source, self.y_key,
                          *shard_range(self.num_samples, self.world_size, self.rank))
        except Exception:
            self._close_source()
            raise
        self._epoch, self._position = 0, 0
        self._active: Optional[Prefetcher] = None
        self._shares: Optional[List[int]] = None
        logger.debug("rank %d: %s samples of %s, block %d, %d batches per epoch",
                     self.rank, self.num_samples, path, self.block_size, len(self))

    @property
    def epoch(self) -> int:
        """The epoch that the next iteration reads (0-based; :meth:`set_epoch` sets it)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Batches of the current epoch already handed out."""
        return self._position

    def _settings(self) -> Dict[str, Any]:
        return {"num_samples": self.num_samples, "world_size": self.world_size,
                "batch_size": self.batch_size, "global_batch": self.global_batch, "block_size": self.block_size,
                "seed": self.seed, "shuffle": bool(self.shuffle),
                "drop_last": bool(self.drop_last), "pad": bool(self.pad),
                "window_blocks": self.window_blocks}

    @property
    def shares(self) -> Optional[List[int]]:
        """Per-rank batch sizes set by :meth:`set_shares`, or ``None``: the even split."""
        return None if self._shares is None else list(self._shares)

    @property
    def batch_shares(self) -> List[int]:
        """The batch size of every rank in this epoch (the :attr:`shares` if set, else the global
        batch split as evenly as it goes, ``batch_size`` each when ``world_size`` divides it)."""
        return self.shares or even_shares(self.global_batch, self.world_size)

    @property
    def rank_batch_size(self) -> int:
        """This rank's batch size (its share)."""
        return self.batch_shares[self.rank]

    def set_shares(self, shares: Optional[Sequence[int]]) -> None:
        """From the next epoch on, rank ``r`` takes ``shares[r]`` samples per batch (load balancing).

        Call it on every rank with the same list, between epochs (position
        0). The global batch must stay ``global_batch``, so every
        rank keeps the same number of batches; ``None`` goes back to the even
        split. Part of :meth:`state_dict`. Local: no communication.
        """
        if shares is not None:
            check_shares(shares, self.world_size)
            if sum(shares) != self.global_batch:
                raise InputValueError(f"batch shares {list(shares)} sum to {sum(shares)}; they must keep the "
                                      f"global batch of {self.global_batch}")
            if not self.pad:
                raise InputValueError("batch shares need pad=True (equal batch counts on every rank)")
        if self._position != 0:
            raise InputValueError(f"set_shares between epochs only (position is {self._position})")
        self._stop_active()
        self._shares = None if shares is None else [int(b) for b in shares]

    def plan(self, epoch: Optional[int] = None) -> EpochPlan:
        """This rank's ``EpochPlan`` for ``epoch`` (default: the current one)."""
        return plan_epoch(self.num_samples, self.world_size, self.rank, self.batch_size,
                          self.block_size, self.seed, self._epoch if epoch is None else epoch,
                          self.drop_last, shuffle=self.shuffle, pad=self.pad,
                          window_blocks=self.window_blocks, shares=self.batch_shares if self.pad else None)

    def __len__(self) -> int:
        """Batches per epoch on this rank; the same on every rank unless ``pad=False``."""
        if self.pad:
            return epoch_batches(self.num_samples, self.global_batch, self.drop_last)
        start, stop = shard_range(self.num_samples, self.world_size, self.rank)
        return -(-(stop - start) // self.batch_size)

    def set_epoch(self, epoch: int, position: Optional[int] = None) -> None:
        """Select the epoch to iterate next, from batch ``position``.

        ``position=None``: a new epoch starts at batch 0 and the current epoch
        keeps its position, so ``set_epoch(epoch)`` at the top of the training
        loop does not undo a mid-epoch :meth:`load_state_dict`.
        """
        check_int("epoch", epoch, minimum=0)
        if position is None:
            position = self._position if int(epoch) == self._epoch else 0
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) \
                or not 0 <= position <= len(self):
            raise InputValueError(f"Invalid position {position!r}: the epoch has {len(self)} "
                                  "batches")
        if (int(epoch), int(position)) != (self._epoch, self._position):
            self._stop_active()
            self._epoch, self._position = int(epoch), int(position)

    def state_dict(self) -> Dict[str, Any]:
        """Epoch, global batches handed out (``position``; ``samples``: as global samples),
        batch shares, and the settings that fix the order."""
        return {"epoch": self._epoch, "position": self._position, "samples": self._position * self.global_batch,
                "shares": self.shares, **self._settings()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue where ``state`` left off: the remaining global batches of its epoch, in
        order, at this loader's rank count (saved shares apply only at the saved one)."""
        state = dict(state)
        if "global_batch" not in state:  # saved by an hsgd whose ranks each read one range of the stream
            if state.get("position"):
                raise InputValueError("this loader state was saved mid-epoch by an older hsgd, whose sample "
                                      "order differs; resume from a state saved at an epoch's end")
            state["global_batch"] = state.get("batch_size", 0) * state.get("world_size", 0)
        differ = [f"{key}={state.get(key)!r} (this loader: {value!r})"
                  for key, value in self._settings().items()
                  if key in _ORDER_KEYS and state.get(key) != value]
        if differ:
            raise InputValueError("cannot resume the same sample order: the state was saved with "
                                  + ", ".join(differ) + "; build the loader with the saved settings")
        self._stop_active()
        self._position = 0
        self.set_shares(state.get("shares") if state.get("world_size") == self.world_size else None)
        self.set_epoch(state["epoch"], state["position"])

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, ...]]:
        if self._source is None:
            raise RuntimeError("this ContiguousH5Loader is closed")
        self._stop_active()
        epoch, plan = self._epoch, self.plan()
        windows = iter_windows(self._source, plan, self._position, self.return_indices,
                               keep_buffers=self.prefetch + 3)
        stream = Prefetcher(windows, self.prefetch)
        self._active = stream
        try:
            for batch in stream:
                self._position += 1
                yield batch
            self._epoch, self._position = epoch + 1, 0
        finally:
            stream.close()
            if self._active is stream:
                self._active = None

    def _stop_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def _close_source(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None

    def close(self) -> None:
        """Stop the reader thread and close the file. Idempotent; local."""
        self._stop_active()
        self._close_source()

    def __enter__(self) -> ContiguousH5Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._source is None else f"{len(self)} batches/epoch"
        return (f"ContiguousH5Loader('{self.path}', x='{self.x_key}', y='{self.y_key}', "
                f"batch_size={self.rank_batch_size} of {self.global_batch}, rank={self.rank}/{self.world_size}, "
                f"{state})")
