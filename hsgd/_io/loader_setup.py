"""Opening and validating the loader's input, so that every rank decides the same.

:class:`~hsgd.parallel_io.ContiguousH5Loader` runs :func:`open_checked` on
every rank and agrees on the outcome (a bad path on one rank raises on all),
then :func:`check_settings_agree` compares the order-defining settings of
all ranks (a different ``batch_size`` on one rank would otherwise give it a
different batch count and hang the others), then :func:`scan_labels` checks
each rank's share of the labels.
"""

from __future__ import annotations

import contextlib
import math

import h5py
import numpy as np

from .._core.agree import agree
from .._core.checks import check_int
from ..errors import InputValueError
from .data_checks import check_file, check_labels_nonnegative, check_lengths, check_x_dtype, check_y, missing_key_error
from .h5source import H5Source
from .plan import check_plan, default_block_size, default_window_blocks, even_shares

__all__ = ["open_checked", "check_settings_agree", "scan_labels", "list_datasets",
           "loader_block_size", "batch_sizes"]

_SCAN_ROWS = 1 << 20


def list_datasets(file: h5py.File):
    """``(name, shape, dtype)`` of every data set in ``file``, inside groups too."""
    found = []
    file.visititems(lambda name, obj: found.append((name, obj.shape, str(obj.dtype)))
                    if isinstance(obj, h5py.Dataset) else None)
    return found


def loader_block_size(dataset) -> int:
    """The block size (samples) the loader uses by default for an h5py data set."""
    sample_bytes = dataset.dtype.itemsize * math.prod(dataset.shape[1:])
    return default_block_size(sample_bytes, dataset.chunks[0] if dataset.chunks else None)


def _get(file, key):
    try:
        return file.get(key)
    except (KeyError, ValueError, TypeError):
        return None


def _check_int(name, value, minimum, optional=False) -> None:
    if not (optional and value is None):
        check_int(name, value, minimum)


def batch_sizes(batch_size, global_batch, world_size: int):
    """``(batch_size, global_batch)`` from either: ``batch_size`` per rank (the global batch
    ``world_size`` times it), or ``global_batch`` (each rank's ``batch_size``: its smallest share)."""
    if (batch_size is None) == (global_batch is None):
        raise InputValueError("pass batch_size (samples per batch on each rank) or global_batch (on all "
                              f"ranks together), not {'both' if batch_size is not None else 'neither'}")
    if global_batch is None:
        _check_int("batch_size", batch_size, 1)
        return int(batch_size), int(batch_size) * world_size
    _check_int("global_batch", global_batch, 1)
    if global_batch < world_size:
        raise InputValueError(f"a global batch of {global_batch} cannot give each of {world_size} ranks a "
                              f"sample; use global_batch >= {world_size} or fewer ranks")
    return int(global_batch) // world_size, int(global_batch)


def _check_args(loader, block_size, window_blocks) -> None:
    _check_int("seed", loader.seed, 0)
    _check_int("block_size", block_size, 1, optional=True)
    _check_int("window_blocks", window_blocks, 1, optional=True)
    _check_int("prefetch", loader.prefetch, 0)
    if not loader.pad and loader.drop_last:
        raise InputValueError("pad=False only applies with drop_last=False; set "
                              "drop_last=False, pad=False to see every sample exactly once")
    for name in ("x_key", "y_key"):
        if not isinstance(getattr(loader, name), str):
            raise InputValueError(f"Invalid {name}: {getattr(loader, name)!r}; pass the name "
                                  "of a data set in the file, e.g. 'x'")


def _check_datasets(file, path, x_key, y_key) -> None:
    for key, argument in ((x_key, "x_key"), (y_key, "y_key")):
        if not isinstance(_get(file, key), h5py.Dataset):
            raise missing_key_error(path, key, list_datasets(file), argument)
    x, y = file[x_key], file[y_key]
    if x.ndim == 0:
        raise InputValueError(f"x data set '{x_key}' is a scalar; it needs one row per sample")
    check_x_dtype(x.dtype, x_key)
    check_y(y.dtype, y.shape, y_key, per_position=True)
    check_lengths(len(x), len(y), x_key, y_key)


def open_checked(loader, batch_size, global_batch, block_size, window_blocks):
    """Validate the loader's arguments and file.

    Returns ``(H5Source, (batch_size, global_batch), block_size, window_blocks)``, defaults resolved.
    """
    batches = batch_sizes(batch_size, global_batch, loader.world_size)
    _check_args(loader, block_size, window_blocks)
    check_file(loader.path)
    with contextlib.ExitStack() as undo:  # a bad file is closed again
        file = h5py.File(loader.path, "r")
        undo.callback(file.close)
        _check_datasets(file, loader.path, loader.x_key, loader.y_key)
        try:
            uneven = loader.pad and batches[1] != batches[0] * loader.world_size
            check_plan(len(file[loader.y_key]), loader.world_size, loader.rank, batches[0], loader.drop_last,
                       loader.pad, even_shares(batches[1], loader.world_size) if uneven else None)
        except ValueError as exc:
            raise InputValueError(f"'{loader.path}' ('{loader.x_key}'): {exc}") from None
        source = H5Source(file, loader.x_key, loader.y_key, direct=loader.direct_reads)
        undo.pop_all()
    block_size = int(block_size or loader_block_size(source.x))
    sample_bytes = source.x.dtype.itemsize * math.prod(source.sample_shape)
    return source, batches, block_size, int(window_blocks or default_window_blocks(block_size, sample_bytes))


def check_settings_agree(comm, settings: dict) -> None:
    """Raise on every rank (through :func:`agree`) if any rank's settings differ from rank 0's."""
    everyone, error = comm.allgather(settings), None
    for rank, theirs in enumerate(everyone):
        differ = [f"{key}: rank 0 has {everyone[0][key]!r}, rank {rank} has {value!r}"
                  for key, value in theirs.items() if value != everyone[0][key]]
        if differ and error is None:
            error = InputValueError("ranks disagree on loader settings (" + "; ".join(differ)
                                    + "); pass the same file and arguments on every rank")
    agree(comm, error)


def scan_labels(source: H5Source, y_key: str, start: int, stop: int) -> None:
    """Raise if any label in rows ``[start, stop)`` is negative (one slab at a time)."""
    if np.dtype(source.y.dtype).kind != "i":
        return
    for lo in range(start, stop, _SCAN_ROWS):
        hi = min(stop, lo + _SCAN_ROWS)
        check_labels_nonnegative(source.y[lo:hi], y_key, offset=lo)
