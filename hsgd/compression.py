"""Compression of the inter-node level: node sums cross the network in 16 bits.

``compression="fp16"`` or ``"bf16"`` on :class:`~hsgd.HierarchicalSGD` and
:class:`~hsgd.HierarchicalLocalSGD` (``--compression`` in the trainer), in the manner of
Horovod's ``Compression.fp16``. Only the inter-node allreduce changes; inside a node
nothing does, and with one node nothing is compressed. The traffic counters
(``inter_bytes``) count the 16-bit bytes. ``fp16`` keeps 11 significant bits in a range
of about 6e-8 to 65504 (a node sum above it becomes Inf, and hsgd skips the step:
``HierarchicalSGD.gradients_finite``); ``bf16`` keeps float32's range with 8 bits.

Example::

    >>> codec = make_codec("bf16")
    >>> codec.allreduce_(comm, node_sum)   # in place
    >>> codec.close()
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Literal, Optional, Tuple, get_args

import torch

if TYPE_CHECKING:  # importing mpi4py.MPI initializes MPI: not at import time
    from mpi4py import MPI

from ._core.checks import check_choice

__all__ = ["COMPRESSIONS", "HalfCodec", "make_codec"]

#: The compressions, as a type: what ``compression`` takes (``None`` is ``"none"``).
Compression = Literal["none", "fp16", "bf16"]
COMPRESSIONS: Tuple[str, ...] = get_args(Compression)  # the same names, for checks and --compression's choices
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _adder(dtype: torch.dtype):
    """``inout += in`` on 16-bit values seen as raw bytes (the MPI user operation)."""
    def add(inbuf, inoutbuf, datatype) -> None:
        if len(memoryview(inbuf)) == 0:
            return
        total = torch.frombuffer(inoutbuf, dtype=dtype)
        total.copy_(total.float().add_(torch.frombuffer(inbuf, dtype=dtype).float()))
    return add


class HalfCodec:
    """Sum float32/float64 buffers across a communicator in a 16-bit dtype. Owns an MPI op.

    Each node's sum is divided by the number of parties (so the values on the wire stay the
    size of one node's sum however many nodes there are), cast to 16 bits, summed across
    nodes in that precision by an MPI user-defined operation, cast back and multiplied out.
    """

    def __init__(self, name: str):
        from mpi4py import MPI

        self.name, self.dtype = name, _DTYPES[name]
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()  # bytes per value on the wire
        self._op: Optional[MPI.Op] = MPI.Op.Create(_adder(self.dtype), commute=True)
        self._wire: Optional[torch.Tensor] = None

    def allreduce_(self, comm, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (contiguous, CPU) over ``comm`` in place through 16 bits (``itemsize`` bytes
        per value on the wire)."""
        from mpi4py import MPI

        n, parties = tensor.numel(), comm.Get_size()
        if not n:
            return
        if self._wire is None or self._wire.numel() < n:
            self._wire = torch.empty(n, dtype=self.dtype)
        wire = self._wire[:n]
        from ._transport.sums import sum_

        finish = self._to_wire(tensor, wire, parties)
        sum_(comm, wire.view(torch.int16).numpy(), self._op, MPI.INT16_T)
        finish()

    def start_allreduce(self, comm, tensor: torch.Tensor) -> list:
        """:meth:`allreduce_` without waiting, on a wire buffer of its own: the steps of
        :func:`hsgd._transport.sums.start_sum`, each ``() -> (request, finish or None)`` to start
        once the one before it completed; the first also fills the wire buffer, the last's
        ``finish`` casts the sums back into ``tensor``."""
        from mpi4py import MPI

        from ._transport.sums import start_sum

        parties = comm.Get_size()
        wire = torch.empty(tensor.numel(), dtype=self.dtype)
        sums = start_sum(comm, wire.view(torch.int16).numpy(), self._op, MPI.INT16_T)
        finish = []

        def step(i: int):
            if i == 0:
                finish.append(self._to_wire(tensor, wire, parties))
            return sums[i](), finish[0] if i == len(sums) - 1 else None
        return [functools.partial(step, i) for i in range(len(sums))]

    @staticmethod
    def _to_wire(tensor: torch.Tensor, wire: torch.Tensor, parties: int):
        """Fill ``wire`` with the mean of the node sums in ``tensor`` (in range for 16 bits); returns the
        function that, once ``wire`` holds the sums of those means, puts the sums into ``tensor``."""
        wire.copy_(tensor.view(-1).mul(1.0 / parties))

        def finish() -> None:
            tensor.view(-1).copy_(wire).mul_(parties)
        return finish

    def close(self) -> None:
        if self._op is not None:
            self._op.Free()
            self._op = None


def make_codec(compression: Optional[str]) -> Optional[HalfCodec]:
    """The codec for ``compression`` (``None`` or ``"none"``: no codec)."""
    if compression is None or compression == "none":
        return None
    check_choice("compression", compression, COMPRESSIONS)
    return HalfCodec(compression)
