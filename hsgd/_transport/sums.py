"""In-place sums across a communicator that reach the wire limit at any party count.

Level 2 (:mod:`hsgd.inter_node`, through :mod:`hsgd.compression` too) sums each
node's buffer over the leaders. For a party count that is a power of two (or 2) that
is ``MPI_Allreduce``; otherwise (:func:`splits`) a reduce-scatter into a scratch block
of about ``n / p`` elements, then an allgather back into the buffer: the same bytes
as a ring, at the price of a scratch buffer of the buffer's size. Measurements:
docs/benchmarks-appendix.md ("Three hosts: where ``MPI_Allreduce`` folds").

:func:`sum_` blocks; :func:`start_sum` returns the steps as functions
``() -> request``, to be started one after another (the second needs the
first's result), which :class:`hsgd.inter_node.Pending` does.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from .._core.traffic import sum_splits

__all__ = ["splits", "sum_", "start_sum"]


def splits(comm) -> bool:
    """Whether sums over ``comm`` go as reduce-scatter + allgather
    (:func:`hsgd._core.traffic.sum_splits` of its size)."""
    return sum_splits(comm.Get_size())


def _blocks(comm, array: np.ndarray):
    """Each party's block of ``array`` (counts and offsets, as even as they go) and this rank's
    scratch block."""
    p, n = comm.Get_size(), array.size
    counts = [n // p + (i < n % p) for i in range(p)]
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
    return counts, offsets, np.empty(counts[comm.Get_rank()], dtype=array.dtype)


@functools.cache
def _predefined(dtype: np.dtype) -> MPI.Datatype:
    """The predefined MPI type of ``dtype``. mpi4py's ``from_numpy_dtype`` returns a duplicate of
    it, a derived type, which Open MPI's own reduction operations refuse (``MPI_ERR_OP``): the
    type it duplicates is taken, and the duplicate freed."""
    duplicate = from_numpy_dtype(dtype)
    try:
        base, combiner, _ = duplicate.decode()
    finally:
        duplicate.Free()
    assert combiner == "DUP", combiner  # an elementary dtype's type is a duplicate of a predefined one
    return base


def _spec(array: np.ndarray, mpi_type: Optional[MPI.Datatype], *layout):
    """mpi4py's buffer argument: the array, its layout (counts, offsets) if given, and its MPI
    type (``None``: the predefined type of numpy's dtype, which MPI's own operations take)."""
    return [array, *layout, _predefined(array.dtype) if mpi_type is None else mpi_type]


def _exchange(comm, array, mpi_type, counts, offsets):
    """The reduce-scatter's exchange: party ``j`` gets every party's block ``j`` (``MPI_Alltoallv``
    into ``received``, ``p`` blocks of this rank's count); returns ``received`` and the layouts."""
    p, me = comm.Get_size(), comm.Get_rank()
    received = np.empty(p * counts[me], dtype=array.dtype)
    into = ([counts[me]] * p, [j * counts[me] for j in range(p)])
    return received, _spec(array, mpi_type, counts, offsets), _spec(received, mpi_type, *into)


def _reduce_blocks(comm, received: np.ndarray, block: np.ndarray, op, mpi_type) -> None:
    """Sum the ``p`` blocks of ``received`` into ``block`` with ``op``, in rank order
    (``MPI_Reduce_local``, which applies user-defined operations, the 16-bit codecs' too)."""
    if block.size == 0:
        return
    parts = received.reshape(comm.Get_size(), block.size)
    block[:] = parts[0]
    for part in parts[1:]:
        op.Reduce_local(_spec(part, mpi_type), _spec(block, mpi_type))


def sum_(comm, array: np.ndarray, op=MPI.SUM, mpi_type: Optional[MPI.Datatype] = None) -> None:
    """Sum ``array`` (contiguous) over ``comm`` in place with ``op``; ``mpi_type``: the MPI type of
    its elements when numpy's is not it (16-bit floats travel as ``MPI.INT16_T``)."""
    if not splits(comm):
        comm.Allreduce(MPI.IN_PLACE, _spec(array, mpi_type), op=op)
        return
    # MPI_Allreduce is bandwidth-optimal (2 (p-1)/p of the buffer per party) only for a
    # power-of-two p: MPICH folds other counts onto one, the extra parties sending their
    # whole buffer to a partner and getting the whole result back. Hence reduce-scatter +
    # allgather. The reduce-scatter is not MPI_Reduce_scatter either: below 512 KiB MPICH
    # reduces-scatters by recursive halving, which folds again. So every party sends each
    # other party its block (the ring's bytes, (p-1)/p of the buffer) and reduces what it got.
    counts, offsets, block = _blocks(comm, array)
    received, send, recv = _exchange(comm, array, mpi_type, counts, offsets)
    comm.Alltoallv(send, recv)
    _reduce_blocks(comm, received, block, op, mpi_type)
    comm.Allgatherv(_spec(block, mpi_type), _spec(array, mpi_type, counts, offsets))


def start_sum(comm, array: np.ndarray, op=MPI.SUM,
              mpi_type: Optional[MPI.Datatype] = None) -> List[Callable[[], MPI.Request]]:
    """:func:`sum_` as non-blocking steps, each ``() -> request``, to start in order, each once
    the one before it completed; ``array`` holds the sums when the last one has."""
    if not splits(comm):
        return [lambda: comm.Iallreduce(MPI.IN_PLACE, _spec(array, mpi_type), op=op)]
    counts, offsets, block = _blocks(comm, array)
    received, send, recv = _exchange(comm, array, mpi_type, counts, offsets)

    def gather() -> MPI.Request:
        _reduce_blocks(comm, received, block, op, mpi_type)
        return comm.Iallgatherv(_spec(block, mpi_type), _spec(array, mpi_type, counts, offsets))
    return [lambda: comm.Ialltoallv(send, recv), gather]
