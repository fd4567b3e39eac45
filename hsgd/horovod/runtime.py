"""``hvd.init()`` and what it sets up: the world, its topology, the status queries, the op codes.

Invariants: :func:`init` is idempotent and collective over the world it is given
(``MPI.COMM_WORLD`` by default); every query before it raises ``ValueError``, as
Horovod's do; the ``*_built`` and ``*_enabled`` answers describe this package (MPI, no
NCCL, gloo, CCL or ROCm kernels: CUDA tensors are staged through host memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import InputValueError

if TYPE_CHECKING:  # importing mpi4py.MPI initializes MPI: not at import time
    from mpi4py import MPI

    from ..topology import Topology

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "world",
           "init_world", "shutdown_world", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
           "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"]

# Horovod's ReduceOp values (horovod/common/message.h), so that stored op codes mean the same.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class HorovodInternalError(RuntimeError):
    """What a collective raises when it cannot complete: the ranks passed different tensors, names
    or roots, the operation is not supported with ``join()``, or it stalled. Raised on every rank
    that took part (a ``RuntimeError``, as Horovod's own)."""


class _World:
    """The communicator :func:`init` was given and its :class:`~hsgd.Topology` (nodes)."""

    def __init__(self, comm: MPI.Intracomm, topology: Topology):
        self.comm, self.topology = comm, topology


_world: Optional[_World] = None


def world() -> _World:
    """The initialized world; ``ValueError`` (Horovod's message) before :func:`init`."""
    if _world is None:
        raise InputValueError("Horovod has not been initialized; use hvd.init().")
    return _world


def init_world(comm: Any = None) -> bool:
    """Set up the world over ``comm`` (an mpi4py communicator or a list of ranks of
    ``MPI.COMM_WORLD``; default the whole world). False if it was set up already."""
    global _world
    if _world is not None:
        return False
    from mpi4py import MPI

    from ..topology import Topology

    if comm is None:
        comm = MPI.COMM_WORLD
    elif not isinstance(comm, MPI.Comm):
        ranks = sorted(int(r) for r in comm)  # Horovod: a list of ranks of the world
        mine = MPI.COMM_WORLD.Get_rank() in ranks
        comm = MPI.COMM_WORLD.Split(0 if mine else MPI.UNDEFINED, MPI.COMM_WORLD.Get_rank())
        if not mine:
            raise InputValueError(f"hvd.init(comm={ranks}) on rank {MPI.COMM_WORLD.Get_rank()}, which is not "
                                  "in the list; call it on the listed ranks only")
    _world = _World(comm, Topology.from_comm(comm))
    return True


def shutdown_world() -> None:
    """Free what :func:`init_world` built (collective)."""
    global _world
    if _world is not None:
        _world.topology.close()
        _world = None


def is_initialized() -> bool:
    """Whether :func:`~hsgd.horovod.init` ran (and :func:`~hsgd.horovod.shutdown` did not since)."""
    return _world is not None


def rank() -> int:
    """This process's rank in the world given to ``init()``."""
    return world().comm.Get_rank()


def size() -> int:
    """The number of ranks in the world."""
    return world().comm.Get_size()


def local_rank() -> int:
    """This rank's index on its node (the node as hsgd's averaging sees it: ``HSGD_RANKS_PER_NODE``
    splits a host into virtual nodes)."""
    return world().topology.local_rank


def local_size() -> int:
    """The number of ranks on this rank's node."""
    return world().topology.local_size


def cross_rank() -> int:
    """Which node this rank is on (0-based, ordered by each node's lowest rank)."""
    return world().topology.node_index


def cross_size() -> int:
    """The number of nodes."""
    return world().topology.num_nodes


def is_homogeneous() -> bool:
    """Whether every node holds the same number of ranks."""
    return world().topology.equal_nodes


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE``."""
    world()
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def _answer(name: str, value: Any, doc: str) -> Callable[[], Any]:
    """A query that always answers ``value`` (what this build has), named and described as Horovod's."""
    def query() -> Any:
        return value
    query.__name__ = query.__qualname__ = name
    query.__doc__ = doc
    return query


mpi_enabled = _answer("mpi_enabled", True, "True: every collective runs over MPI.")
mpi_built = _answer("mpi_built", True, "True: hsgd is built on MPI (mpi4py).")
gloo_enabled = _answer("gloo_enabled", False, "False: there is no gloo controller.")
gloo_built = _answer("gloo_built", False, "False: there is no gloo controller.")
nccl_built = _answer("nccl_built", 0, "0: no NCCL kernels (Horovod returns the NCCL version, 0 without).")
ddl_built = _answer("ddl_built", False, "False: no IBM DDL.")
ccl_built = _answer("ccl_built", False, "False: no oneCCL.")
cuda_built = _answer("cuda_built", False,
                     "False: no CUDA kernels of its own; CUDA tensors are staged through host memory.")
rocm_built = _answer("rocm_built", False, "False: no ROCm kernels.")
