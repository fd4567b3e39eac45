"""Horovod's state helpers on hsgd's: objects, parameters and optimizer state from one rank.

``broadcast_object``, ``allgather_object``, ``broadcast_parameters`` and
``broadcast_optimizer_state`` are hsgd's own (:mod:`hsgd.collectives`, :mod:`hsgd.replicas`:
the ranks' arguments are compared first and a mismatch raises on every rank), run over a
:class:`MatchedComm`: the few communicator calls they make, each one matched operation of
the process set. Every rank calls them in the same order; a rank in ``join()`` makes the
others' calls raise instead of waiting.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from .._core.agree import collective_error
from ..collectives import allgather_object as _allgather_object
from ..collectives import broadcast_object as _broadcast_object
from ..errors import InputValueError
from ..replicas import broadcast_optimizer_state as _broadcast_optimizer_state
from ..replicas import broadcast_parameters as _broadcast_parameters
from .matching import Entry, Submission
from .process_sets import ProcessSet, global_process_set, matcher_of
from .runtime import HorovodInternalError
from .tensor_ops import broadcast_, wait

__all__ = ["MatchedComm", "broadcast_object", "allgather_object", "broadcast_parameters",
           "broadcast_optimizer_state"]


class MatchedComm:
    """What :mod:`hsgd.collectives` and :mod:`hsgd.replicas` call on an mpi4py communicator
    (``Get_rank``, ``Get_size``, ``allgather``, ``bcast``, ``Bcast``), as matched operations of
    ``process_set``; ranks are the set's. They are named ``name.1``, ``name.2`` ..., not by the
    set's counter of unnamed operations: a rank that joined skips the others' unnamed
    operations, and its counter then differs from theirs."""

    def __init__(self, process_set: ProcessSet, name: str):
        self.process_set, self.matcher = process_set, matcher_of(process_set)
        self._name, self._calls = name, 0

    def Get_rank(self) -> int:
        return self.matcher.rank

    def Get_size(self) -> int:
        return self.matcher.size

    def _next(self) -> str:
        self._calls += 1
        return f"{self._name}.{self._calls}"

    def _run(self, submission: Submission) -> Any:
        entry = self.matcher.submit(submission, Entry(submission.kind))
        wait(entry)
        if entry.error is not None:
            raise collective_error(HorovodInternalError, entry.error)
        return entry.result

    def allgather(self, obj: Any) -> List[Any]:
        return self._run(Submission("object_gather", self._next(), (), extra=obj))

    def bcast(self, obj: Any, root: int = 0) -> Any:
        mine = obj if self.matcher.rank == root else None
        return self._run(Submission("object_bcast", self._next(), (("root", root),), extra=mine))

    def Bcast(self, buf, root: int = 0) -> None:
        assert self.process_set.ranks is not None  # registered
        broadcast_(torch.from_numpy(buf), self.process_set.ranks[root], self._next(), self.process_set)


def _set_root(root_rank: Any, process_set: ProcessSet, comm: MatchedComm) -> int:
    """The set rank of world rank ``root_rank``; the same ``ValueError`` on every rank if any
    rank's is not in the set."""
    ranks = process_set.ranks or []
    ok = comm.allgather(root_rank in ranks and not isinstance(root_rank, bool))
    if not all(ok):
        raise collective_error(InputValueError, f"root_rank {root_rank!r} is not a rank of {process_set} on "
                               f"rank(s) {[r for r, good in zip(ranks, ok) if not good]}; pass a world rank of the set")
    return ranks.index(root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` (picklable) on every rank of ``process_set``. As in Horovod, the
    operations are named after ``name``, by default the type of ``obj``: pass objects of one
    type on every rank (a dict on the root, ``{}`` elsewhere), or a ``name``."""
    comm: Any = MatchedComm(process_set, type(obj).__name__ if name is None else name)  # an mpi4py comm's part
    return _broadcast_object(obj, _set_root(root_rank, process_set, comm), comm)


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> List[Any]:
    """Every rank's ``obj`` (picklable), as a list in set order (named as :func:`broadcast_object`)."""
    comm: Any = MatchedComm(process_set, type(obj).__name__ if name is None else name)
    return _allgather_object(obj, comm)


def _pairs(params: Any) -> Any:
    """Horovod's ``params``: a dict (a state dict) or a list of tensors or ``(name, tensor)``."""
    if isinstance(params, dict):
        return sorted(params.items())
    if isinstance(params, list):
        return [p if isinstance(p, tuple) else (f"{i}", p) for i, p in enumerate(params)]
    raise InputValueError(f"invalid params of type: {type(params)}")


def broadcast_parameters(params: Any, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Copy ``params`` (``model.state_dict()``, or a list such as ``list(model.named_parameters())``)
    from ``root_rank`` to every rank, in place."""
    comm: Any = MatchedComm(process_set, "broadcast_parameters")
    _broadcast_parameters(_pairs(params), comm, _set_root(root_rank, process_set, comm))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make ``optimizer``'s state and hyperparameters ``root_rank``'s (``model`` is accepted and
    not needed)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InputValueError("cannot broadcast torch.optim.LBFGS state")
    comm: Any = MatchedComm(process_set, "broadcast_optimizer_state")
    _broadcast_optimizer_state(optimizer, comm, _set_root(root_rank, process_set, comm))
