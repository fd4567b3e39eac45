"""Horovod's asynchronous collectives, their handles, ``poll``, ``synchronize``, ``barrier`` and ``join``.

Each ``*_async`` call checks its arguments on this rank (a bad one raises here, and the
other ranks' copies of the operation fail with the same message instead of waiting),
submits the operation to its process set's :class:`~hsgd.horovod.matching.Matcher` and
returns an integer handle. ``synchronize(handle)`` drives every set's matching until the
operation is done and returns its result, or raises :class:`HorovodInternalError` (on
every rank that took part) with the coordinator's message. Waiting yields the core.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._core.agree import collective_error
from ..collectives import HALF, INTEGER
from ..errors import InputError, InputTypeError, InputValueError
from .matching import Entry, Matcher, Submission
from .process_sets import ProcessSet, global_process_set, matcher_of, matchers
from .runtime import OP_NAMES, Adasum, Average, HorovodInternalError, Product, Sum, world

__all__ = ["allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async",
           "reducescatter_async", "grouped_reducescatter_async", "sparse_allreduce_async", "allreduce_",
           "grouped_allreduce_", "broadcast_", "poll", "synchronize", "barrier", "join", "average_op", "wait",
           "register_overlap"]

_DTYPES = (torch.float32, torch.float64, torch.bool, *HALF, *INTEGER)
_handles: Dict[int, Tuple[Entry, Callable[[Any], Any]]] = {}
_counter = itertools.count(1)
_overlapping: weakref.WeakSet[Any] = weakref.WeakSet()  # DistributedOptimizers with overlap=True


def average_op(op: Optional[int], average: Optional[bool]) -> int:
    """The op of Horovod's deprecated ``average=`` keyword (``True``: Average, ``False``: Sum)."""
    if op is not None and average is not None:
        raise InputValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


# --- checks on this rank ---------------------------------------------------------------------
def _check_tensors(kind: str, tensors: Sequence[Any]) -> None:
    if not tensors:
        raise InputValueError(f"grouped {kind} needs at least one tensor")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{kind} takes torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise InputValueError(f"{kind} of a {t.layout} tensor; use hvd.sparse_allreduce_async, or to_dense()")
        if t.dtype not in _DTYPES:
            raise InputValueError(f"Tensor type {t.type()} is not supported.")
    if len({t.device.type for t in tensors}) > 1:
        raise HorovodInternalError(f"{kind}: the tensors are on different devices; put them on one")


def _check_op(kind: str, op: int, tensors: Sequence[torch.Tensor]) -> None:
    if op == Adasum:
        raise NotImplementedError(f"hsgd.horovod has no Adasum; use op=hvd.Average (or hvd.Sum) for {kind}")
    if kind == "reducescatter" and op not in (Sum, Average):
        raise HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM.")
    if op not in OP_NAMES:
        raise InputValueError(f"unknown op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    if op in (Sum, Average, Product) and any(t.dtype == torch.bool for t in tensors):
        raise InputValueError(f"op=hvd.{OP_NAMES[op]} of a bool tensor; use hvd.Min (all) or hvd.Max (any), "
                              "or cast it to an integer dtype")


def _describe(t: torch.Tensor, shape=None) -> Tuple[Any, ...]:
    return (tuple(t.shape if shape is None else shape), str(t.dtype).replace("torch.", ""), t.device.type)


# --- submitting ----------------------------------------------------------------------------
def _submit(process_set: ProcessSet, kind: str, name: Optional[str], entry: Entry,
            describe: Callable[[Matcher], Submission], result: Callable[[Any], Any] = lambda r: r) -> int:
    """Check (in ``describe``) and submit one operation; its handle. A check that fails raises
    here and fails the other ranks' copies with its message."""
    matcher = matcher_of(process_set)
    name = matcher.auto_name() if name is None else str(name)
    try:
        submission = describe(matcher)
    except (InputError, NotImplementedError, HorovodInternalError) as exc:
        matcher.refuse(Submission(kind, name, error=str(exc)))
        raise
    submission.name = name
    matcher.submit(submission, entry)
    handle = next(_counter)
    _handles[handle] = (entry, result)
    return handle


def _reduction(kind, tensors, outputs, name, op, pre, post, process_set, *, grouped: bool) -> int:
    tensors = list(tensors)

    def describe(matcher: Matcher) -> Submission:
        _check_tensors(kind, tensors)
        _check_op(kind, op, tensors)
        if kind == "reducescatter" and any(t.dim() == 0 for t in tensors):
            raise InputValueError("reducescatter of a 0-dimensional tensor; it splits dimension 0")
        return Submission(kind, "", (("op", OP_NAMES.get(op, op)), ("prescale", float(pre)),
                                     ("postscale", float(post)), ("tensors", tuple(map(_describe, tensors)))))
    entry = Entry(kind, tensors, outputs, op=op)
    return _submit(process_set, kind, name, entry, describe, (lambda r: r) if grouped else (lambda r: r[0]))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start reducing ``tensor`` over ``process_set`` by ``op`` (default Average; also Sum, Min, Max,
    Product), scaled by ``prescale_factor`` before and ``postscale_factor`` after; a handle for
    :func:`synchronize`, which returns a new tensor. ``tensor`` is not modified."""
    op = average_op(op, average)
    outputs = [torch.empty_like(tensor)] if isinstance(tensor, torch.Tensor) else []
    return _reduction("allreduce", [tensor], outputs, name, op, prescale_factor, postscale_factor, process_set,
                      grouped=False)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """:func:`allreduce_async` in place: :func:`synchronize` writes the result into ``tensor``."""
    op = average_op(op, average)
    return _reduction("allreduce", [tensor], [tensor], name, op, prescale_factor, postscale_factor, process_set,
                      grouped=False)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """:func:`allreduce_async` of a list of tensors as one operation; the result is a list."""
    op = average_op(op, average)
    outputs = [torch.empty_like(t) for t in tensors if isinstance(t, torch.Tensor)]
    return _reduction("allreduce", tensors, outputs, name, op, prescale_factor, postscale_factor, process_set,
                      grouped=True)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """:func:`grouped_allreduce_async` in place."""
    op = average_op(op, average)
    return _reduction("allreduce", tensors, list(tensors), name, op, prescale_factor, postscale_factor,
                      process_set, grouped=True)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """Start reducing ``tensor`` (Sum or Average) and scattering dimension 0: rank ``r`` of the set
    gets rows ``r``'s share (the first ``dim0 % size`` ranks one row more)."""
    return _reduction("reducescatter", [tensor], [], name, op, prescale_factor, postscale_factor, process_set,
                      grouped=False)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """:func:`reducescatter_async` of a list of tensors as one operation."""
    return _reduction("reducescatter", tensors, [], name, op, prescale_factor, postscale_factor, process_set,
                      grouped=True)


def _gather(tensors, name, process_set, grouped: bool) -> int:
    tensors = list(tensors)

    def describe(matcher: Matcher) -> Submission:
        _check_tensors("allgather", tensors)
        if any(t.dim() == 0 for t in tensors):
            raise InputValueError("allgather of a 0-dimensional tensor; reshape it to (1,)")
        rows = tuple(_describe(t, t.shape[1:]) for t in tensors)
        return Submission("allgather", "", (("tensors", rows),), extra=[t.shape[0] for t in tensors])
    return _submit(process_set, "allgather", name, Entry("allgather", tensors), describe,
                   (lambda r: r) if grouped else (lambda r: r[0]))


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (which may differ by rank)."""
    return _gather([tensor], name, process_set, grouped=False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """:func:`allgather_async` of a list of tensors as one operation."""
    return _gather(tensors, name, process_set, grouped=True)


def _broadcast(tensor, output, root_rank, name, process_set) -> int:
    def describe(matcher: Matcher) -> Submission:
        _check_tensors("broadcast", [tensor])
        ranks = process_set.ranks or []
        if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in ranks:
            raise InputValueError(f"root_rank {root_rank!r} is not a rank of {process_set}; pass a world rank "
                                  "of the set")
        return Submission("broadcast", "", (("root_rank", root_rank), ("root", ranks.index(root_rank)),
                                            ("tensors", (_describe(tensor),))))
    outputs = [output] if isinstance(output, torch.Tensor) else []
    return _submit(process_set, "broadcast", name, Entry("broadcast", [tensor], outputs), describe,
                   lambda r: r[0])


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start copying ``root_rank``'s ``tensor`` (a world rank) to every rank of the set; the result
    is a new tensor."""
    return _broadcast(tensor, torch.empty_like(tensor) if isinstance(tensor, torch.Tensor) else None,
                      root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """:func:`broadcast_async` in place."""
    return _broadcast(tensor, tensor, root_rank, name, process_set)


def _splits(tensor: torch.Tensor, splits, size: int) -> List[int]:
    if tensor.dim() == 0:
        raise InputValueError("alltoall of a 0-dimensional tensor; it splits dimension 0")
    if splits is None:
        if tensor.shape[0] % size:
            raise InputValueError(f"alltoall without splits divides dimension 0 ({tensor.shape[0]}) equally "
                                  f"among {size} ranks; pass splits, or a multiple of {size} rows")
        return [tensor.shape[0] // size] * size
    if isinstance(splits, torch.Tensor) and splits.dtype != torch.int32:
        raise InputValueError(f"alltoall splits must contain 32-bit integers, got {splits.dtype}")
    values = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(values) != size or any(s < 0 for s in values):
        raise InputValueError(f"alltoall splits must hold {size} non-negative numbers of rows, got {values}")
    if sum(values) > tensor.shape[0]:
        raise InputValueError(f"the sum of the alltoall splits ({sum(values)}) exceeds the first dimension of "
                              f"the tensor ({tensor.shape[0]})")
    return values


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending ``splits[r]`` rows of ``tensor`` to rank ``r`` of the set (equal parts without
    ``splits``); the result is ``(received rows, received splits)``."""
    def describe(matcher: Matcher) -> Submission:
        _check_tensors("alltoall", [tensor])
        mine = _splits(tensor, splits, matcher.size)
        return Submission("alltoall", "", (("tensors", (_describe(tensor, tensor.shape[1:]),)),), extra=mine)
    return _submit(process_set, "alltoall", name, Entry("alltoall", [tensor]), describe)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO ``tensor`` by gathering every rank's indices and values (Sum or Average);
    returns a function that waits and returns the sparse result, as Horovod's does."""
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(t.indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t.values(), name=f"{name}.values", process_set=process_set)

    def handle() -> torch.Tensor:
        vals, idx = synchronize(values), synchronize(indices)
        if op == Average:
            vals = vals / process_set.size()
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, t.size())
    return handle


# --- waiting ---------------------------------------------------------------------------------
def wait(entry: Entry) -> None:
    """Drive every set's matching until ``entry`` is done, yielding the core when nothing moves.
    ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (> 0) raises :class:`HorovodInternalError` on a rank
    that waited that long."""
    _drive(lambda: entry.done, entry.kind)


def _drive(done: Callable[[], bool], kind: str) -> None:
    from .._core.waits import Backoff

    backoff, start = Backoff(), time.monotonic()
    limit = float(os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0") or 0)
    while not done():
        moved = False
        for matcher in matchers():
            moved |= matcher.progress()
        if moved:
            backoff.reset()
            continue
        if limit > 0 and time.monotonic() - start > limit:
            raise HorovodInternalError(f"a {kind} waited {limit:.0f} s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) "
                                       "for ranks that did not submit it")
        backoff.idle()


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` finished (then :func:`synchronize` returns at once).
    Moves every set's matching one step."""
    if handle not in _handles:
        raise InputValueError(f"unknown handle {handle!r}")
    for matcher in matchers():
        matcher.progress()
    return _handles[handle][0].done


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its result (``None`` for an unknown
    handle, as Horovod). Raises :class:`HorovodInternalError` if it failed."""
    if handle not in _handles:
        return None
    entry, result = _handles[handle]
    try:
        wait(entry)
    finally:
        if entry.done:
            del _handles[handle]
    if entry.error is not None:
        raise collective_error(HorovodInternalError, entry.error)
    return result(entry.result)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    """:func:`allreduce_async_`, waited for: ``tensor`` holds the result and is returned."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> List[torch.Tensor]:
    """:func:`grouped_allreduce_async_`, waited for."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """:func:`broadcast_async_`, waited for: ``tensor`` holds ``root_rank``'s and is returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of ``process_set`` called it."""
    synchronize(_submit(process_set, "barrier", None, Entry("barrier"), lambda m: Submission("barrier", "")))


def register_overlap(optimizer: Any) -> None:
    """Note a DistributedOptimizer that averages during backward (:func:`join` refuses beside one)."""
    _overlapping.add(optimizer)


def join(device: int = -1) -> int:
    """Say this rank has no more data: until every rank joined, it takes part in the others'
    allreduces with zeros (their average still divides by the world size) and in their
    DistributedOptimizer steps with zero gradients; other collectives raise on the others.
    Returns the rank that joined last, the same on every rank. ``device`` is ignored."""
    world()
    if len(_overlapping):
        raise NotImplementedError("hvd.join() beside a DistributedOptimizer(overlap=True): the others average "
                                  "during backward, which a joined rank cannot follow; use overlap=False")
    for matcher in matchers():  # before the join is submitted: the others may step right after it
        matcher.join_steps()
    entry = matcher_of(global_process_set).submit(Submission("join", "join"), Entry("join"))
    wait(entry)  # every rank joined; then the optimizers' last tokens complete
    _drive(lambda: not any(matcher.following() for matcher in matchers()), "join")
    return entry.result
