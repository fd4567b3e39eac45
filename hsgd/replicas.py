"""Keeping replicas identical: model checks and broadcasts from one rank.

* :func:`check_same_model` compares every rank's parameters and buffers (names,
  shapes, dtypes) and raises the same ``ValueError`` on every rank, naming the
  first difference, instead of letting mismatched buffers hang a collective.
* :func:`broadcast_parameters` copies parameters and buffers from ``root``.
* :func:`broadcast_optimizer_state` copies an optimizer's whole state
  (per-parameter state and hyperparameters of every group) from ``root``,
  e.g. after rank 0 alone loaded a checkpoint.

Example::

    >>> if rank == 0:
    ...     optimizer.load_state_dict(torch.load(path, weights_only=True))
    >>> broadcast_optimizer_state(optimizer, root_rank=0)   # communicator: the world by default
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import torch

from ._core.agree import agree, check_all, collective_error
from .errors import InputTypeError, InputValueError

__all__ = ["check_same_model", "broadcast_parameters", "average_buffers", "averaged_state_dict",
           "broadcast_optimizer_state", "broadcast_tensor_"]

if TYPE_CHECKING:  # importing mpi4py.MPI initializes MPI: not at import time
    from mpi4py import MPI

Signature = List[Tuple[str, Tuple[int, ...], str, bool]]
#: What :func:`broadcast_parameters` takes: a module, a state dict, or ``(name, tensor)`` pairs.
NamedTensors = Union[torch.nn.Module, Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]


def _named_tensors(params: NamedTensors) -> List[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a module (parameters and buffers), a state dict or an
    iterable of pairs (``model.named_parameters()``)."""
    items: Iterable[Tuple[Any, Any]]
    if isinstance(params, torch.nn.Module):
        items = params.state_dict(keep_vars=True).items()
    elif isinstance(params, Mapping):
        items = params.items()
    elif isinstance(params, (torch.Tensor, str, bytes)) or not isinstance(params, Iterable):
        raise InputTypeError(f"expected a torch.nn.Module, a state dict or an iterable of (name, tensor) "
                             f"pairs, got {type(params).__name__}")
    else:
        items = list(params)
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise InputTypeError(f"expected (name, tensor) pairs such as model.named_parameters(), "
                                     f"got an element {type(item).__name__}")
    return [(name, t) for name, t in items if isinstance(t, torch.Tensor)]


def _signature(params) -> Signature:
    return [(name, tuple(t.shape), str(t.dtype).replace("torch.", ""), bool(t.requires_grad))
            for name, t in _named_tensors(params)]


def _world(comm):
    if comm is None:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    if isinstance(comm, int):
        raise InputTypeError(f"the communicator argument got the int {comm}; pass the root as "
                             f"root_rank={comm} (the second argument is the communicator)")
    return comm


def _root(root: int, root_rank: Optional[int]) -> int:
    """``root_rank`` (Horovod's name) is an alias of ``root``."""
    if root_rank is None:
        return root
    if root not in (0, root_rank):
        raise InputValueError(f"root={root} and root_rank={root_rank} disagree; pass one of them")
    return root_rank


def _describe(entry) -> str:
    name, shape, dtype, trainable = entry
    return f"{name!r} {shape} {dtype}{' trainable' if trainable else ''}"


def _first_difference(mine: Signature, ref: Signature, rank: int) -> Optional[str]:
    for i, (a, b) in enumerate(zip(mine, ref)):
        if a != b:
            return f"entry {i} is {_describe(a)} on rank {rank} but {_describe(b)} on rank 0"
    if len(mine) != len(ref):
        longer, who = (mine, rank) if len(mine) > len(ref) else (ref, 0)
        extra = longer[min(len(mine), len(ref))]
        return (f"rank {rank} has {len(mine)} parameters and buffers and rank 0 has "
                f"{len(ref)}; the first extra one is {extra[0]!r} on rank {who}")
    return None


def check_same_model(module: NamedTensors, comm: Optional[MPI.Comm] = None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks hold the same model.

    Collective. Compares every parameter and buffer (name, shape, dtype, and
    whether it is trained), in order, against rank 0, so that neither the
    broadcasts nor the averaging can meet buffers of different sizes.
    ``module`` may also be a state dict or ``(name, tensor)`` pairs.
    """
    comm = _world(comm)
    signatures = comm.allgather(check_all(comm, _signature, module))
    for rank, sig in enumerate(signatures):
        diff = _first_difference(sig, signatures[0], rank)
        if diff is not None:
            raise collective_error(InputValueError, (
                f"the model differs between ranks: {diff}. Build the same model "
                "on every rank (same code, same arguments) before wrapping it"))


def broadcast_tensor_(tensor: torch.Tensor, comm, root: int = 0) -> None:
    """Overwrite ``tensor`` with its value on ``root``, in place, any device."""
    if tensor.numel() == 0:
        return
    host = tensor.detach()
    staged = host.device.type != "cpu" or not host.is_contiguous()
    if staged:
        host = host.to("cpu", copy=True).contiguous()
    if host.dtype == torch.bfloat16 or host.dtype == torch.float16:
        buf = host.view(torch.int16).numpy()
    elif host.dtype == torch.bool:
        buf = host.view(torch.uint8).numpy()
    else:
        buf = host.numpy()
    comm.Bcast(buf, root=root)
    if staged:
        tensor.detach().copy_(host)


def broadcast_parameters(params: NamedTensors, comm: Optional[MPI.Comm] = None, root: int = 0, *,
                         root_rank: Optional[int] = None) -> None:
    """Copy tensors from ``root`` (``root_rank``: the same, Horovod's name), in place. Collective.

    ``params``: a module (every parameter and buffer), a state dict
    (``model.state_dict()``: its tensors share the model's storage) or an
    iterable of ``(name, tensor)`` pairs (``model.named_parameters()``). The
    ranks' names, shapes and dtypes must match (checked first: a mismatch
    raises the same ``ValueError`` on every rank).
    """
    comm = _world(comm)
    root = check_all(comm, _checked_root, root, root_rank, comm)
    pairs = check_all(comm, _named_tensors, params)  # once: params may be a generator
    check_same_model(pairs, comm)
    with torch.no_grad():
        for _, tensor in pairs:
            broadcast_tensor_(tensor, comm, root)


def _checked_root(root, root_rank, comm) -> int:
    root = _root(root, root_rank)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < comm.Get_size():
        raise InputValueError(f"root_rank must be a rank from 0 to {comm.Get_size() - 1}, got {root!r}")
    return root


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, comm: Optional[MPI.Comm] = None, root: int = 0, *,
                              root_rank: Optional[int] = None) -> None:
    """Make ``optimizer``'s state and hyperparameters equal to ``root``'s. Collective.

    Rank ``root``'s ``state_dict()`` is sent to all ranks (tensors moved to
    the CPU for the transfer) and loaded there; ``load_state_dict`` moves the
    state to each parameter's device. Raises on every rank if it fails on any.
    Any ``torch.optim.Optimizer``, an hsgd mode included (its step count too).
    """
    comm = _world(comm)
    root = check_all(comm, _checked_root, root, root_rank, comm)
    state = None
    if comm.Get_rank() == root:
        state = map_tensors(lambda t: t.detach().cpu(), optimizer.state_dict())
    state = comm.bcast(state, root=root)
    error = None
    if comm.Get_rank() != root:
        try:
            optimizer.load_state_dict(state)
        except Exception as exc:  # noqa: BLE001 - any failure must reach every rank
            error = InputValueError(f"optimizer state from rank {root} does not fit: {exc}")
    agree(comm, error)


def map_tensors(fn, obj):
    """``obj`` (a state: tensors in dicts, lists and tuples) with ``fn`` applied to every tensor,
    every container copied, and everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def average_buffers(module: torch.nn.Module, comm: Optional[MPI.Comm] = None) -> None:
    """Average floating-point buffers (e.g. BatchNorm running statistics) over ranks.

    Gradient averaging keeps parameters identical but not buffers, which each
    rank updates from its own batches. Call this before evaluating or saving,
    so that every rank holds the same model. Integer buffers (batch counters)
    are taken from rank 0. Collective.
    """
    from mpi4py import MPI

    comm = _world(comm)
    with torch.no_grad():
        for buf in module.buffers():
            if not buf.is_floating_point():
                broadcast_tensor_(buf, comm, 0)
                continue
            host = buf.detach().to("cpu", torch.float64, copy=True).contiguous()
            comm.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
            buf.copy_(host.div_(comm.Get_size()))


def averaged_state_dict(module: torch.nn.Module, comm: Optional[MPI.Comm] = None) -> Dict[str, Any]:
    """``module.state_dict()`` with floating-point entries averaged over ranks, on the CPU.

    The module itself is not changed. Synchronous replicas are identical, so
    this is their common value; with local SGD it is the model a checkpoint
    should hold. Integer entries are rank 0's. Collective.
    """
    from mpi4py import MPI

    comm = _world(comm)
    averaged = {}
    for key, value in module.state_dict().items():
        value = value.detach().to("cpu", copy=True).contiguous()
        if value.is_floating_point() and comm.Get_size() > 1:
            total = value.to(torch.float64)
            comm.Allreduce(MPI.IN_PLACE, total.numpy(), op=MPI.SUM)
            value = total.div_(comm.Get_size()).to(value.dtype)
        elif comm.Get_size() > 1:
            broadcast_tensor_(value, comm, 0)
        averaged[key] = value
    return averaged
