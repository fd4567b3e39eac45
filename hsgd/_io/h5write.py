"""Writing training data to HDF5 in the layout the loader reads fastest, atomically.

Layout: every x data set is chunked by whole samples, about 1 MiB per chunk
(``CHUNK_BYTES``); its labels use the same chunk rows, so the loader's
blocks (a multiple of the chunk rows, about 4 MiB) never read a chunk twice.
``compress=True`` adds gzip (level 4) with the byte-shuffle filter.

Samples are written in a random order (seeded) unless asked not to: the
loader reads contiguous blocks and shuffles within a window of blocks, so a
file sorted by class would give class-homogeneous windows.

A file is written under a temporary name in its own directory and moved into
place with ``os.replace``: readers see the old file or the complete new one,
never a partial one.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import h5py
import numpy as np

from ..errors import InputFileNotFoundError, InputValueError
from .data_checks import check_labels_nonnegative, check_lengths, check_x_dtype, check_y

__all__ = ["atomic_h5", "write_pairs", "write_dataset", "chunk_rows", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 20
_SLAB_BYTES = 64 << 20

# (x name, y name, x, y, rows of x and y to write in order, or None for all)
Pair = Tuple[str, str, np.ndarray, np.ndarray, Optional[np.ndarray]]


def chunk_rows(sample_bytes: int, num_samples: int, target: int = CHUNK_BYTES) -> int:
    """Samples per chunk: about ``target`` bytes, at least 1, at most ``num_samples``."""
    return int(max(1, min(num_samples, target // max(1, sample_bytes))))


@contextlib.contextmanager
def atomic_h5(path):
    """Yield an ``h5py.File`` being written next to ``path``; replace ``path`` on success."""
    path = Path(path)
    if not path.parent.is_dir():
        raise InputFileNotFoundError(f"output directory '{path.parent}' does not exist; "
                                     "create it first")
    # A fresh name created exclusively ("x"), with the umask's usual permissions.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with h5py.File(tmp, "x") as file:
            yield file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _write(file, name, array, rows, chunk, compress) -> None:
    count = len(array) if rows is None else len(rows)
    options = dict(compression="gzip", compression_opts=4, shuffle=True) if compress else {}
    # Native byte order: the loader reads native data straight from the file.
    dset = file.create_dataset(name, shape=(count, *array.shape[1:]),
                               dtype=array.dtype.newbyteorder("="),
                               chunks=(chunk, *array.shape[1:]), **options)
    sample_bytes = max(1, array.dtype.itemsize * int(np.prod(array.shape[1:])))
    slab = max(chunk, _SLAB_BYTES // sample_bytes // chunk * chunk)
    for lo in range(0, count, slab):
        hi = min(count, lo + slab)
        dset[lo:hi] = array[lo:hi] if rows is None else _gather(array, rows[lo:hi])


def _gather(array, rows):
    """``array[rows]``, reading the source in increasing row order (kind to memory maps)."""
    ascending = np.argsort(rows, kind="stable")
    out = np.empty((len(rows), *array.shape[1:]), dtype=array.dtype)
    out[ascending] = array[rows[ascending]]
    return out


def check_pair(x, y, x_name="x", y_name="y", per_position: bool = False) -> None:
    """The converter's checks on in-memory (or memory-mapped) x and y; ``per_position``: y may
    hold a label per position of a sample, ``(N, ...)``, not only one per sample."""
    check_x_dtype(x.dtype, x_name)
    check_y(y.dtype, y.shape, y_name, per_position)
    if x.ndim == 0:
        raise InputValueError(f"x '{x_name}' is a scalar; it needs one row per sample")
    if 0 in x.shape[1:]:
        raise InputValueError(f"x '{x_name}' has shape {x.shape}: its samples are empty; "
                              "each sample needs at least one value")
    check_lengths(len(x), len(y), x_name, y_name)
    check_labels_nonnegative(y, y_name)


def write_pairs(path, pairs: Sequence[Pair], *, compress: bool = False,
                attrs: Optional[Dict] = None, extra: Optional[Dict[str, np.ndarray]] = None) -> Path:
    """Write ``(x, y)`` pairs, each with its own chunk rows, to ``path`` atomically; ``extra``:
    more data sets written as they are (a manifest, indices), which the loader does not read."""
    for x_name, y_name, x, y, _ in pairs:
        check_pair(x, y, x_name, y_name, per_position=True)
    with atomic_h5(path) as file:
        for name, array in (extra or {}).items():
            file.create_dataset(name, data=array)
        for x_name, y_name, x, y, rows in pairs:
            count = len(x) if rows is None else len(rows)
            sample_bytes = x.dtype.itemsize * int(np.prod(x.shape[1:]))
            chunk = chunk_rows(sample_bytes, max(1, count))
            _write(file, x_name, x, rows, chunk, compress)
            _write(file, y_name, y, rows, chunk, compress)
        file.attrs.update(attrs or {})
    return Path(path)


def write_dataset(path, x, y, *, test_fraction: float = 0.0, shuffle: bool = True,
                  seed: int = 0, compress: bool = False, attrs: Optional[Dict] = None) -> Path:
    """Write samples ``x`` and labels ``y``: keys ``x, y``, or with a test split
    ``x_train, y_train, x_test, y_test`` (the last ``test_fraction`` of the order)."""
    check_pair(x, y)
    if not 0.0 <= test_fraction < 1.0:
        raise InputValueError(f"Invalid test_fraction: {test_fraction}; use 0 <= f < 1, e.g. 0.2")
    order = (np.random.default_rng(seed).permutation(len(x)) if shuffle
             else np.arange(len(x)))
    num_test = int(round(len(x) * test_fraction))
    if test_fraction > 0 and not 0 < num_test < len(x):
        raise InputValueError(f"test_fraction {test_fraction} of {len(x)} samples leaves an "
                              "empty train or test split; change it or pass 0 for no split")
    if num_test == 0:
        pairs = [("x", "y", x, y, order)]
    else:
        cut = len(x) - num_test
        pairs = [("x_train", "y_train", x, y, order[:cut]),
                 ("x_test", "y_test", x, y, order[cut:])]
    info = {"hsgd_shuffled": bool(shuffle), "hsgd_seed": int(seed)}
    return write_pairs(path, pairs, compress=compress, attrs={**info, **(attrs or {})})
