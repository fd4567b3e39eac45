"""Reading an :class:`~hsgd._io.plan.EpochPlan` window by window, in the background.

:func:`iter_windows` reads each window's segments with
:meth:`~hsgd._io.h5source.H5Source.read` (one contiguous row range each, straight into
a preallocated buffer), asks the kernel to start on the next window, shuffles, and
yields the window's batches; :class:`Prefetcher` runs it in a daemon thread, at most
``prefetch`` windows ahead of the consumer.

Invariant: a batch is a view of its window's array, refilled only when no batch of it
is alive any more (:class:`_BufferPool`): a batch stays valid while the caller holds it.

Direct reads (``os.preadv``) and the shuffle release the GIL; h5py's reads hold h5py's
global lock. The shuffle runs on torch's intra-op threads: under MPI, set
``OMP_NUM_THREADS`` (or ``torch.set_num_threads``) to the cores per rank, since
oversubscribed threads made it several times slower.
"""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import threading
import weakref
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from .h5source import H5Source

__all__ = ["iter_windows", "Prefetcher"]

logger = logging.getLogger(__name__)

_END = object()
# Free-threaded CPython defers reference counts: never reuse buffers there.
_REFCOUNTS_EXACT = getattr(sys, "_is_gil_enabled", lambda: True)()


class _BufferPool:
    """Output arrays for windows, reused only once nothing refers to them any more.

    A batch is a view of its window's array and keeps that array alive, so an
    array whose only reference is this pool is provably unused: it can be
    refilled without touching any batch the caller still holds. Reusing
    arrays saves the page faults of fresh memory (as costly as the shuffle).
    """

    def __init__(self, source: H5Source, capacity: int, keep: int):
        self.source, self.capacity, self.keep = source, capacity, keep
        self.free: List[tuple] = []

    def get(self, rows: int):
        """Uninitialized ``(x, y)`` views of ``rows`` samples."""
        if rows > self.capacity:
            return self.source.empty(rows)
        for pair in self.free if _REFCOUNTS_EXACT else ():
            # 2 = the pair tuple + getrefcount's argument: no view is alive.
            if sys.getrefcount(pair[0]) == 2 and sys.getrefcount(pair[1]) == 2:
                return pair[0][:rows], pair[1][:rows]
        pair = self.source.empty(self.capacity)
        if len(self.free) < self.keep:
            self.free.append(pair)
        return pair[0][:rows], pair[1][:rows]


def _read_segments(source: H5Source, segments, x_out, y_out) -> None:
    offset = 0
    for start, stop in segments:
        rows = int(stop - start)
        source.read(int(start), int(stop), x_out[offset:offset + rows],
                    y_out[offset:offset + rows])
        offset += rows


def _assemble(source, plan, window, order, skip, carry, scratch, pool):
    """Carry + window ``window`` from ``skip`` on, in yield ``order``: ``(x, y)``."""
    size, held = plan.window_size(window), len(carry[1])
    if plan.shuffle:
        if scratch[0] is None or len(scratch[1]) < size:
            scratch[:] = source.empty(size)
        raw_x, raw_y = scratch[0][:size], scratch[1][:size]
        _read_segments(source, plan.window_segments(window), raw_x, raw_y)
        order = torch.from_numpy(order[skip:])
        x, y = pool.get(held + len(order))
        torch.index_select(torch.from_numpy(raw_x), 0, order, out=torch.from_numpy(x[held:]))
        torch.index_select(torch.from_numpy(raw_y), 0, order, out=torch.from_numpy(y[held:]))
    else:
        x, y = pool.get(held + size)
        _read_segments(source, plan.window_segments(window), x[held:], y[held:])
        x, y = x[skip:], y[skip:]  # skip > 0 only on the first window, where held == 0
    x[:held], y[:held] = carry[0], carry[1]
    return x, y


def iter_windows(source: H5Source, plan, start_batch: int = 0, with_indices: bool = False,
                 keep_buffers: int = 4) -> Iterator[List[tuple]]:
    """Yield, per window, the list of batches ``(x, y[, idx])`` it completes.

    ``keep_buffers``: output arrays kept for reuse (windows in flight + 2).

    With ``shuffle=True`` a window is first read into one reused scratch buffer and then
    gathered into its output array in shuffled order (``torch.index_select``, one copy);
    with ``shuffle=False`` it is read directly into the output. Batches are
    ``torch.from_numpy`` views and one ``split``, no further copy; a batch that spans two
    windows copies the first window's tail (fewer than ``batch_size`` samples). A loader
    that was never closed leaves its thread running at interpreter exit, possibly inside
    HDF5: :func:`_stop_all_at_exit` stops it before h5py's own exit hook touches HDF5.
    """
    batch = plan.batch_size
    largest = max((plan.window_size(w) for w in range(plan.num_windows)), default=0)
    pool = _BufferPool(source, largest + batch, keep_buffers)
    first, skip = plan.locate(start_batch)
    empty_idx = np.empty(0, dtype=np.int64)
    carry: Tuple[np.ndarray, np.ndarray, np.ndarray] = (*source.empty(0), empty_idx)
    scratch = [None, None]
    for window in range(first, plan.num_windows):
        if window + 1 < plan.num_windows:  # the kernel fetches it while we work on this one
            source.advise(plan.window_segments(window + 1))
        order = plan.window_order(window)
        x, y = _assemble(source, plan, window, order, skip, carry, scratch, pool)
        idx = (np.concatenate([carry[2], plan.window_indices(window, order)[skip:]])
               if with_indices else empty_idx)
        skip, full = 0, len(y) // batch * batch
        yield _batches(x, y, idx, full, batch, with_indices)
        carry = (x[full:], y[full:], idx[full:] if with_indices else empty_idx)
    if len(carry[1]):
        yield _batches(*carry, len(carry[1]), batch, with_indices)


def _batches(x, y, idx, rows, batch, with_indices) -> List[tuple]:
    """The first ``rows`` samples as batch views (one ``torch.split`` per array)."""
    if rows == 0:
        return []
    arrays = (x, y, idx) if with_indices else (x, y)
    return list(zip(*(torch.from_numpy(a[:rows]).split(batch) for a in arrays)))


def _produce(windows, out: queue.Queue, stop: threading.Event) -> None:
    """Thread body: put every window's batches, then ``_END`` (or the exception)."""
    try:
        for item in windows:
            if not _put(out, item, stop):
                return
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer
        _put(out, exc, stop)
        return
    _put(out, _END, stop)


def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _shutdown(stop: threading.Event, out: queue.Queue, thread) -> None:
    stop.set()
    while True:  # drop queued windows so their memory goes now
        try:
            out.get_nowait()
        except queue.Empty:
            break
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=60)
        if thread.is_alive():
            logger.warning("hsgd prefetch thread still reading after 60 s; leaving it")


_LIVE: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    """atexit hook: stop every prefetch thread while HDF5 is still safe to use.

    h5py's atexit hook (``h5py._conv.unregister_converters``) calls HDF5
    without h5py's lock, and h5py releases the GIL inside ``H5Dread``; HDF5 is
    not thread-safe, so a prefetch thread still reading through h5py at exit
    ran in HDF5 at the same time and crashed the process (SIGSEGV in
    ``H5CX_pop``). ``weakref.finalize``'s own exit hook stops the thread too
    late: it is registered when torch is imported, usually before h5py, and
    atexit runs hooks last-registered first.
    """
    for prefetcher in list(_LIVE):
        prefetcher.close()


def _register_exit_hook() -> None:
    """(Re-)register :func:`_stop_all_at_exit` as the newest atexit hook.

    Done whenever a thread starts, so that it runs before every hook
    registered until then (h5py's included, whatever the import order).
    """
    atexit.unregister(_stop_all_at_exit)
    atexit.register(_stop_all_at_exit)


class Prefetcher:
    """Iterate batches of ``iter_windows(...)``; ``prefetch`` windows ahead in a thread.

    ``prefetch=0`` reads in the calling thread. An exception in the thread is
    re-raised by ``__next__``. :meth:`close` stops the thread (also run when
    the object is collected, and at interpreter exit).
    """

    def __init__(self, windows: Iterator[List[tuple]], prefetch: int):
        self._pending: List[tuple] = []
        self._done = False
        self._windows: Optional[Iterator] = windows if prefetch == 0 else None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if prefetch > 0:
            self._thread = threading.Thread(target=_produce, name="hsgd-prefetch",
                                            args=(windows, self._queue, self._stop),
                                            daemon=True)
        self._finalizer = weakref.finalize(self, _shutdown, self._stop,
                                           self._queue, self._thread)
        if self._thread is not None:
            _LIVE.add(self)
            _register_exit_hook()
            self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple:
        while not self._pending:
            if self._done:
                raise StopIteration
            item = self._next_window()
            if item is _END:
                self._done = True
                self.close()
                raise StopIteration
            self._pending = list(reversed(item))
        return self._pending.pop()

    def _next_window(self):
        if self._stop.is_set():
            raise RuntimeError("this batch iterator was closed; start a new one")
        if self._windows is not None:
            return next(self._windows, _END)
        assert self._thread is not None  # prefetch > 0: the thread reads the windows
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("hsgd prefetch thread ended without a result") from None
                continue
            if isinstance(item, BaseException):
                self.close()
                raise item
            return item

    def close(self) -> None:
        """Stop the reader thread and drop prefetched windows. Idempotent."""
        self._pending = []
        self._finalizer()
