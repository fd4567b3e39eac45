"""``"int8"`` / ``"int4"``: the node sums cross nodes as 8- or 4-bit integers, a scale per block, error feedback.

A part is cut into blocks of ``block`` values (a block never straddles two tensors); a block
travels as its scale (float32, its largest magnitude / 127, or / 7 in 4 bits) and one int8 per
value (int4: two values a byte, each offset by 8). The sum
is a reduce-scatter and an allgather (the ring's bytes at any number of nodes): each node
quantizes its node sum plus its error buffer and sends party ``j`` the ``j``-th share of
the blocks (``MPI_Ialltoallv``); party ``j`` dequantizes the shares it got, adds them and
its own error buffer of that share, quantizes the sum again and sends it to every party
(``MPI_Iallgatherv``), which dequantizes. Two roundings, each at most half a step of its
block (1/254 of the block's largest magnitude; 1/14 in 4 bits), each kept in an error buffer and added to
the next round's values; the allgather forwards bytes unchanged. The used-flags of a
binding (``layout.exact``) are summed exactly beside. One state per node: the error of the
node's message where it is computed, and of the share the rank reduces.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._core.checks import check_int
from .._core.traffic import allreduce_bytes
from ..errors import InputValueError
from .codec import Channel, Codec, FeedbackChannel, Gathered, Part, Step, entry_ranges, sum_steps

__all__ = ["Int8", "Int4", "quantize", "dequantize"]

_SCALE_BYTES = 4  # a float32 scale before each block


def quantize(values: torch.Tensor, levels: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``values`` as ``(scales, q)``: float32 scales (largest magnitude / ``levels``) and
    int8 values in ``[-levels, levels]``, rounded to nearest. A row holding NaN or Inf gets a
    scale that is NaN or Inf, so that its values decode as non-finite, never as numbers."""
    scales = (values.abs().amax(dim=1) / levels).to(torch.float32)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).to(values.dtype)  # a zero block stays 0
    q = torch.round(values / safe[:, None]).clamp_(-levels, levels).to(torch.int8)
    return scales, q


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The bytes of :func:`quantize`'s ``q`` (rows of an even length in 4 bits): itself as bytes in
    8 bits; in 4 bits two values a byte, each offset by 8 (``[-7, 7]`` as ``[1, 15]``), the first low."""
    if bits == 8:
        return q.view(torch.uint8)
    u = (q + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack`: int8 values, rows of twice the bytes in 4 bits."""
    if bits == 8:
        return packed.view(torch.int8)
    halves = torch.stack((packed & 15, packed >> 4), dim=2).view(packed.shape[0], -1)
    return halves.to(torch.int8) - 8


def dequantize(scales: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of :func:`quantize`'s ``(scales, q)`` in ``dtype``: the same on every rank."""
    return q.to(dtype) * scales.to(dtype)[:, None]


@dataclasses.dataclass(frozen=True)
class Int8(Codec):
    """Node sums across nodes in 8 bits plus a float32 scale per ``block`` values (25.4% of
    float32's bytes at 256), with error feedback. Works with both inter-node strategies:
    ``"sharded"`` ranks quantize their own slices, in blocks that start at their slice.
    ``tensor_blocks``: every tensor starts a block (its last block padded with zeros); False:
    the blocks run on from one tensor into the next, no padding (the fewest bytes for models
    of many small tensors; DiLoCo's ``outer_compression="int8"``)."""

    block: int = 256
    tensor_blocks: bool = True
    feedback = True
    bits = 8  # per value on the wire; the largest integer sent is 2**(bits-1) - 1: symmetric, so that 0 is exact

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def check(self, name: str) -> None:
        check_int(f"{name}.block", self.block, 1)

    def open(self, comm, layout, chunk_bytes: int) -> Channel:
        return _QuantizedChannel(comm, layout, chunk_bytes, self.block, self.bits, self.tensor_blocks)


@dataclasses.dataclass(frozen=True)
class Int4(Int8):
    """:class:`Int8` in 4 bits: integers in ``[-7, 7]``, two a byte, plus a float32 scale per
    ``block`` values (an even number; 12.9% of float32's bytes at 256), with error feedback.
    Each rounding moves a value by at most 1/14 of its block's largest magnitude."""

    bits = 4

    def check(self, name: str) -> None:
        check_int(f"{name}.block", self.block, 2)
        if self.block % 2:
            raise InputValueError(f"{name}.block must be even for int4 (two values a byte), got {self.block}")


class _PartState:
    """One part's plan, buffers and error feedback (worker: the part's blocks; server: this
    rank's share of each chunk)."""

    def __init__(self, part: Part, layout, block: int, record: int, chunk_blocks: int, parties: int, me: int,
                 tensor_blocks: bool = True):
        ranges = entry_ranges(layout, part)
        self.ranges = [(lo, hi) for entry, lo, hi in ranges if entry not in layout.exact]
        self.exact = [(lo, hi) for entry, lo, hi in ranges if entry in layout.exact]
        self.starts, at = [], 0  # each range's first value in the blocks
        for lo, hi in self.ranges:
            self.starts.append(at)
            at += hi - lo
            if tensor_blocks:  # the next tensor starts a block: the last one of this one is padded
                at = -(-at // block) * block
        blocks = -(-at // block)
        dtype = part.values.dtype
        self.error = torch.zeros(blocks, block, dtype=dtype)
        self.candidate = torch.zeros(blocks, block, dtype=dtype)  # the values sent, then the new error
        self.wire = torch.zeros(blocks, record, dtype=torch.uint8)
        self.chunks: List[Tuple[int, int, List[int]]] = []  # (first block, blocks, every party's share)
        for first in range(0, blocks, chunk_blocks):
            n = min(chunk_blocks, blocks - first)
            self.chunks.append((first, n, [n // parties + (j < n % parties) for j in range(parties)]))
        shares = [counts[me] for _, _, counts in self.chunks]
        self.server = [torch.zeros(k, block, dtype=dtype) for k in shares]
        self.server_candidate = [torch.zeros(k, block, dtype=dtype) for k in shares]
        self.received = [torch.empty(parties * k, record, dtype=torch.uint8) for k in shares]
        self.mine = [torch.empty(k, record, dtype=torch.uint8) for k in shares]

    def commit(self) -> None:
        self.error, self.candidate = self.candidate, self.error
        self.server, self.server_candidate = self.server_candidate, self.server


class _QuantizedChannel(FeedbackChannel):
    """int8's and int4's channel (``bits`` per value): the steps of one part (the module doc), per
    chunk of at most ``chunk_bytes`` on the wire."""

    def __init__(self, comm, layout, chunk_bytes: int, block: int, bits: int, tensor_blocks: bool = True):
        from mpi4py import MPI

        super().__init__()
        self.comm, self.layout, self.block, self.bits = comm, layout, block, bits
        self.levels, self.tensor_blocks = 2 ** (bits - 1) - 1, tensor_blocks
        self.record = _SCALE_BYTES + block * bits // 8
        self.chunk_blocks = max(1, chunk_bytes // self.record)
        self._type: Optional[Any] = MPI.BYTE.Create_contiguous(self.record).Commit()  # one block on the wire
        self._parts: Dict[str, _PartState] = {}
        self._loaded: Dict[str, Dict[str, Any]] = {}

    @staticmethod
    def _key(part: Part) -> str:
        return f"{part.segment}:{part.lo}:{part.hi}"

    def _state(self, part: Part) -> _PartState:
        key = self._key(part)
        state = self._parts.get(key)
        if state is None:
            state = _PartState(part, self.layout, self.block, self.record, self.chunk_blocks, self.comm.Get_size(),
                               self.comm.Get_rank(), self.tensor_blocks)
            saved = self._loaded.pop(key, None)
            if saved is not None:
                state.error.copy_(saved["error"])
                for mine, kept in zip(state.server, saved["server"]):
                    mine.copy_(kept)
            self._parts[key] = state
        self._hold(key, state, part)
        return state

    def steps(self, part: Part) -> Tuple[List[Step], int]:
        state, p, me = self._state(part), self.comm.Get_size(), self.comm.Get_rank()
        steps: List[Step] = []
        sent = 0
        for c, (_, n, counts) in enumerate(state.chunks):
            steps += [functools.partial(self._exchange, part, state, c),
                      functools.partial(self._gather, part, state, c)]
            sent += (n - counts[me] + counts[me] * (p - 1)) * self.record
        if state.exact:
            exact = Gathered(part, state.exact)
            steps += sum_steps(self.comm, exact.flat, exact.gather, exact.scatter)
            sent += allreduce_bytes(exact.numel * exact.flat.element_size(), p)
        return steps, sent

    def _encode(self, values: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """Quantize ``values`` (blocks) into the records ``into``; returns what they decode to."""
        scales, q = quantize(values, self.levels)
        into[:, :_SCALE_BYTES] = scales.view(torch.uint8).view(-1, _SCALE_BYTES)
        into[:, _SCALE_BYTES:] = pack(q, self.bits)
        return dequantize(scales, q, values.dtype)

    def _decode(self, records: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scales = records[:, :_SCALE_BYTES].contiguous().view(torch.float32).view(-1)
        return dequantize(scales, unpack(records[:, _SCALE_BYTES:], self.bits), dtype)

    def _exchange(self, part: Part, state: _PartState, c: int):
        """Chunk ``c``'s reduce-scatter: (first chunk) the node's message, then every party its share."""
        if c == 0:
            flat = state.candidate.view(-1)
            flat.zero_()
            for (lo, hi), start in zip(state.ranges, state.starts):
                at = start
                flat[at:at + hi - lo] = part.values[lo - part.lo:hi - part.lo]
            state.candidate += state.error
            state.candidate -= self._encode(state.candidate, state.wire)  # now the new error
        first, n, counts = state.chunks[c]
        offsets = [sum(counts[:j]) for j in range(len(counts))]
        k = counts[self.comm.Get_rank()]
        send = [state.wire[first:first + n].numpy(), counts, offsets, self._type]
        recv = [state.received[c].numpy(), [k] * len(counts), [j * k for j in range(len(counts))], self._type]
        return self.comm.Ialltoallv(send, recv), None

    def _gather(self, part: Part, state: _PartState, c: int):
        """Chunk ``c``'s allgather: this rank's share, summed (in party order) and quantized again."""
        first, n, counts = state.chunks[c]
        k, dtype = counts[self.comm.Get_rank()], part.values.dtype
        if k:
            shares = state.received[c].view(len(counts), k, self.record)
            total = state.server[c].clone()
            for share in shares:
                total += self._decode(share, dtype)
            state.server_candidate[c] = total - self._encode(total, state.mine[c])
        offsets = [sum(counts[:j]) for j in range(len(counts))]
        request = self.comm.Iallgatherv([state.mine[c].numpy(), k, self._type],
                                        [state.wire[first:first + n].numpy(), counts, offsets, self._type])
        return request, (lambda: self._decode_into(part, state)) if c == len(state.chunks) - 1 else None

    def _decode_into(self, part: Part, state: _PartState) -> None:
        flat = self._decode(state.wire, part.values.dtype).view(-1)
        for (lo, hi), start in zip(state.ranges, state.starts):
            at = start
            part.values[lo - part.lo:hi - part.lo] = flat[at:at + hi - lo]

    def state_dict(self) -> Dict[str, Any]:
        parts = {key: {"error": s.error.clone(), "server": [t.clone() for t in s.server]}
                 for key, s in self._parts.items()}
        # a loaded part not summed since (a streaming fragment between its rounds) is kept as loaded
        return {"parts": {**self._loaded, **parts}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._parts = {}
        self._pending.clear()
        self._loaded = dict(state.get("parts", {}))

    def close(self) -> None:
        if self._type is not None:
            self._type.Free()
            self._type = None

