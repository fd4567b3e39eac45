"""Checks on training data, shared by the loader and the converter.

Each check raises ``ValueError`` (``FileNotFoundError`` for a missing file)
with a message that names the data set and says what to change. They are
local and cheap; callers that run on several ranks wrap them in
:func:`hsgd._core.agree.check_all` so that every rank raises the same error.
"""

from __future__ import annotations

import os
from typing import Iterable, Tuple

import numpy as np
import torch

from ..errors import InputFileNotFoundError, InputPermissionError, InputValueError

__all__ = ["check_file", "check_x_dtype", "check_y", "check_lengths",
           "check_labels_nonnegative", "missing_key_error", "MAKE_DATA_HINT"]

MAKE_DATA_HINT = ("create one with `python -m hsgd.data convert --x X.npy --y Y.npy "
                  "-o DATA.h5` or `python -m hsgd.data mnist1d -o DATA.h5`")


def check_file(path) -> None:
    """Raise unless ``path`` is an existing HDF5 file."""
    import h5py

    if not os.path.exists(path):
        raise InputFileNotFoundError(f"data file not found: '{path}'; check the path, or "
                                     f"{MAKE_DATA_HINT}")
    if os.path.isdir(path):
        raise InputValueError(f"'{path}' is a directory; pass the path of an HDF5 file")
    if not os.access(path, os.R_OK):
        raise InputPermissionError(f"'{path}' is not readable by this user; fix its permissions")
    if not h5py.is_hdf5(path):
        raise InputValueError(f"'{path}' is not an HDF5 file; convert .npy/.npz data with "
                              "`python -m hsgd.data convert`")


def missing_key_error(path, key: str, available: Iterable[Tuple[str, tuple, str]],
                      argument: str) -> InputValueError:
    """The error for a data set ``key`` absent from ``path``, listing what exists."""
    listing = ", ".join(f"'{name}' {shape} {dtype}" for name, shape, dtype in available)
    return InputValueError(f"'{path}' has no data set '{key}'; it has: {listing or 'nothing'}; "
                           f"pass {argument}= naming one of them")


def check_x_dtype(dtype, name: str) -> None:
    """Samples must be numbers that torch can hold (bool, int, uint, float, complex)."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "biufc":
        raise InputValueError(f"x data set '{name}' has dtype {dtype}, which is not numeric; "
                              "store samples as integers or floats (e.g. float32)")
    try:
        torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("=")))
    except TypeError:
        raise InputValueError(f"x data set '{name}' has dtype {dtype}, which torch does not "
                              "support; store samples as float32 or float64") from None


def check_y(dtype, shape, name: str, per_position: bool = False) -> None:
    """Labels must be integers, one per sample: a 1-D array; with ``per_position`` also one per
    position of a sample, ``(N, *label_shape)`` (next-token targets of token data)."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise InputValueError(f"y data set '{name}' has dtype {dtype}; labels must be integer "
                              "class indices (convert them with y.astype(np.int64))")
    if len(shape) == 0 and per_position:
        raise InputValueError(f"y data set '{name}' is a scalar; labels need one row per sample")
    if len(shape) != 1 and not per_position:
        raise InputValueError(f"y data set '{name}' has shape {tuple(shape)}; labels must be "
                              "1-D, one integer per sample (flatten them with y.reshape(-1))")


def check_lengths(num_x: int, num_y: int, x_name: str, y_name: str) -> None:
    """x and y must hold the same, non-zero, number of samples."""
    if num_x != num_y:
        raise InputValueError(f"x '{x_name}' has {num_x} samples but y '{y_name}' has {num_y} "
                              "labels; every sample needs exactly one label")
    if num_x == 0:
        raise InputValueError(f"x '{x_name}' has zero samples; there is nothing to train on, "
                              "write at least one sample per rank")


def check_labels_nonnegative(labels: np.ndarray, name: str, offset: int = 0) -> None:
    """Labels are class indices: raise at the first negative one."""
    labels = np.asarray(labels)
    if labels.dtype.kind != "i" or labels.size == 0:
        return
    if labels.min() < 0:
        where = int(np.argmax(labels < 0))
        raise InputValueError(f"y data set '{name}' has a negative label {labels[where]} at "
                              f"sample {offset + where}; labels must be class indices >= 0")
