"""The data of a matched operation: its non-blocking MPI collective, started and finished.

:func:`start` begins the collective of one response on the set's data communicator and
returns a :class:`Transfer`, which finishes it (casts, scales, copies the result into the
caller's tensors) once MPI completed it. Tensors move through host copies (a CUDA tensor is
staged); half types are reduced in float32. Scaling follows Horovod's CPU kernels:
integers are scaled in float64 and truncated toward zero (so an integer average rounds
toward zero), half types in float32, the rest in their own dtype. A rank that called
``join()`` and has no tensor of its own takes part with the reduction's identity.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..collectives import HALF, INTEGER, mpi_buffer
from .runtime import OP_NAMES, Average, Max, Min, Product, Sum

__all__ = ["Transfer", "start", "scaled", "reduced_rows"]

_CODES = {name: code for code, name in OP_NAMES.items()}  # a response names its op


class Transfer:
    """MPI requests in flight and what to do once they completed. ``buffers``: every tensor the
    requests read or write, held here until they complete (the requests do not hold them: a
    send buffer freed early is memory MPI reads later, which Open MPI's non-blocking
    collectives did)."""

    def __init__(self, requests: List[Any], done: Callable[[], None], buffers: Sequence[torch.Tensor] = ()):
        self.requests, self.done, self.buffers = requests, done, list(buffers)

    def test(self) -> bool:
        """Whether it completed (then :attr:`done` ran)."""
        from mpi4py import MPI

        if self.requests and not MPI.Request.Testall(self.requests):
            return False
        self.done()
        self.buffers = []
        return True


def scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` times ``factor`` in ``tensor``'s dtype, as Horovod's ``ScaleBuffer`` on the CPU."""
    if factor == 1.0:
        return tensor
    if tensor.dtype in INTEGER:
        return (tensor.to(torch.float64) * factor).to(tensor.dtype)  # truncates toward zero
    if tensor.dtype in HALF:
        return (tensor.to(torch.float32) * torch.tensor(factor, dtype=torch.float32)).to(tensor.dtype)
    return tensor * torch.tensor(factor, dtype=tensor.dtype)


def reduced_rows(dim0: int, size: int, rank: int) -> int:
    """The rows of a reducescatter's result on ``rank``: the first ``dim0 % size`` ranks one more."""
    return dim0 // size + (1 if rank < dim0 % size else 0)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A private contiguous CPU copy."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def _work(host: torch.Tensor) -> torch.Tensor:
    """What MPI reduces: half types as float32."""
    return host.to(torch.float32) if host.dtype in HALF else host


def _identity(shape, dtype: torch.dtype, op: int) -> torch.Tensor:
    """A joined rank's contribution: the identity of ``op``."""
    if op in (Sum, Average):
        return torch.zeros(shape, dtype=dtype)
    if op == Product:
        return torch.ones(shape, dtype=dtype)
    info = torch.iinfo(dtype) if not dtype.is_floating_point and dtype != torch.bool else None
    if dtype == torch.bool:
        return torch.full(shape, op == Min, dtype=dtype)
    high = info.max if info else math.inf
    low = info.min if info else -math.inf
    return torch.full(shape, high if op == Min else low, dtype=dtype)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _finish(entry, results: List[torch.Tensor]) -> None:
    """Copy ``results`` into the entry's outputs (same shape, dtype and device as the inputs)."""
    for out, res in zip(entry.outputs, results):
        with torch.no_grad():
            out.copy_(res)
    entry.finish(list(entry.outputs))


def _mpi_op(op: int):
    from mpi4py import MPI

    return {Sum: MPI.SUM, Average: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}[op]


def _allreduce(comm, entry, payload: Dict[str, Any], rank: int) -> Transfer:
    from mpi4py import MPI

    m = payload["match"]
    op, pre, post = _CODES[m["op"]], m["prescale"], m["postscale"]
    if entry is not None:
        bufs = [_work(scaled(_host(t), pre)) for t in entry.tensors]
    else:
        bufs = [_work(_identity(shape, _dtype(dtype), op)) for shape, dtype, _ in m["tensors"]]
    requests = [comm.Iallreduce(MPI.IN_PLACE, mpi_buffer(b), op=_mpi_op(op)) for b in bufs if b.numel()]
    factor = post / comm.Get_size() if op == Average else post

    def done() -> None:
        if entry is not None:
            _finish(entry, [scaled(b.to(t.dtype), factor) for b, t in zip(bufs, entry.tensors)])
    return Transfer(requests, done, bufs)


def _allgather(comm, entry, payload, rank: int) -> Transfer:
    dims = payload["extras"]  # per rank: the first dimension of each tensor
    hosts, outs, requests = [], [], []
    for i, t in enumerate(entry.tensors):
        host = t.detach().to("cpu").contiguous()
        hosts.append(host)
        row = math.prod(host.shape[1:])
        out = torch.empty((sum(d[i] for d in dims), *host.shape[1:]), dtype=host.dtype)
        requests.append(comm.Iallgatherv(mpi_buffer(host), [mpi_buffer(out), [d[i] * row for d in dims]]))
        outs.append(out)
    return Transfer(requests, lambda: entry.finish([o.to(t.device) for o, t in zip(outs, entry.tensors)]),
                    [*hosts, *outs])


def _broadcast(comm, entry, payload, rank: int) -> Transfer:
    bufs = [_host(t) for t in entry.tensors]
    root = payload["match"]["root"]
    requests = [comm.Ibcast(mpi_buffer(b), root=root) for b in bufs if b.numel()]
    return Transfer(requests, lambda: _finish(entry, bufs), bufs)


def _alltoall(comm, entry, payload, rank: int) -> Transfer:
    splits = payload["extras"]  # per rank: its splits
    t = entry.tensors[0]
    host = t.detach().to("cpu")[:sum(splits[rank])].contiguous()
    row = math.prod(host.shape[1:])
    received = [s[rank] for s in splits]
    out = torch.empty((sum(received), *host.shape[1:]), dtype=host.dtype)
    request = comm.Ialltoallv([mpi_buffer(host), [s * row for s in splits[rank]]],
                              [mpi_buffer(out), [r * row for r in received]])

    def done() -> None:
        entry.finish((out.to(t.device), torch.tensor(received, dtype=torch.int32)))
    return Transfer([request], done, [host, out])


def _reducescatter(comm, entry, payload, rank: int) -> Transfer:
    m, size = payload["match"], comm.Get_size()
    op, pre, post = _CODES[m["op"]], m["prescale"], m["postscale"]
    sends, outs, requests = [], [], []
    for t in entry.tensors:
        work = _work(scaled(_host(t), pre))
        row = math.prod(work.shape[1:])
        counts = [reduced_rows(work.shape[0], size, r) * row for r in range(size)]
        out = torch.empty((reduced_rows(work.shape[0], size, rank), *work.shape[1:]), dtype=work.dtype)
        requests.append(comm.Ireduce_scatter(mpi_buffer(work), mpi_buffer(out), counts, op=_mpi_op(op)))
        sends.append(work)
        outs.append(out)
    factor = post / size if op == Average else post

    def done() -> None:
        entry.finish([scaled(o.to(t.dtype), factor).to(t.device) for o, t in zip(outs, entry.tensors)])
    return Transfer(requests, done, [*sends, *outs])


def _barrier(comm, entry, payload, rank: int) -> Transfer:
    return Transfer([comm.Ibarrier()], lambda: entry.finish(None) if entry is not None else None)


_STARTS = {"allreduce": _allreduce, "allgather": _allgather, "broadcast": _broadcast, "alltoall": _alltoall,
           "reducescatter": _reducescatter, "barrier": _barrier}


def start(comm, kind: str, entry: Optional[Any], payload: Dict[str, Any], rank: int) -> Transfer:
    """Start the collective of a matched ``kind`` operation on ``comm``; ``entry`` is this rank's
    (``None`` on a rank that joined: allreduce and barrier only)."""
    return _STARTS[kind](comm, entry, payload, rank)
