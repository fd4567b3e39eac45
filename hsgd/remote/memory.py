"""``RemoteMemory``: a region of remote memory that ranks write, read and accumulate into.

Memory on another machine used as a device (Soft Memory Box; ``shared/PAPERS.md``):
workers write, read and accumulate, and the owner runs no code for any of it. One
array of ``numel`` elements of one ``dtype``, sharded in contiguous blocks over
``owners`` (default: each node's leader); offsets are global. Every rank runs::

    >>> mem = RemoteMemory(comm, 1000)        # collective; zero-filled
    >>> mem.accumulate(0, torch.ones(1000))   # element-wise atomic sum
    >>> comm.Barrier()                         # orders it before the read below
    >>> mem.read(0, torch.empty(10))           # every element is comm.size now
    >>> mem.close()                            # collective

When an operation returns its data is in the region (or the reader's buffer); bad
arguments and use after :meth:`close` raise before any MPI call. Design: docs/box.md.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .._core.closable import Closable
from .._core.meter import Meter
from ..topology import Topology
from .control import ControlWords
from .layout import DTYPES, agree_owners, pieces, shard_bounds
from .pacing import LEAST_BYTES, Pacer
from .progress_thread import IDLE_S, Doorbells
from .reads import get_windowed

__all__ = ["RemoteMemory", "DTYPES", "DEFAULT_CHUNK_BYTES"]

# The largest single RMA transfer. Single multi-hundred-megabyte RMA operations stall on some
# MPIs, and across hosts over TCP accumulates of 4 MiB chunks ran below the wire rate where
# those of 1 MiB did not (docs/benchmarks-appendix.md, the cost model against emulated links).
DEFAULT_CHUNK_BYTES = 1 << 20

class RemoteMemory(Closable):
    """A region of ``numel`` elements of ``dtype``, sharded over ``owners``. Collective.

    Args:
        comm: the ranks that use the region (an ``mpi4py`` intracommunicator; ``None``: the world).
        numel: elements in the region.
        dtype: ``torch.float32`` (default), ``float64``, ``int32`` or ``int64``.
        owners: the ranks that hold the region's memory, in contiguous shards
            of (nearly) equal size in rank order; default one per node, its
            leader (nodes as :meth:`hsgd.Topology.from_comm` sees them).
        chunk_bytes: the largest single RMA transfer.
        topology: a :class:`~hsgd.Topology` over ``comm`` to take the nodes
            from (default: built here and freed again).
        progress_idle: across hosts, how often (seconds) an owner's progress thread polls while
            no doorbell comes in (``hsgd.remote.progress_thread``); a region read only now and
            then can afford a slow poll.
        meter: what the bytes this rank reads, writes and accumulates count in: the owners on
            its node's as ``intra_bytes``, the others' as ``inter_bytes`` (default a
            :class:`~hsgd._core.meter.Meter` of its own; a mode gives its own).

    The region starts zero-filled.
    """

    def __init__(self, comm: Optional[MPI.Intracomm], numel: int, dtype: torch.dtype = torch.float32,
                 owners: Optional[Sequence[int]] = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 topology: Optional[Topology] = None, progress_idle: float = IDLE_S,
                 meter: Optional[Meter] = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        owners, node_ranks = agree_owners(comm, numel, dtype, owners, chunk_bytes, topology)
        self.comm, self.numel, self.dtype, self.owners = comm, int(numel), dtype, owners
        self._np_dtype, self._mpi_type = DTYPES[dtype]
        self.itemsize = np.dtype(self._np_dtype).itemsize
        self._chunk = max(1, int(chunk_bytes) // self.itemsize)
        self._starts = bounds = shard_bounds(self.numel, len(owners))  # owners[i]: [bounds[i], bounds[i + 1])
        rank = comm.Get_rank()
        self._local = {owner for owner in owners if owner in node_ranks}
        self.meter = Meter() if meter is None else meter
        shard = int(bounds[owners.index(rank) + 1] - bounds[owners.index(rank)]) if rank in owners else 0

        info = MPI.Info.Create()
        info.update({"accumulate_ordering": "none", "same_disp_unit": "true"})
        # Allocate, not Create: MPI may then put the memory where ranks on the same host reach
        # it directly (_shared_view). Owners allocate their shard, the others nothing.
        self._win = MPI.Win.Allocate(shard * self.itemsize, self.itemsize, info, comm)
        # Over plain TCP the owner's MPI library moves the data, so an owner on another host must
        # make progress: origins ring its doorbell before each operation and its progress thread
        # polls MPI (hsgd.remote.progress_thread). With RDMA in hardware the owner needs none of it.
        self._bells = Doorbells(comm, serves=rank in owners, idle=progress_idle)
        # The lock and the version counter, in a small second window on owners[0]. Not mpi4py's
        # util.sync.Mutex and Counter: they open a lock epoch per operation (see below).
        self._ctl = ControlWords(comm, owners[0], info, self._bells)
        info.Free()
        # One passive-target epoch for the window's whole life (closed in _close), and no lock
        # per operation: MPICH grants a passive-target lock only when the owner enters MPI, so
        # an owner busy computing would delay every other rank. NOCHECK is valid because this
        # window is only ever locked shared.
        self._win.Lock_all(MPI.MODE_NOCHECK)
        # Zero the own shard (Win.Allocate does not), then make it visible to all.
        if shard:
            np.frombuffer(self._win.tomemory(), dtype=self._np_dtype)[:] = 0  # type: ignore[call-overload]  # numpy's stubs take no mpi4py buffer before Python 3.12
        self._win.Sync()
        comm.Barrier()
        self._direct = {owner: view for owner in self._local
                        if (view := self._shared_view(owner)) is not None}
        self._pending: Optional[Tuple[np.ndarray, List[int]]] = None
        self._reading: Dict[Tuple[int, int, int], Tuple[MPI.Request, np.ndarray]] = {}  # read_within's
        self._pacers: Dict[int, Pacer] = {}  # the read pieces' size, per owner on another host
        self._opened()

    def _shared_view(self, owner: int) -> Optional[np.ndarray]:
        """``owner``'s shard as this process's memory, where the MPI maps it here.

        Owners on the caller's node are then read and written by load and store. MPICH maps
        ``Win.Allocate`` windows; Open MPI 5 does not, and the same operations go through RMA,
        which it also does over shared memory.
        """
        index = self.owners.index(owner)
        count = int(self._starts[index + 1] - self._starts[index])
        if owner == self.comm.Get_rank():
            mem = self._win.tomemory()
        else:
            try:
                mem, _ = self._win.Shared_query(owner)
            except MPI.Exception:  # Open MPI 5: only for Allocate_shared windows
                return None
        if count == 0 or len(mem) < count * self.itemsize:
            return None
        return np.frombuffer(mem, dtype=self._np_dtype, count=count)  # type: ignore[call-overload]  # numpy's stubs take no mpi4py buffer before Python 3.12

    # --- checks, before any MPI call ----------------------------------------------------
    def _check_transfer(self, what: str, offset, tensor) -> int:
        self._check_open()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != self.dtype:
            raise TypeError(f"{what}: the tensor is {tensor.dtype}, the region holds {self.dtype}; "
                            f"convert it with .to({self.dtype})")
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
            raise TypeError(f"{what}: offset must be an int, got {type(offset).__name__}")
        offset, count = int(offset), tensor.numel()
        if offset < 0 or offset + count > self.numel:
            raise ValueError(f"{what}: elements [{offset}, {offset + count}) are outside the region's "
                             f"[0, {self.numel})")
        return offset

    # --- the pieces of a transfer ---------------------------------------------------------
    def _count(self, owner: int, nelem: int) -> None:
        nbytes = nelem * self.itemsize
        if owner in self._local:
            self.meter.add_intra(nbytes)
        else:
            self.meter.add_inter(nbytes)

    def _rma(self, op: str, owner: int, buf: np.ndarray, disp: int, flush: bool = True) -> None:
        for lo in range(0, len(buf), self._chunk):
            self._bells.ring(owner)
            part = buf[lo:lo + self._chunk]
            spec, target = [part, self._mpi_type], (disp + lo, len(part), self._mpi_type)
            if op == "put":
                self._win.Put(spec, owner, target)
            else:
                self._win.Accumulate(spec, owner, target, MPI.SUM)
            if flush:
                self._win.Flush(owner)

    def _pacer(self, owner: int) -> Pacer:
        pacer = self._pacers.get(owner)
        if pacer is None:
            most = self._chunk * self.itemsize  # a chunk_bytes below LEAST_BYTES caps the pieces too
            pacer = self._pacers[owner] = Pacer(most=most, least=min(LEAST_BYTES, most))
        return pacer

    # --- the operations ------------------------------------------------------------------------
    def write(self, offset: int, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (flattened) into elements ``[offset, offset + tensor.numel())``.

        When it returns the data is in the region. Not atomic against an
        accumulate into the same elements at the same time (like ``MPI_Put``).
        """
        offset = self._check_transfer("write", offset, tensor)
        src = tensor.detach().reshape(-1).cpu().contiguous().numpy()
        for owner, first, stop, disp in pieces(self._starts, self.owners, offset, src.size):
            view = self._direct.get(owner)
            if view is not None:
                view[disp:disp + stop - first] = src[first:stop]
                self._win.Sync()
            else:
                self._rma("put", owner, src[first:stop], disp)
            self._count(owner, stop - first)
        self._ctl.bump_version()

    def read(self, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (any shape, this region's dtype) from elements ``[offset, offset + out.numel())``."""
        offset = self._check_transfer("read", offset, out)
        flat = out.detach().reshape(-1)
        direct = out.device.type == "cpu" and flat.is_contiguous() and flat.data_ptr() == out.data_ptr()
        dst = flat.numpy() if direct else np.empty(flat.numel(), dtype=self._np_dtype)
        queues: Dict[int, Deque[Tuple[np.ndarray, int]]] = {}
        for owner, first, stop, disp in pieces(self._starts, self.owners, offset, dst.size):
            view = self._direct.get(owner)
            if view is not None:
                self._win.Sync()
                dst[first:stop] = view[disp:disp + stop - first]
            else:
                queues.setdefault(owner, deque()).append((dst[first:stop], disp))
            self._count(owner, stop - first)
        # Pieces sized by their time on the link, two in flight per owner, all owners at once
        # (hsgd.remote.reads.get_windowed says why).
        get_windowed(self._win, self._mpi_type, self.itemsize, self._bells,
                     {owner: self._pacer(owner) for owner in queues}, queues)
        if not direct:
            out.copy_(torch.from_numpy(dst).view(out.shape))
        return out

    def accumulate(self, offset: int, tensor: torch.Tensor) -> None:
        """Add ``tensor`` element-wise into ``[offset, offset + tensor.numel())``, atomically per element.

        Concurrent accumulates from any ranks into the same elements lose no
        update (``MPI_Accumulate`` with ``MPI_SUM``). When it returns the sum is in the region.
        """
        self.accumulate_start(offset, tensor)
        self.accumulate_wait()

    def accumulate_start(self, offset: int, tensor: torch.Tensor) -> None:
        """Issue :meth:`accumulate` and return at once; :meth:`accumulate_wait` completes it.

        ``tensor`` must not change until then (a CPU tensor is sent from its
        own memory). One accumulate may be pending; starting another waits for it first.
        """
        offset = self._check_transfer("accumulate", offset, tensor)
        self.accumulate_wait()
        src = tensor.detach().reshape(-1).cpu().contiguous().numpy()
        owners = []
        # Always RMA, also to owners on this node: MPI_Accumulate's per-element atomicity holds
        # only among accumulates, from whatever node.
        for owner, first, stop, disp in pieces(self._starts, self.owners, offset, src.size):
            self._rma("accumulate", owner, src[first:stop], disp, flush=False)
            self._count(owner, stop - first)
            owners.append(owner)
        self._pending = (src, owners)

    def accumulate_wait(self) -> None:
        """Complete the pending :meth:`accumulate_start`, if any: its sum is in the region now."""
        self._check_open()
        if self._pending is None:
            return
        _, owners = self._pending
        for owner in owners:
            self._bells.ring(owner)
            self._win.Flush(owner)
        self._pending = None
        self._ctl.bump_version()

    def read_within(self, offset: int, out: torch.Tensor, timeout: float) -> List[int]:
        """:meth:`read`, giving up on owners that do not answer within ``timeout`` seconds (a
        host that died or was cut off, a process stopped): returns those owners, whose
        elements of ``out`` are left as they were (empty: ``out`` is filled). A read given up on
        stays under way; the next call for the same elements waits for it first. For reports
        that must not hang (the stall inspector's)."""
        offset = self._check_transfer("read_within", offset, out)
        deadline = time.monotonic() + timeout
        flat, silent = out.detach().reshape(-1), []
        for owner, first, stop, disp in pieces(self._starts, self.owners, offset, flat.numel()):
            view = self._direct.get(owner)
            if view is not None:
                self._win.Sync()
                flat[first:stop] = torch.from_numpy(view[disp:disp + stop - first].copy())
                continue
            key = (owner, disp, stop - first)
            if key not in self._reading:
                buf = np.empty(stop - first, dtype=self._np_dtype)
                self._bells.ring(owner)
                self._reading[key] = (self._win.Rget([buf, self._mpi_type], owner, (disp, len(buf), self._mpi_type)),
                                      buf)
                self._count(owner, stop - first)
            request, buf = self._reading[key]
            while not request.Test():
                if time.monotonic() >= deadline:
                    break
                time.sleep(1e-3)
            else:
                del self._reading[key]
                flat[first:stop] = torch.from_numpy(buf)
                continue
            silent.append(owner)
        if not flat.is_contiguous() or flat.data_ptr() != out.data_ptr():
            out.copy_(flat.view(out.shape))
        return silent

    @property
    def version(self) -> int:
        """How many writes and accumulates (by any rank) have completed so far."""
        self._check_open()
        return self._ctl.version()

    # --- the lock ---------------------------------------------------------------------------------
    @contextmanager
    def lock(self) -> Iterator[RemoteMemory]:
        """A mutex over the whole region, among all ranks of ``comm``.

        Waits (polling with backoff, up to 2 ms between tries) while another
        rank holds it. Not re-entrant: taking it twice on one rank raises
        ``RuntimeError``. It excludes only other holders of this lock, not
        plain :meth:`write`/:meth:`read`/:meth:`accumulate` calls.
        """
        self._check_open()
        self._ctl.acquire()
        try:
            yield self
        finally:
            self._ctl.release()

    # --- life cycle ---------------------------------------------------------------------------------
    @property
    def shards(self) -> List[Tuple[int, int, int]]:
        """``(owner, first, stop)`` for every owner: it holds elements ``[first, stop)``."""
        return [(owner, int(self._starts[i]), int(self._starts[i + 1])) for i, owner in enumerate(self.owners)]

    @property
    def traffic(self) -> Meter:
        """The bytes this rank moved (``intra_bytes``, ``inter_bytes``): its meter's counts."""
        return self.meter

    @property
    def node_owners(self) -> List[int]:
        """The owners on this rank's node (their bytes count as ``intra_bytes``)."""
        return sorted(self._local)

    def direct_view(self, owner: int) -> Optional[np.ndarray]:
        """``owner``'s shard as a numpy array this process loads and stores directly, or
        ``None`` (another node, or an MPI that does not map it). Plain stores into it bypass
        the version counter and traffic counters; readers see them without any MPI call."""
        self._check_open()
        return self._direct.get(owner)

    def close(self) -> None:
        """Free the region. Collective; every operation completed on return. Idempotent."""
        if not self._closed:
            self.accumulate_wait()
        super().close()

    def _close(self) -> None:
        self._direct.clear()
        MPI.Request.Waitall([request for request, _ in self._reading.values()])
        self._reading.clear()
        self._win.Unlock_all()
        self._win.Free()
        self._ctl.free()
        self._bells.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"owners={list(self.owners)}"
        return f"RemoteMemory(numel={self.numel}, dtype={self.dtype}, {state})"
