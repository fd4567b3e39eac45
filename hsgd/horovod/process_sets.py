"""Process sets as MPI communicators, and ``init``/``shutdown``, which make and free them.

A :class:`ProcessSet` is a sorted list of world ranks; once registered (by ``init`` or
:func:`add_process_set`) its members hold a :class:`~hsgd.horovod.matching.Matcher` over a
communicator of just them. Adding and removing are collective over the world: every rank
calls them with the same ranks, in the same order, and a disagreement raises the same
``ValueError`` on every rank. Sets may be added and removed at any time (Horovod's dynamic
process sets, without ``HOROVOD_DYNAMIC_PROCESS_SETS``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from .._core.agree import check_all, collective_error
from ..errors import InputValueError
from . import runtime
from .matching import Matcher

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "init", "shutdown",
           "matcher_of", "matchers"]


class ProcessSet:
    """A set of ranks that run collectives together: ``ProcessSet([0, 2])`` or
    ``ProcessSet(mpi4py_comm)`` (in ``hvd.init(process_sets=...)`` only). Pass it as
    ``process_set=`` to a collective; ranks passed as ``root_rank`` stay world ranks.

    Attributes:
        process_set_id: its id once registered, else ``None``.
        ranks: its world ranks, sorted.
        mpi_comm: the communicator it was made from, if any.
    """

    process_set_id: Optional[int] = None
    ranks: Optional[List[int]] = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]):
        self._matcher: Optional[Matcher] = None
        if isinstance(ranks_or_comm, (list, tuple, range)):
            if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks_or_comm):
                raise InputValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py "
                                      "Comm object")
            self.ranks = sorted(ranks_or_comm)
            return
        from mpi4py import MPI

        if not isinstance(ranks_or_comm, MPI.Comm):
            raise InputValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py "
                                  "Comm object")
        self.mpi_comm = ranks_or_comm

    def size(self) -> Optional[int]:
        """Its number of ranks, or ``None`` before it is registered."""
        return None if self.process_set_id is None or self.ranks is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This rank's place in the set, or ``None`` (not registered, or not a member)."""
        if self.process_set_id is None or not self.included():
            return None
        assert self.ranks is not None  # registered
        return self.ranks.index(runtime.rank())

    def included(self) -> Optional[bool]:
        """Whether this rank is a member (``None`` before its ranks are known)."""
        if self.ranks is None:
            return None
        return runtime.rank() in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id, self._matcher = None, None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


#: The set of every rank (id 0); its ranks are known after ``init()``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_registered: Dict[int, ProcessSet] = {}


def matcher_of(process_set: ProcessSet) -> Matcher:
    """``process_set``'s matcher on this rank; ``ValueError`` if it is not registered here or this
    rank is not a member (Horovod's ``InvalidArgument``)."""
    runtime.world()
    if not isinstance(process_set, ProcessSet):
        raise InputValueError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None or _registered.get(process_set.process_set_id) is not process_set:
        raise InputValueError(f"{process_set} is not registered; add it with hvd.add_process_set() first")
    if process_set._matcher is None:
        raise InputValueError(f"rank {runtime.rank()} is not a member of {process_set}")
    return process_set._matcher


def matchers() -> List[Matcher]:
    """The matchers of every set this rank belongs to, global first."""
    return [ps._matcher for _, ps in sorted(_registered.items()) if ps._matcher is not None]


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Start Horovod's API over ``comm`` (default ``MPI.COMM_WORLD``; or a list of its ranks),
    with the ``process_sets`` to register. Collective; a second call does nothing."""
    if not runtime.init_world(comm):
        return
    world = runtime.world()
    global_process_set.ranks = list(range(world.comm.Get_size()))
    global_process_set._matcher = Matcher(world.comm, global_process_set.ranks)
    _registered[0] = global_process_set
    for ps in process_sets or ():
        _register(ps)


def shutdown() -> None:
    """Fail what is in flight, free every set's communicators and the world. Collective."""
    if not runtime.is_initialized():
        return
    for ps_id, ps in sorted(_registered.items(), reverse=True):
        if ps._matcher is not None:
            ps._matcher.free()
        if ps_id != 0:
            ps._invalidate()
    _registered.clear()
    global_process_set._matcher = None
    runtime.shutdown_world()


def _world_ranks(ps: ProcessSet) -> List[int]:
    """A set's world ranks: given, or those of its communicator (learnt from its members)."""
    from mpi4py import MPI

    world = runtime.world().comm
    if ps.ranks is not None:
        return list(ps.ranks)
    comm = ps.mpi_comm
    mine = None if comm == MPI.COMM_NULL else MPI.Group.Translate_ranks(
        comm.Get_group(), list(range(comm.Get_size())), world.Get_group())
    known = [r for r in world.allgather(mine) if r is not None]
    return sorted(known[0]) if known else []


def _check_ranks(ranks: List[int], size: int) -> None:
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):
        raise InputValueError(f"a process set needs distinct ranks from 0 to {size - 1}, got {ranks}")


def _register(ps: ProcessSet) -> None:
    """Give ``ps`` an id and its members a matcher. Collective over the world."""
    world = runtime.world().comm
    ranks = _world_ranks(ps)
    check_all(world, _check_ranks, ranks, world.Get_size())
    every = world.allgather(ranks)
    if any(other != every[0] for other in every):
        raise collective_error(InputValueError, f"ranks added different process sets: {every[0]} on rank 0, "
                               f"{next(o for o in every if o != every[0])} elsewhere; add the same on every rank")
    if any(other.ranks == ranks for other in _registered.values()):
        raise collective_error(InputValueError, f"Attempted to add a duplicate process set: {ranks}")
    from mpi4py import MPI

    member = world.Get_rank() in ranks
    sub = world.Split(0 if member else MPI.UNDEFINED, world.Get_rank())
    ps.ranks, ps.process_set_id = ranks, max(_registered) + 1
    if member:
        ps._matcher = Matcher(sub, ranks)
        sub.Free()
    _registered[ps.process_set_id] = ps


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set (a :class:`ProcessSet` or a list of ranks) and return it.
    Collective over the world: every rank passes the same ranks."""
    runtime.world()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI communicator is not "
                                  "implemented. Please build the process set via a list of ranks, or pass it "
                                  "to hvd.init(process_sets=[...])")
    _register(process_set)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` and free its communicators; whether it was registered (the
    global set never is removed). Collective over the world."""
    world = runtime.world().comm
    ps_id = process_set.process_set_id
    every = world.allgather(ps_id)
    if any(other != ps_id for other in every):
        raise collective_error(InputValueError, f"ranks removed different process sets (ids {every}); remove "
                               "the same one on every rank")
    if ps_id is None or ps_id == 0 or _registered.get(ps_id) is not process_set:
        return False
    if process_set._matcher is not None:
        process_set._matcher.free()
    del _registered[ps_id]
    process_set._invalidate()
    return True
