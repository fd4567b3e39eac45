"""Horovod's differentiable collectives: autograd functions around the matched operations.

The gradients are Horovod's: an allreduce's is the allreduce of the incoming gradient with
the same op and factors; an allgather's, this rank's rows of the averaged gradient; a
broadcast's, the averaged gradient on the root and zero elsewhere; an alltoall's, the
gradient sent back by the received splits; a reducescatter's, the allgather of the
gradient, times the set size for Sum and times the factors. Backward runs collectives, so
every rank must run it (in the same order for unnamed operations).
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch

from .process_sets import global_process_set
from .runtime import Average, Sum, rank
from .tensor_ops import (
    allgather_async,
    allreduce_async,
    alltoall_async,
    average_op,
    broadcast_async,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_reducescatter_async,
    reducescatter_async,
    synchronize,
)

__all__ = ["Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "alltoall", "reducescatter", "grouped_reducescatter"]


class _NoneCompressor:
    """Default no-op compression."""

    @staticmethod
    def compress(tensor):
        """Returns the tensor unmodified."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the tensor unmodified."""
        return tensor


class _FP16Compressor:
    """Compress all floating point gradients to 16-bit."""

    @staticmethod
    def compress(tensor):
        """Downcasts a floating-point tensor to float16; the context is its dtype."""
        return (tensor.type(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        """Casts back to the dtype before compression."""
        return tensor.type(ctx) if ctx.is_floating_point else tensor


class Compression:
    """Horovod's compressors: ``Compression.none`` and ``Compression.fp16`` (``compress(tensor)``
    returns ``(tensor, ctx)``, ``decompress(tensor, ctx)`` the tensor)."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


def _compressed(compression, reduce: Callable[..., Sequence[torch.Tensor]], tensors) -> List[torch.Tensor]:
    """``reduce`` (one operation over all of them) of ``tensors`` as ``compression`` sends them,
    decompressed."""
    pairs = [compression.compress(t) for t in tensors]
    return [compression.decompress(r, c) for r, (_, c) in zip(reduce(*(t for t, _ in pairs)), pairs)]


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, process_set):
        ctx.args = op, pre, post, process_set
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, process_set = ctx.args
        return allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post, process_set=process_set), \
            None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """``tensor`` reduced over ``process_set`` by ``op`` (default Average; Sum, Min, Max, Product), as a
    new tensor; differentiable. ``average=`` is Horovod's deprecated form of ``op``."""
    return _compressed(compression, lambda t: (_Allreduce.apply(t, name, average_op(op, average), prescale_factor,
                                                                postscale_factor, process_set),), [tensor])[0]


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, process_set, *tensors):
        ctx.args = op, pre, post, process_set
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre, post, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        return (None,) * 5 + tuple(grouped_allreduce(list(grads), op=op, prescale_factor=pre,
                                                     postscale_factor=post, process_set=process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> List[torch.Tensor]:
    """:func:`allreduce` of a list of tensors as one operation; differentiable."""
    return _compressed(compression, lambda *ts: _GroupedAllreduce.apply(
        name, average_op(op, average), prescale_factor, postscale_factor, process_set, *ts), tensors)


def _own_rows(grads: List[torch.Tensor], dims: List[int], process_set) -> List[torch.Tensor]:
    """This rank's rows of each averaged gradient of a (grouped) allgather."""
    reduced = grouped_allreduce(grads, op=Average, process_set=process_set)
    every = synchronize(grouped_allgather_async([torch.tensor([d], dtype=torch.int32) for d in dims],
                                                process_set=process_set))
    me = process_set.rank()
    return [g.narrow(0, int(rows[:me].sum()), d) for g, rows, d in zip(reduced, every, dims)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        return _own_rows([grad], [ctx.dim], ctx.process_set)[0], None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0 (which may differ by rank), in set
    order; differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_own_rows(list(grads), ctx.dims, ctx.process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List[torch.Tensor]:
    """:func:`allgather` of a list of tensors as one operation; differentiable."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        return (reduced if rank() == ctx.root_rank else reduced * 0), None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor`` (a world rank); differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *_):
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` to rank ``r`` of the set (equal parts without
    ``splits``); returns the received rows, and with ``splits`` also the received splits;
    differentiable."""
    return _Alltoall.apply(tensor, splits, name, process_set)


def _scatter_grads(grads, op, pre, post, process_set):
    factor = (process_set.size() if op == Sum else 1) * pre * post
    return [g * factor if factor != 1 else g for g in grads]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, pre, post):
        ctx.args = op, pre, post, process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, process_set = ctx.args
        return allgather(_scatter_grads([grad], op, pre, post, process_set)[0], process_set=process_set), \
            None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """``tensor`` reduced over the set (Sum or Average) with dimension 0 scattered: this rank's
    rows; differentiable."""
    return _compressed(compression, lambda t: (_Reducescatter.apply(t, name, op, process_set, prescale_factor,
                                                                    postscale_factor),), [tensor])[0]


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, pre, post, *tensors):
        ctx.args = op, pre, post, process_set
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set, pre, post)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        return (None,) * 5 + tuple(grouped_allgather(_scatter_grads(grads, op, pre, post, process_set),
                                                     process_set=process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> List[torch.Tensor]:
    """:func:`reducescatter` of a list of tensors as one operation; differentiable."""
    return _compressed(compression, lambda *ts: _GroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *ts), tensors)

