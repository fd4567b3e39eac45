"""``compression="fp16"`` / ``"bf16"``: the node sums cross nodes in 16 bits, an MPI user operation.

As Horovod's ``Compression.fp16``: each node's sum, divided by the number of nodes (so the
values on the wire stay the size of one node's sum however many nodes there are), is cast
to 16 bits, summed across nodes in that precision by an MPI user-defined operation on the
whole part (flat, across tensors: any inter-node strategy), cast back and multiplied out.
No state, no error feedback: the rounding of each step is not carried over.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from .._core.checks import check_choice
from .._core.traffic import allreduce_bytes
from .codec import Channel, Codec, Part, Step

if TYPE_CHECKING:  # importing mpi4py.MPI initializes MPI: not at import time
    from mpi4py import MPI

__all__ = ["Half"]

_DTYPES: Dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _adder(dtype: torch.dtype):
    """``inout += in`` on 16-bit values seen as raw bytes (the MPI user operation)."""
    def add(inbuf, inoutbuf, datatype) -> None:
        if len(memoryview(inbuf)) == 0:
            return
        total = torch.frombuffer(inoutbuf, dtype=dtype)
        total.copy_(total.float().add_(torch.frombuffer(inbuf, dtype=dtype).float()))
    return add


@dataclasses.dataclass(frozen=True)
class Half(Codec):
    """The node sums in 16 bits: ``dtype="fp16"`` keeps 11 significant bits in a range of
    about 6e-8 to 65504 (a node sum above it becomes Inf, and the step is skipped on every
    rank); ``"bf16"`` keeps float32's range with 8 bits. Half the bytes of float32."""

    dtype: str = "fp16"

    @property
    def name(self) -> str:
        return self.dtype

    def check(self, name: str) -> None:
        check_choice(f"{name}.dtype", self.dtype, tuple(_DTYPES))

    def open(self, comm, layout, chunk_bytes: int) -> Channel:
        return _HalfChannel(comm, _DTYPES[self.dtype], chunk_bytes)


class _HalfChannel(Channel):
    """Owns the MPI operation; each chunk of at most ``chunk_bytes`` (of the part's own dtype) is
    one sum, on a 16-bit wire buffer of its own."""

    def __init__(self, comm, dtype: torch.dtype, chunk_bytes: int):
        from mpi4py import MPI

        self.comm, self.dtype, self.chunk_bytes = comm, dtype, chunk_bytes
        self._op: Optional[MPI.Op] = MPI.Op.Create(_adder(dtype), commute=True)

    def steps(self, part: Part) -> Tuple[List[Step], int]:
        values = part.values
        chunk = max(1, self.chunk_bytes // max(1, values.element_size()))
        steps: List[Step] = []
        sent = 0
        for lo in range(0, values.numel(), chunk):
            piece = values[lo:lo + chunk]
            steps += self._chunk_steps(piece)
            sent += allreduce_bytes(piece.numel() * 2, self.comm.Get_size())
        return steps, sent

    def _chunk_steps(self, tensor: torch.Tensor) -> List[Step]:
        from mpi4py import MPI

        from .._transport.sums import start_sum

        parties = self.comm.Get_size()
        wire = torch.empty(tensor.numel(), dtype=self.dtype)
        sums = start_sum(self.comm, wire.view(torch.int16).numpy(), self._op, MPI.INT16_T)

        def finish() -> None:
            tensor.view(-1).copy_(wire).mul_(parties)

        def step(i: int):
            if i == 0:
                # the mean of the node sums: in range for 16 bits however many nodes there are
                wire.copy_(tensor.view(-1).mul(1.0 / parties))
            return sums[i](), finish if i == len(sums) - 1 else None
        return [functools.partial(step, i) for i in range(len(sums))]

    def close(self) -> None:
        if self._op is not None:
            self._op.Free()
            self._op = None
