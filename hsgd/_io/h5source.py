"""Reading row ranges of an HDF5 sample/label pair into preallocated buffers.

:class:`H5Source` is the only code that reads the loader's file; each call of
:meth:`H5Source.read` reads one contiguous row range of x and of y. Uncompressed data
sets are read *directly*: HDF5 reports where their bytes live in the file
(``H5Dget_offset`` for contiguous layout, the chunk index for chunked layout with
whole-sample chunks), so a row range is one ``os.preadv`` per run of adjacent chunks,
straight into the buffer. That skips HDF5's per-call overhead and releases the GIL
while reading; the same byte ranges feed ``posix_fadvise(WILLNEED)``. Compressed or
filtered data, non-native byte order, external or virtual storage and unallocated
chunks go through h5py's ``read_direct``. A direct reader checks itself against h5py
on the first and last rows when it is built, and falls back to h5py on any difference.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import List, Optional, Tuple

import h5py
import numpy as np

__all__ = ["H5Source"]

logger = logging.getLogger(__name__)


class _Extents:
    """File byte ranges of row ranges: fixed-row chunks (one chunk if contiguous)."""

    def __init__(self, row_bytes: int, chunk_rows: int, offsets: np.ndarray):
        self.row_bytes, self.chunk_rows, self.offsets = row_bytes, chunk_rows, offsets

    def ranges(self, start: int, stop: int) -> List[List[int]]:
        """``[file offset, bytes]`` pieces of rows ``[start, stop)``, adjacent ones merged."""
        pieces: List[List[int]] = []
        rows = self.chunk_rows
        for k in range(start // rows, (stop - 1) // rows + 1):
            lo, hi = max(start, k * rows), min(stop, (k + 1) * rows)
            offset = int(self.offsets[k]) + (lo - k * rows) * self.row_bytes
            if pieces and pieces[-1][0] + pieces[-1][1] == offset:
                pieces[-1][1] += (hi - lo) * self.row_bytes
            else:
                pieces.append([offset, (hi - lo) * self.row_bytes])
        return pieces


def _chunk_offsets(dset) -> Optional[np.ndarray]:
    rows = dset.chunks[0]
    offsets = np.full(-(-dset.shape[0] // rows), -1, dtype=np.int64)

    def note(info):
        offsets[info.chunk_offset[0] // rows] = info.byte_offset
    if hasattr(dset.id, "chunk_iter"):
        dset.id.chunk_iter(note)
    else:
        for index in range(dset.id.get_num_chunks()):
            note(dset.id.get_chunk_info(index))
    return None if (offsets < 0).any() else offsets


def _extents(dset) -> Optional[_Extents]:
    """Where the rows of ``dset`` are in the file, or None when h5py must read them."""
    plist = dset.id.get_create_plist()
    if (not dset.dtype.isnative or plist.get_nfilters() or plist.get_external_count()
            or dset.is_virtual or dset.ndim == 0 or dset.shape[0] == 0):
        return None
    row_bytes = dset.dtype.itemsize * int(np.prod(dset.shape[1:]))
    if row_bytes == 0:
        return None
    if plist.get_layout() == h5py.h5d.CONTIGUOUS:
        offset = dset.id.get_offset()
        return None if offset is None else _Extents(row_bytes, dset.shape[0], np.array([offset]))
    if plist.get_layout() == h5py.h5d.CHUNKED and dset.chunks[1:] == dset.shape[1:]:
        offsets = _chunk_offsets(dset)
        return None if offsets is None else _Extents(row_bytes, dset.chunks[0], offsets)
    return None


class _RowReader:
    """Rows of one data set into a C-contiguous buffer: direct when possible."""

    def __init__(self, dset, fd: int, direct: bool):
        self.dset, self.fd = dset, fd
        self.extents = _extents(dset) if direct else None
        if self.extents is not None and not self._agrees_with_h5py():
            logger.warning("direct reads of '%s' differ from h5py; using h5py", dset.name)
            self.extents = None

    def _agrees_with_h5py(self) -> bool:
        last = self.dset.shape[0] - 1
        for row in {0, last}:
            mine = np.empty((1, *self.dset.shape[1:]), dtype=self.dset.dtype)
            self._pread(row, row + 1, mine)
            if mine.tobytes() != self.dset[row:row + 1].tobytes():
                return False
        return True

    def read(self, start: int, stop: int, out: np.ndarray) -> None:
        if self.extents is None or out.dtype != self.dset.dtype:
            self.dset.read_direct(out, source_sel=np.s_[start:stop])
        else:
            self._pread(start, stop, out)

    def _pread(self, start: int, stop: int, out: np.ndarray) -> None:
        assert self.extents is not None  # read() comes here only with extents
        # numpy's stubs give ndarray the buffer protocol only from Python 3.12 (__buffer__)
        view = memoryview(out).cast("B")  # type: ignore[arg-type]
        done = 0
        for offset, size in self.extents.ranges(start, stop):
            piece, got = view[done:done + size], 0
            while got < size:  # preadv may return early; 0 means the file is short
                step = os.preadv(self.fd, [piece[got:]], offset + got)
                if step == 0:
                    raise OSError(f"unexpected end of file reading '{self.dset.name}'")
                got += step
            done += size

    def advise(self, start: int, stop: int) -> None:
        if self.extents is not None and hasattr(os, "posix_fadvise"):
            for offset, size in self.extents.ranges(start, stop):
                os.posix_fadvise(self.fd, offset, size, os.POSIX_FADV_WILLNEED)


class H5Source:
    """An open HDF5 file with its x and y data sets; :meth:`close` closes both handles.

    ``direct=False`` reads everything through h5py's ``read_direct``.
    """

    def __init__(self, file: h5py.File, x_key: str, y_key: str, direct: bool = True):
        self.file, self.x, self.y = file, file[x_key], file[y_key]
        self.x_dtype = np.dtype(self.x.dtype).newbyteorder("=")
        self.sample_shape = tuple(self.x.shape[1:])
        self.label_shape = tuple(self.y.shape[1:])  # () for one label per sample
        with contextlib.ExitStack() as undo:  # if the readers cannot be made: close the file
            self._fd = os.open(file.filename, os.O_RDONLY) if direct else -1
            undo.callback(self.close)
            self._x = _RowReader(self.x, self._fd, direct)
            self._y = _RowReader(self.y, self._fd, direct)
            undo.pop_all()

    @property
    def direct(self) -> bool:
        """Whether x is read with ``os.preadv`` (else through h5py)."""
        return self._x.extents is not None

    def read(self, start: int, stop: int, x_out: np.ndarray, y_out: np.ndarray) -> None:
        """Read rows ``[start, stop)`` of x and y: one contiguous range each."""
        self._x.read(start, stop, x_out)
        self._y.read(start, stop, y_out)

    def advise(self, segments) -> None:
        """Ask the kernel to start fetching these row ranges (direct reads only)."""
        for start, stop in segments:
            self._x.advise(int(start), int(stop))
            self._y.advise(int(start), int(stop))

    def empty(self, rows: int) -> Tuple[np.ndarray, np.ndarray]:
        """Uninitialized x (native dtype) and int64 y buffers for ``rows`` samples."""
        return (np.empty((rows, *self.sample_shape), dtype=self.x_dtype),
                np.empty((rows, *self.label_shape), dtype=np.int64))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.file.close()
