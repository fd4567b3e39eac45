"""Tensor collectives and rank helpers, in the shape Horovod users know.

For metrics, gathered predictions and values decided on rank 0::

    >>> import hsgd
    >>> hsgd.rank(), hsgd.size(), hsgd.local_rank(), hsgd.local_size()
    >>> test_loss = hsgd.allreduce(torch.tensor(loss_sum), op="mean")
    >>> preds = hsgd.allgather(local_preds)         # concatenated along dim 0
    >>> seed = hsgd.broadcast_object(seed, root_rank=0)

Every function is collective over ``comm`` (default ``MPI.COMM_WORLD``), called by all
its ranks in the same order. Before any data moves the ranks compare what they were
given (op, shape, dtype, root): a mismatch or a bad argument on any rank raises the same
:class:`~hsgd.errors.InputError` on every rank instead of hanging (one small ``allgather``
per call: these are for metrics and set-up, not for the gradient path).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import TYPE_CHECKING, Any, List, Literal, Optional

import torch

from ._core.agree import attempt, collective_error
from .errors import InputError, InputTypeError, InputValueError

if TYPE_CHECKING:  # importing mpi4py.MPI initializes MPI: not at import time
    from mpi4py import MPI

    from .topology import Topology

__all__ = ["rank", "size", "local_rank", "local_size", "barrier", "allreduce", "allreduce_", "allgather",
           "broadcast", "broadcast_", "allreduce_object", "allgather_object", "broadcast_object", "OPS"]

OPS = ("mean", "sum", "min", "max")
#: The reductions, as a type: what ``op`` takes.
ReduceOp = Literal["mean", "sum", "min", "max"]
HALF = (torch.float16, torch.bfloat16)
INTEGER = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_world_topology: Optional[Topology] = None


def _comm(comm: Optional[MPI.Comm]) -> MPI.Comm:
    if comm is not None:
        return comm
    from mpi4py import MPI

    return MPI.COMM_WORLD


def rank(comm: Optional[MPI.Comm] = None) -> int:
    """This process's rank in ``comm`` (default: the world)."""
    return _comm(comm).Get_rank()


def size(comm: Optional[MPI.Comm] = None) -> int:
    """The number of ranks in ``comm`` (default: the world)."""
    return _comm(comm).Get_size()


def _node(comm):
    """(local_rank, local_size) of this rank's (virtual) node in ``comm``, as the modes see it
    (:class:`~hsgd.Topology`, which honours ``HSGD_RANKS_PER_NODE``)."""
    global _world_topology
    from mpi4py import MPI

    from .topology import Topology

    comm = _comm(comm)
    if comm == MPI.COMM_WORLD:
        if _world_topology is None:
            _world_topology = Topology.from_comm(comm)
        return _world_topology.local_rank, _world_topology.local_size
    with Topology.from_comm(comm) as topo:  # another communicator: collective every time
        return topo.local_rank, topo.local_size


def local_rank(comm: Optional[MPI.Comm] = None) -> int:
    """This rank's index on its node (e.g. the GPU to use). Collective on the first call."""
    return _node(comm)[0]


def local_size(comm: Optional[MPI.Comm] = None) -> int:
    """The number of ranks on this rank's node. Collective on the first call."""
    return _node(comm)[1]


def barrier(comm: Optional[MPI.Comm] = None) -> None:
    """Wait until every rank of ``comm`` has called it."""
    _comm(comm).Barrier()


# --- agreeing on the arguments -------------------------------------------------------
def _negotiate(comm, what: str, error: Optional[InputError], meta) -> None:
    """Raise the same error on every rank if any rank's arguments were bad or differ.

    ``meta`` is what must be equal on every rank (op, shape, dtype, root ...),
    as a tuple of ``(name, value)`` pairs for the message.
    """
    mine = (None if error is None else (type(error), str(error)), meta)
    every = comm.allgather(mine)
    for r, (err, _) in enumerate(every):
        if err is not None:
            raise collective_error(err[0], f"hsgd.{what} on rank {r}: {err[1]}")
    ref = every[0][1]
    for r, (_, other) in enumerate(every):
        if other != ref:
            diff = next((f"{name}={value!r} on rank {r} but {name}={ref_value!r} on rank 0"
                         for (name, value), (_, ref_value) in zip(other, ref) if value != ref_value),
                        f"{other} on rank {r} but {ref} on rank 0")
            raise collective_error(InputValueError, f"hsgd.{what}: the ranks passed different tensors or "
                                   f"arguments: {diff}; every rank must pass the same")


def check_tensor(what: str, tensor) -> None:
    """Raise :class:`~hsgd.errors.InputTypeError` unless ``tensor`` is a tensor MPI can move."""
    if not isinstance(tensor, torch.Tensor):
        raise InputTypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_complex() or tensor.dtype not in (torch.float32, torch.float64, torch.bool, *HALF, *INTEGER):
        raise InputTypeError(f"unsupported dtype {tensor.dtype}; use a floating-point, integer or bool tensor")


def _check_reduction(tensor, op) -> None:
    check_tensor("allreduce", tensor)
    if op not in OPS:
        raise InputValueError(f"unknown op {op!r}; use one of {', '.join(map(repr, OPS))}")
    if op == "mean" and not tensor.is_floating_point():
        raise InputTypeError(f"op='mean' of a {tensor.dtype} tensor; cast it to a floating-point dtype, "
                             "or use op='sum' and divide")
    if tensor.dtype == torch.bool and op == "sum":
        raise InputTypeError("op='sum' of a bool tensor; cast it to an integer dtype "
                             "(op='max' is 'any', op='min' is 'all')")


def _check_root(root_rank, comm) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < comm.Get_size():
        raise InputValueError(f"root_rank must be a rank from 0 to {comm.Get_size() - 1}, got {root_rank!r}")


def _tensor_meta(tensor, *extra):
    if not isinstance(tensor, torch.Tensor):
        return extra
    return (*extra, ("shape", tuple(tensor.shape)), ("dtype", str(tensor.dtype).replace("torch.", "")))


def mpi_buffer(host: torch.Tensor):
    """A numpy view of a contiguous CPU tensor that MPI can move (half and bool types as bits;
    shared with :mod:`hsgd.horovod`)."""
    if host.dtype in HALF:
        return host.view(torch.int16).numpy()
    if host.dtype == torch.bool:
        return host.view(torch.uint8).numpy()
    return host.numpy()


# --- tensors -------------------------------------------------------------------------
def _reduced(tensor: torch.Tensor, op: str, comm) -> torch.Tensor:
    """The reduction over ``comm``, as a new contiguous CPU tensor (float32 for half types)."""
    from mpi4py import MPI

    work = torch.float32 if tensor.dtype in HALF else tensor.dtype
    host = tensor.detach().to("cpu", work, copy=True).contiguous()
    if host.numel() and comm.Get_size() > 1:
        mpi_op = {"mean": MPI.SUM, "sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}[op]
        comm.Allreduce(MPI.IN_PLACE, mpi_buffer(host), op=mpi_op)
    if op == "mean":
        host.div_(comm.Get_size())
    return host


def _agreed_reduction(what: str, tensor, op: str, comm) -> None:
    _, error = attempt(_check_reduction, tensor, op)
    _negotiate(comm, what, error, _tensor_meta(tensor, ("op", op)))


def allreduce(tensor: torch.Tensor, op: ReduceOp = "mean", comm: Optional[MPI.Comm] = None) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over all ranks by ``op`` (mean, sum, min, max),
    on ``tensor``'s device and dtype. Collective; the ranks' shapes and dtypes must match.

    CUDA tensors are staged through host memory; ``float16`` and ``bfloat16`` are reduced
    in ``float32`` and cast back. Integer tensors take ``"sum"``, ``"min"`` and ``"max"``;
    ``"mean"`` needs a floating-point tensor (cast first, or sum and divide)."""
    comm = _comm(comm)
    _agreed_reduction("allreduce", tensor, op, comm)
    return _reduced(tensor, op, comm).to(tensor.device, tensor.dtype)


def allreduce_(tensor: torch.Tensor, op: ReduceOp = "mean", comm: Optional[MPI.Comm] = None) -> torch.Tensor:
    """:func:`allreduce` in place: ``tensor`` is overwritten and returned."""
    comm = _comm(comm)
    _agreed_reduction("allreduce_", tensor, op, comm)
    with torch.no_grad():
        tensor.copy_(_reduced(tensor, op, comm))
    return tensor


def allgather(tensor: torch.Tensor, comm: Optional[MPI.Comm] = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order, on ``tensor``'s device.

    The first dimension may differ by rank; the others and the dtype must
    match. A 0-dimensional tensor counts as one row. Collective.
    """
    comm = _comm(comm)
    _, error = attempt(check_tensor, "allgather", tensor)
    tensor = tensor if error or tensor.dim() else tensor.reshape(1)
    meta = () if error else (("row shape", tuple(tensor.shape[1:])), ("dtype", str(tensor.dtype)))
    _negotiate(comm, "allgather", error, meta)
    counts = comm.allgather(tensor.shape[0])
    host = tensor.detach().to("cpu", copy=True).contiguous()
    out = torch.empty((sum(counts), *host.shape[1:]), dtype=host.dtype)
    per_row = math.prod(host.shape[1:])
    if out.numel():
        comm.Allgatherv(mpi_buffer(host), [mpi_buffer(out), [c * per_row for c in counts]])
    return out.to(tensor.device)


def broadcast(tensor: torch.Tensor, root_rank: int = 0, comm: Optional[MPI.Comm] = None) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor``, on this rank's device. Every rank
    passes a tensor of the same shape and dtype (its values are ignored off the root)."""
    return broadcast_(tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor,
                      root_rank, comm, _what="broadcast")


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, comm: Optional[MPI.Comm] = None, *,
               _what: str = "broadcast_") -> torch.Tensor:
    """:func:`broadcast` in place: ``tensor`` is overwritten with the root's and returned."""
    from .replicas import broadcast_tensor_

    comm = _comm(comm)
    _, error = attempt(check_tensor, _what, tensor)
    error = error or attempt(_check_root, root_rank, comm)[1]
    _negotiate(comm, _what, error, _tensor_meta(tensor, ("root_rank", root_rank)))
    with torch.no_grad():
        broadcast_tensor_(tensor, comm, root_rank)
    return tensor


# --- Python objects ----------------------------------------------------------------------
def allgather_object(obj: Any, comm: Optional[MPI.Comm] = None) -> List[Any]:
    """Every rank's ``obj`` (picklable), as a list in rank order. Collective."""
    return _comm(comm).allgather(obj)


def allreduce_object(obj: Any, op: ReduceOp = "mean", comm: Optional[MPI.Comm] = None) -> Any:
    """Every rank's ``obj`` reduced by ``op``: ``"sum"`` and ``"mean"`` add them with ``+``
    (numbers, numpy arrays, tensors), ``"min"`` / ``"max"`` compare them. Collective."""
    comm = _comm(comm)
    error = None if op in OPS else InputValueError(f"unknown op {op!r}; use one of {', '.join(map(repr, OPS))}")
    _negotiate(comm, "allreduce_object", error, (("op", op),))
    values = comm.allgather(obj)
    try:  # the same values on every rank, so the same outcome
        if op in ("sum", "mean"):
            total = functools.reduce(operator.add, values)
            return total / len(values) if op == "mean" else total
        return (min if op == "min" else max)(values)
    except (TypeError, ValueError) as exc:
        raise collective_error(InputTypeError, f"hsgd.allreduce_object cannot reduce "
                               f"{type(obj).__name__} values by {op!r}: {exc}") from None


def broadcast_object(obj: Any, root_rank: int = 0, comm: Optional[MPI.Comm] = None) -> Any:
    """``root_rank``'s ``obj`` (picklable) on every rank. Collective."""
    comm = _comm(comm)
    _, error = attempt(_check_root, root_rank, comm)
    _negotiate(comm, "broadcast_object", error, (("root_rank", root_rank),))
    return comm.bcast(obj, root=root_rank)
