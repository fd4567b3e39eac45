"""Making and inspecting hsgd training data files: ``python -m hsgd.data``.

Subcommands (each says more in its function below and in ``--help``)::

    python -m hsgd.data convert --x X.npy --y Y.npy -o data.h5 [--test-fraction 0.2]
    python -m hsgd.data convert --npz data.npz [--npz-x x --npz-y y] -o data.h5 [--compress]
    python -m hsgd.data mnist1d -o mnist1d.h5 [--samples 5000] [--seed 42] [--compress]
    python -m hsgd.data text [FILES ...] -o tokens.h5 [--block-size 256] [--val-fraction 0.1]
                             [--seed 0] [--max-bytes N] [--compress]
    python -m hsgd.data inspect data.h5

Every write is atomic (a temporary file in the target directory, then
``os.replace``). Errors print once, on rank 0 when run under ``mpiexec``,
and exit with status 1 on every rank.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
from pathlib import Path
from typing import Optional

import h5py
import numpy as np

from ._core.agree import on_root
from ._core.checks import check_int
from ._io.data_checks import check_file
from ._io.h5write import write_dataset, write_pairs
from ._io.loader_setup import list_datasets, loader_block_size
from ._io.plan import default_window_blocks
from ._io.tokens import write_stdlib_tokens, write_tokens
from .errors import InputFileNotFoundError, InputValueError

__all__ = ["write_mnist1d", "ensure_mnist1d", "ensure_stdlib_tokens", "describe", "main"]

_MIB = float(1 << 20)


def _mnist1d_arrays(num_samples: int, seed: int):
    """MNIST-1D from its templates; numpy's and random's global state left as found."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    saved = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(args)  # seeds numpy's and random's global generators
    finally:
        np.random.set_state(saved[0])
        random.setstate(saved[1])
    return data["x"], data["y"], data["x_test"], data["y_test"]


def write_mnist1d(path, *, num_samples: int = 5000, seed: int = 42,
                  compress: bool = False) -> Path:
    """Generate MNIST-1D (offline) and write it to ``path`` (layout: :func:`_mnist1d`)."""
    check_int("num_samples", num_samples, minimum=10)  # one per class at least
    x, y, x_test, y_test = _mnist1d_arrays(num_samples, seed)
    pairs = [("x_train", "y_train", x.astype(np.float32), y.astype(np.int64), None),
             ("x_test", "y_test", x_test.astype(np.float32), y_test.astype(np.int64), None)]
    attrs = {"source": "mnist1d", "seed": seed, "num_samples": num_samples}
    return write_pairs(path, pairs, compress=compress, attrs=attrs)


def ensure_mnist1d(directory, *, num_samples: int = 5000, seed: int = 42, comm=None) -> Path:
    """The path of a cached MNIST-1D file in ``directory``, generated if missing.

    With ``comm``, collective: rank 0 generates, every rank raises the same
    error or returns once the file is in place.
    """
    path = Path(directory) / f"mnist1d_n{num_samples}_s{seed}.h5"

    def generate() -> None:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_mnist1d(path, num_samples=num_samples, seed=seed)
    if comm is None:
        generate()
    else:
        on_root(comm, generate)  # also orders: rank 0's os.replace before anyone returns
    return path


def ensure_stdlib_tokens(directory, *, block_size: int = 256, max_bytes: Optional[int] = None,
                         val_fraction: float = 0.1, seed: int = 0, comm=None) -> Path:
    """The path of cached token data of the standard library's sources in ``directory``
    (``python -m hsgd.data text`` with no FILES), written if missing. The name holds the Python
    version, block size, size, split and seed. With ``comm``, collective as :func:`ensure_mnist1d`."""
    size = "all" if max_bytes is None else str(max_bytes)
    path = Path(directory) / (f"stdlib-py{platform.python_version()}_block{block_size}_bytes{size}"
                              f"_val{val_fraction:g}_s{seed}.h5")

    def generate() -> None:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_stdlib_tokens(path, block_size=block_size, max_bytes=max_bytes,
                                val_fraction=val_fraction, seed=seed)
    if comm is None:
        generate()
    else:
        on_root(comm, generate)
    return path


def describe(path) -> dict:
    """Data sets, their layout and the loader's block size, as a dict (``inspect``)."""
    check_file(path)
    with h5py.File(path, "r") as file:
        rows = []
        for name, shape, dtype in list_datasets(file):
            dset = file[name]
            label_like = (dset.ndim == 1 and dset.dtype.kind in "iu") or dset.dtype.kind not in "biufc"
            rows.append({
                "name": name, "shape": shape, "dtype": dtype, "chunks": dset.chunks,
                "compression": dset.compression, "compression_opts": dset.compression_opts,
                "shuffle": dset.shuffle, "nbytes": dset.size * dset.dtype.itemsize,
                "stored": dset.id.get_storage_size(),
                "block": None if label_like or dset.ndim == 0 else loader_block_size(dset),
                "window": None if label_like or dset.ndim == 0 else _window_blocks(dset)})
        return {"path": str(path), "attrs": {k: _plain(v) for k, v in file.attrs.items()},
                "datasets": rows}


def _window_blocks(dset) -> int:
    sample_bytes = dset.dtype.itemsize * int(np.prod(dset.shape[1:]))
    return default_window_blocks(loader_block_size(dset), sample_bytes)


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def format_description(info: dict) -> str:
    """:func:`describe`'s result as the table ``inspect`` prints."""
    header = ("data set", "shape", "dtype", "chunks", "compression", "size", "stored",
              "loader block")
    table = [header] + [_describe_row(row) for row in info["datasets"]]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [info["path"]] + ["  " + "  ".join(cell.ljust(w) for cell, w in zip(line, widths))
                              for line in table]
    attrs = ", ".join(f"{key}={value}" for key, value in info["attrs"].items())
    return "\n".join(lines + ([f"attributes: {attrs}"] if attrs else []))


def _describe_row(row: dict):
    compression = row["compression"] or "none"
    if row["compression"]:
        compression += f"({row['compression_opts']})" + ("+shuffle" if row["shuffle"] else "")
    block = "-"
    if row["block"] is not None:
        sample_bytes = row["nbytes"] / max(1, row["shape"][0])
        block = f"{row['block']} samples ({row['block'] * sample_bytes / _MIB:.1f} MiB)"
        block += (", all in one" if row["block"] >= row["shape"][0]
                  else f", {row['window']} per shuffle window")
    return (row["name"], str(tuple(row["shape"])), row["dtype"],
            str(row["chunks"]) if row["chunks"] else "contiguous", compression,
            f"{row['nbytes'] / _MIB:.2f} MiB", f"{row['stored'] / _MIB:.2f} MiB", block)


def _load_npy(path, what: str):
    if not Path(path).is_file():
        raise InputFileNotFoundError(f"{what} file not found: '{path}'; check the path")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "Python objects" in str(exc):
            raise InputValueError(f"'{path}' holds Python objects, which are not numeric; save "
                                  "numbers, e.g. np.save(path, x.astype(np.float32))") from None
        raise InputValueError(f"'{path}' is not a .npy file ({exc}); save it with np.save") from None


def _load_inputs(args):
    if args.npz is None:
        if args.x is None or args.y is None:
            raise InputValueError("convert needs --x X.npy and --y Y.npy, or --npz DATA.npz")
        return _load_npy(args.x, "--x"), _load_npy(args.y, "--y")
    if args.x is not None or args.y is not None:
        raise InputValueError("pass --npz or --x/--y, not both")
    archive = _load_npy(args.npz, "--npz")
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise InputValueError(f"'{args.npz}' is a .npy file, not .npz; use --x and --y")
    for key, flag in ((args.npz_x, "--npz-x"), (args.npz_y, "--npz-y")):
        if key not in archive.files:
            raise InputValueError(f"'{args.npz}' has no array '{key}'; it has: "
                                  f"{', '.join(archive.files)}; pass {flag} naming one of them")
    return archive[args.npz_x], archive[args.npz_y]


def _convert(args) -> str:
    """``convert``: keys ``x, y``, or ``x_train, y_train, x_test, y_test`` with
    ``--test-fraction``, in a seeded random order (``--no-shuffle`` keeps it), chunked by
    whole samples (about 1 MiB per chunk) for :class:`~hsgd.parallel_io.ContiguousH5Loader`;
    see :mod:`hsgd._io.h5write`."""
    x, y = _load_inputs(args)
    write_dataset(args.output, x, y, test_fraction=args.test_fraction,
                  shuffle=not args.no_shuffle, seed=args.seed, compress=args.compress)
    return f"wrote {format_description(describe(args.output))}"


def _mnist1d(args) -> str:
    """``mnist1d``: MNIST-1D generated offline from the ``mnist1d`` package's templates (no
    download). ``--samples`` is the number generated (mnist1d's ``num_samples``), 80 % of it
    train, 20 % test, in mnist1d's own order. Layout: ``x_train (0.8 n, 40) float32``,
    ``y_train (0.8 n,) int64``, ``x_test (0.2 n, 40) float32``, ``y_test (0.2 n,) int64``;
    file attributes ``source="mnist1d"``, ``seed``, ``num_samples``."""
    write_mnist1d(args.output, num_samples=args.samples, seed=args.seed,
                  compress=args.compress)
    return f"wrote {format_description(describe(args.output))}"


def _text(args) -> str:
    """``text``: byte-level token data for language modelling (``--model gpt``): the FILES'
    bytes concatenated in the order given, or with no FILES the running Python's
    standard-library sources (every ``*.py`` file, sorted, no ``site-packages``), at most
    ``--max-bytes``, cut into blocks of ``--block-size`` bytes with their next bytes as
    labels, and a seeded random ``--val-fraction`` of the blocks as the validation split
    (keys ``x_test``/``y_test``, the trainer's default test keys). The file records the
    files read, their bytes' sha256 and ``kind="tokens"``; the layout is in
    :mod:`hsgd._io.tokens`."""
    options = dict(block_size=args.block_size, val_fraction=args.val_fraction, seed=args.seed,
                   max_bytes=args.max_bytes, compress=args.compress)
    if args.files:
        write_tokens(args.output, args.files, **options)
    else:
        write_stdlib_tokens(args.output, **options)
    return f"wrote {format_description(describe(args.output))}"


def _inspect(args) -> str:
    """``inspect``: data sets, shapes, dtypes, chunking, compression, and the read block and
    shuffle window the loader would use."""
    return format_description(describe(args.path))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hsgd.data",
                                     description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help=".npy pair or .npz to HDF5")
    convert.add_argument("--x", help="samples, .npy (any numeric dtype, first axis = sample)")
    convert.add_argument("--y", help="integer labels >= 0, .npy, one per sample")
    convert.add_argument("--npz", help="an .npz holding both (instead of --x/--y)")
    convert.add_argument("--npz-x", default="x", help="samples' name in the .npz (x)")
    convert.add_argument("--npz-y", default="y", help="labels' name in the .npz (y)")
    convert.add_argument("--test-fraction", type=float, default=0.0,
                         help="split off this fraction as x_test/y_test (default: no split)")
    convert.add_argument("--no-shuffle", action="store_true", help="keep the input order")
    convert.add_argument("--seed", type=int, default=0, help="seed of the sample order (0)")
    mnist = commands.add_parser("mnist1d", help="generate MNIST-1D offline")
    mnist.add_argument("--samples", type=int, default=5000,
                       help="samples generated, 80%% train / 20%% test (5000)")
    mnist.add_argument("--seed", type=int, default=42, help="generation seed (42)")
    text = commands.add_parser("text", help="byte tokens of text files (default: the standard library's "
                                            "sources) for language modelling")
    text.add_argument("files", nargs="*", metavar="FILES",
                      help="text files, read in this order (default: every *.py of the running Python's "
                           "standard library, sorted)")
    text.add_argument("--block-size", type=int, default=256, help="bytes per sample (256)")
    text.add_argument("--val-fraction", type=float, default=0.1,
                      help="a seeded random choice of this fraction of the blocks validates (0.1)")
    text.add_argument("--seed", type=int, default=0, help="seed of the split and the training order (0)")
    text.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes (all)")
    for sub, func in ((convert, _convert), (mnist, _mnist1d), (text, _text)):
        sub.add_argument("-o", "--output", required=True, help="HDF5 file to write")
        sub.add_argument("--compress", action="store_true", help="gzip level 4 + shuffle")
        sub.set_defaults(func=func)
    inspect = commands.add_parser("inspect", help="describe an HDF5 data file")
    inspect.add_argument("path")
    inspect.set_defaults(func=_inspect)
    return parser


def main(argv=None) -> int:
    """Run the CLI; rank 0 does the work under mpiexec. Returns the exit status."""
    from mpi4py import MPI

    args = _parser().parse_args(argv)
    comm = MPI.COMM_WORLD
    outcome = None
    if comm.Get_rank() == 0:
        try:
            outcome = (0, args.func(args))
        except (ValueError, OSError) as exc:
            outcome = (1, f"hsgd.data {args.command}: error: {exc}")
    status, text = comm.bcast(outcome, root=0)
    if comm.Get_rank() == 0:
        print(text, file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
