"""The readers that ``python -m lab.bench io`` times, and its test files.

Each ``time_*`` function runs on every rank of the job over the rank's
shard, starts the clock after a barrier, and returns (samples read,
seconds); :func:`measure` turns one run of a method into the aggregate
rate: all ranks' samples / the slowest rank's time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Tuple

import h5py
import numpy as np

__all__ = ["make_file", "measure", "TIMERS"]

SLAB = 64 << 20


def make_file(path: Path, shape, gib: float, seed: int = 0) -> int:
    """Random float32 samples and int64 labels, chunked as ``hsgd.data convert`` does."""
    from hsgd._io.h5write import chunk_rows

    sample_bytes = 4 * int(np.prod(shape))
    n = max(1, int(gib * (1 << 30)) // sample_bytes)
    chunk = chunk_rows(sample_bytes, n)
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (n, *shape), np.float32, chunks=(chunk, *shape))
        y = f.create_dataset("y", (n,), np.int64, chunks=(chunk,))
        step = max(chunk, SLAB // sample_bytes // chunk * chunk)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            x[lo:hi] = rng.random((hi - lo, *shape), dtype=np.float32)
            y[lo:hi] = rng.integers(0, 10, hi - lo)
    return n


def drop_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_cache(path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(SLAB):
            pass


def _shard(n, comm):
    from hsgd.parallel_io import shard_range

    return shard_range(n, comm.Get_size(), comm.Get_rank())


def time_raw(path, comm, args):
    with h5py.File(path, "r") as f:
        x, y = f["x"], f["y"]
        start, stop = _shard(len(y), comm)
        step = max(1, SLAB // (x.dtype.itemsize * int(np.prod(x.shape[1:]))))
        xb, yb = np.empty((step, *x.shape[1:]), x.dtype), np.empty(step, np.int64)
        comm.Barrier()  # everyone starts together
        t0 = time.perf_counter()
        for lo in range(start, stop, step):
            hi = min(stop, lo + step)
            x.read_direct(xb, np.s_[lo:hi], np.s_[0:hi - lo])
            y.read_direct(yb, np.s_[lo:hi], np.s_[0:hi - lo])
        return stop - start, time.perf_counter() - t0


def time_loader(path, comm, args):
    from hsgd.parallel_io import ContiguousH5Loader

    with ContiguousH5Loader(path, batch_size=args.batch_size, comm=comm) as loader:
        if args.cache == "cold":
            drop_cache(path)  # construction scanned the labels
        comm.Barrier()  # everyone starts together
        t0, count = time.perf_counter(), 0
        for _x, y in loader:
            count += len(y)
        return count, time.perf_counter() - t0


def time_fancy(path, comm, args):
    with h5py.File(path, "r") as f:
        x, y = f["x"], f["y"]
        start, stop = _shard(len(y), comm)
        order = np.random.default_rng(comm.Get_rank()).permutation(np.arange(start, stop))
        comm.Barrier()  # everyone starts together
        t0, count = time.perf_counter(), 0
        for lo in range(0, len(order), args.batch_size):
            idx = np.sort(order[lo:lo + args.batch_size])
            x[idx], y[idx]
            count += len(idx)
            if time.perf_counter() - t0 > args.bounded_seconds:
                break
        return count, time.perf_counter() - t0


class _PerSample:
    """The map-style Dataset users write: one ``f[key][i]`` read per sample."""

    def __init__(self, path):
        self.path, self.file = path, None

    def __len__(self):
        with h5py.File(self.path, "r") as f:
            return len(f["y"])

    def __getitem__(self, i):
        import torch

        if self.file is None:
            self.file = h5py.File(self.path, "r")
        return torch.from_numpy(self.file["x"][i]), int(self.file["y"][i])


def time_dataloader(path, comm, args):
    import torch
    from torch.utils.data import DataLoader, SubsetRandomSampler

    data = _PerSample(path)
    start, stop = _shard(len(data), comm)
    sampler = SubsetRandomSampler(range(start, stop),
                                  generator=torch.Generator().manual_seed(comm.Get_rank()))
    # arg-type: a duck-typed map-style dataset, as users write one; torch's stubs want a Dataset subclass
    loader: DataLoader[Tuple[torch.Tensor, int]] = DataLoader(
        data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)  # type: ignore[arg-type]
    comm.Barrier()  # everyone starts together
    t0, count = time.perf_counter(), 0
    for _x, y in loader:
        count += len(y)
        if time.perf_counter() - t0 > args.bounded_seconds:
            break
    return count, time.perf_counter() - t0


TIMERS = {"loader": time_loader, "DataLoader": time_dataloader, "fancy": time_fancy,
          "raw": time_raw}


def measure(method, path, comm, args) -> float:
    """One run on every rank: aggregate samples/s."""
    if comm.Get_rank() == 0:
        (drop_cache if args.cache == "cold" else warm_cache)(path)
    comm.Barrier()  # the page cache is in the wanted state before anyone reads
    count, seconds = TIMERS[method](path, comm, args)
    counts, times = comm.allgather(count), comm.allgather(seconds)
    return sum(counts) / max(times)
