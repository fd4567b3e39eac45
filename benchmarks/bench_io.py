"""Training-input read rates: the contiguous-read loader against the usual ways.

One command runs everything: it writes two HDF5 files of ``--gib`` GiB each
(40 float32 per sample, MNIST-1D-like; 3x32x32 float32, CIFAR-like), launches
``mpiexec -n R`` on itself for every R in ``--ranks``, prints a markdown
table and removes the files::

    python benchmarks/bench_io.py                     # 1 GiB files, 1/2/4 ranks, 3 repeats
    python benchmarks/bench_io.py --dir /scratch/me --gib 4
    python benchmarks/bench_io.py --gib 0.05 --repeats 1 --bounded-seconds 1   # smoke test

Per rank count, file and cache state (cold: the file's pages dropped with
``posix_fadvise(DONTNEED)`` before each run; warm: the file read once
before), the median over ``--repeats`` of the aggregate samples/s of:

* ``loader``: one epoch of :class:`hsgd.parallel_io.ContiguousH5Loader`
  (shuffled; construction not timed);
* ``DataLoader``: ``torch.utils.data.DataLoader`` over a map-style Dataset
  reading ``f["x"][i]`` and ``f["y"][i]`` per sample, random sampler over the
  rank's shard, ``num_workers=--workers``;
* ``fancy``: h5py fancy indexing with sorted random indices, one read per batch;
* ``raw``: each rank reads its contiguous shard in 64 MiB slices.

DataLoader and fancy are slow: each runs for about ``--bounded-seconds``
per rank and the rate is extrapolated from the samples it read (marked *).
Aggregate rate = all ranks' samples / the slowest rank's time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

SHAPES = {"40 f32": (40,), "3x32x32 f32": (3, 32, 32)}
METHODS = ("loader", "DataLoader", "fancy", "raw")
BOUNDED = ("DataLoader", "fancy")
SLAB = 64 << 20


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of each file (1)")
    p.add_argument("--dir", default=None, help="where to write the files (a temp dir)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--bounded-seconds", type=float, default=5.0,
                   help="time per rank for the slow methods, extrapolated (5)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader num_workers (0)")
    p.add_argument("--worker", nargs=2, metavar=("FILES_JSON", "OUT_JSON"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


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
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers)
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


def worker(args) -> None:
    """Run under mpiexec: every method on every file; rank 0 writes the rates."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    files = json.loads(Path(args.worker[0]).read_text())
    results = []
    for kind, path in files.items():
        for cache in ("cold", "warm"):
            args.cache = cache
            for method in METHODS:
                rates = [measure(method, path, comm, args) for _ in range(args.repeats)]
                results.append({"data": kind, "ranks": comm.Get_size(), "cache": cache,
                                "method": method, "rate": statistics.median(rates)})
    if comm.Get_rank() == 0:
        Path(args.worker[1]).write_text(json.dumps(results))


def _mpiexec() -> str:
    local = Path(sys.executable).with_name("mpiexec")
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


def launch(ranks: int, files_json: Path, args):
    out = files_json.with_name(f"results_{ranks}.json")
    cmd = [_mpiexec(), "-n", str(ranks), sys.executable, __file__, "--worker",
           str(files_json), str(out), "--repeats", str(args.repeats),
           "--batch-size", str(args.batch_size), "--bounded-seconds",
           str(args.bounded_seconds), "--workers", str(args.workers)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def table(results, args) -> str:
    rows = {}
    for r in results:
        rows.setdefault((r["data"], r["ranks"], r["cache"]), {})[r["method"]] = r["rate"]
    head = ("| data | ranks | cache | loader | DataLoader* | fancy* | raw "
            "| loader/DataLoader | loader/fancy | loader/raw |")
    lines = [head, "|" + "---|" * 10]
    for (data, ranks, cache), rate in rows.items():
        cells = [f"{rate[m]:,.0f}" for m in METHODS]
        ratios = [f"{rate['loader'] / rate[m]:.1f}x" for m in ("DataLoader", "fancy", "raw")]
        lines.append(f"| {data} | {ranks} | {cache} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines + [
        "", f"samples/s, median of {args.repeats}, all ranks together; batch {args.batch_size}.",
        f"* ran about {args.bounded_seconds:g} s per rank and extrapolated; "
        f"DataLoader num_workers={args.workers}, one f[key][i] read per sample.",
        "cold: file pages dropped with posix_fadvise(DONTNEED) before each run; "
        "warm: file read once before each run."])


def main(argv=None) -> None:
    args = _parse(argv)
    if args.worker:
        return worker(args)
    base = Path(tempfile.mkdtemp(prefix="hsgd-bench-io-", dir=args.dir))
    try:
        files = {}
        for kind, shape in SHAPES.items():
            path = base / f"{kind.split()[0]}.h5"
            n = make_file(path, shape, args.gib)
            files[kind] = str(path)
            print(f"wrote {path}: {n} samples of {shape} float32, "
                  f"{path.stat().st_size / (1 << 30):.2f} GiB", flush=True)
        files_json = base / "files.json"
        files_json.write_text(json.dumps(files))
        results = [r for ranks in args.ranks for r in launch(ranks, files_json, args)]
        print(f"\nh5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, "
              f"{os.cpu_count()} CPUs\n")
        print(table(results, args))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
