"""Training-input read rates: the contiguous-read loader against the usual ways.

One command runs everything: it writes two HDF5 files of ``--gib`` GiB each, launches
``mpiexec -n R`` on itself for every R in ``--ranks``, prints a markdown table and
removes the files::

    python -m lab.bench io                         # 1 GiB files, 1/2/4 ranks, 3 repeats
    python -m lab.bench io --dir /scratch/me --gib 4
    python -m lab.bench io --gib 0.05 --repeats 1 --bounded-seconds 1   # smoke test

Per rank count, file and cache state (cold or warm), the median aggregate samples/s
of :class:`hsgd.parallel_io.ContiguousH5Loader`, a per-sample ``DataLoader``, h5py
fancy indexing and raw contiguous reads (the readers: :mod:`lab.bench._readers`).
What each column is: docs/benchmark-methods.md (``io``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict

from hsgd.bench import _harness as harness
from hsgd.bench._harness import Progress, Result, Table, repeat

from ._launch import run_workers

SHAPES = {"40 f32": (40,), "3x32x32 f32": (3, 32, 32)}
METHODS = ("loader", "DataLoader", "fancy", "raw")
COLUMNS = ("data", "ranks", "cache", "loader", "DataLoader*", "fancy*", "raw", "loader/DataLoader",
           "loader/fancy", "loader/raw")


def add_arguments(p) -> None:
    p.add_argument("--gib", type=harness.positive_float, default=1.0, help="size of each file (1)")
    p.add_argument("--dir", default=None, help="where to write the files (a temp dir)")
    p.add_argument("--ranks", type=harness.int_at_least(1), nargs="+", default=[1, 2, 4], help="rank counts (1 2 4)")
    harness.add_repeat_options(p, repeats=3, warmup=0, what="epochs of each method")
    p.add_argument("--batch-size", type=harness.int_at_least(1), default=256, help="samples per rank and batch (256)")
    p.add_argument("--bounded-seconds", type=harness.positive_float, default=5.0,
                   help="time per rank for the slow methods, extrapolated (5)")
    p.add_argument("--workers", type=harness.int_at_least(0), default=0, help="DataLoader num_workers (0)")
    p.add_argument("--files", dest="_files", type=Path, default=None, help=argparse.SUPPRESS)  # set by run()


def check(args, extra, parser) -> None:
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"argument --dir: {args.dir} is not a directory: create it or leave --dir out")
    for kind, shape in SHAPES.items():
        n, need = _samples(shape, args.gib), max(args.ranks) * args.batch_size
        if n < need:
            parser.error(f"argument --gib: a {kind} file of {args.gib:g} GiB holds {n} samples, fewer than the "
                         f"{need} that {max(args.ranks)} ranks x --batch-size {args.batch_size} need: "
                         "raise --gib or lower --batch-size")


def _samples(shape, gib: float) -> int:
    """Samples of float32 ``shape`` in a file of ``gib`` GiB (as :func:`_readers.make_file` writes)."""
    sample_bytes = 4 * math.prod(shape)
    return max(1, int(gib * (1 << 30)) // sample_bytes)


def run(args, extra) -> Result:
    import h5py

    from ._readers import make_file

    base = Path(tempfile.mkdtemp(prefix="hsgd-bench-io-", dir=args.dir))
    try:
        with Progress(len(SHAPES) + len(args.ranks), "lab.bench io", args.progress) as progress:
            files, sizes = {}, {}
            for kind, shape in SHAPES.items():
                path = base / f"{kind.split()[0]}.h5"
                sizes[kind] = make_file(path, shape, args.gib)
                files[kind] = str(path)
                progress.step(f"wrote {path.name}: {sizes[kind]} samples of {shape} float32, "
                              f"{path.stat().st_size / (1 << 30):.2f} GiB")
            files_json = base / "files.json"
            files_json.write_text(json.dumps(files))
            results = []
            for ranks in args.ranks:
                results += run_workers("io", ranks, [*args._argv, "--files", str(files_json)])
                progress.step(f"{ranks} ranks")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    title = (f"h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, {os.cpu_count()} CPUs; "
             f"files of {args.gib:g} GiB: " + ", ".join(f"{k}: {n} samples" for k, n in sizes.items()))
    return Result([_table(results, args, title)], results)


def _table(results, args, title) -> Table:
    rows: Dict[Any, Any] = {}  # JSON records, keyed as the table groups them
    for r in results:
        rows.setdefault((r["data"], r["ranks"], r["cache"]), {})[r["method"]] = harness.median(r["rates"])
    table = Table(COLUMNS, title=title, notes=[
        f"samples/s, median of {args.repeats} after {args.warmup} warm-up, all ranks together; "
        f"batch {args.batch_size}.",
        f"* ran about {args.bounded_seconds:g} s per rank and extrapolated; "
        f"DataLoader num_workers={args.workers}, one f[key][i] read per sample.",
        "cold: file pages dropped with posix_fadvise(DONTNEED) before each run; "
        "warm: file read once before each run."])
    for (data, ranks, cache), rate in rows.items():
        cells = [f"{rate[m]:,.0f}" for m in METHODS]
        ratios = [f"{rate['loader'] / rate[m]:.1f}x" for m in ("DataLoader", "fancy", "raw")]
        table.rows.append([data, ranks, cache, *cells, *ratios])
    return table


def worker(args):
    """Under mpiexec: every method on every file and cache state; rank 0 returns every run's rate."""
    from mpi4py import MPI

    from ._readers import measure

    comm = MPI.COMM_WORLD
    files = json.loads(args._files.read_text())
    results = []
    for kind, path in files.items():
        for cache in ("cold", "warm"):
            args.cache = cache
            for method in METHODS:
                rates = repeat(lambda: measure(method, path, comm, args), args.repeats, args.warmup)  # noqa: B023
                results.append({"data": kind, "ranks": comm.Get_size(), "cache": cache,
                                "method": method, "rates": rates})
    return results
