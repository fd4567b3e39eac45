"""The gossip family's engine: a flat replica, the peer graph, and the messages between peers.

Kept apart as SGP keeps them: the *graph* (:mod:`hsgd.gossip.graphs`) says whom each
rank hears from in a round, this *transport* moves a round's headers and models, and
the *mixing* (:func:`hsgd.gossip.sgd.push_sum`) says what a rank does with what arrived.

A round is one message from every rank to each out-peer: a 16-byte header (whether a
model follows, and the weight share that goes with it) and, if it sends, its model
behind the header in the same buffer (:class:`hsgd._engine.binding.FlatSlot` with
``header_bytes``). Messages are MPI point-to-point (``Isend``/``Irecv``) on a duplicate
of the world communicator (our tags never meet the user's); between ranks on one node
MPICH and Open MPI carry them through shared memory.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from mpi4py import MPI

from .._core.meter import Meter
from .._core.waits import wait_all
from .._engine.binding import FlatSlot, SlotBinding
from .._engine.protocols import Engine
from .graphs import make_graph

__all__ = ["GossipEngine"]

_TAG = 1
_HEADER_BYTES = 16  # [a model follows (1.0) or not (0.0), the weight share], two float64
_MPI_TYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}


class GossipEngine(Engine):
    """The replica ``local`` (the parameters are views into it), the ``graph`` and the
    exchange of a round; every byte sent counts in ``meter`` (the mode's). Collective to
    build and to close."""

    def __init__(self, topology, params, graph: str, seed: int, meter: Meter):
        self.meter = meter
        self.slot = FlatSlot(params, "GossipSGD", header_bytes=_HEADER_BYTES)
        self._mpi_type = _MPI_TYPES[self.slot.dtype]
        self.binding = SlotBinding(self.slot, params, "data")
        self.local = self.slot.buffer  # x: this rank's model, the tail of the frame we send
        self._frame, self._skip = self.slot.frame, self.slot.header
        self._head = self._frame[:self._skip].view(torch.float64)
        self.graph_name = graph
        self.graph = make_graph(graph, topology.size, seed)
        self.node = topology.node_index
        self._nodes = topology.comm.allgather(topology.node_index)
        self._comm = topology.comm.Dup()
        self._inbox: Dict[int, torch.Tensor] = {}  # in-peer -> its frame's receive buffer
        self._opened()

    def same_node(self, peers) -> bool:
        """Whether every rank of ``peers`` is on this rank's node."""
        return all(self._nodes[p] == self.node for p in peers)

    def exchange(self, outs: Sequence[int], ins: Sequence[int], send: bool,
                 share: float) -> List[Tuple[torch.Tensor, float]]:
        """One round: send every out-peer the header (whether ``local`` follows, ``share``) and,
        if ``send``, ``local`` in the same message; returns ``(model, share)`` of every in-peer
        that sent one (views into the inbox, valid until the next round). ``local`` is read by
        the sends until this returns."""
        comm, skip = self._comm, self._skip
        for peer in ins:
            if peer not in self._inbox:
                self._inbox[peer] = torch.empty_like(self._frame)
        frames = [self._inbox[peer] for peer in ins]
        self._head[0], self._head[1] = (1.0 if send else 0.0), share
        message = (self._frame if send else self._frame[:skip]).numpy()
        requests = []
        # Over TCP a large MPI message begins with a rendezvous (UCX's request to send, then the
        # receiver's answer), and those small control messages wait in the link's queue behind
        # whatever data is already in it. Sent as a header, then the model, a pair that had
        # finished its headers filled the queue before another pair's rendezvous had crossed;
        # with receives posted first, a rank answered its peer's request and the peer's data
        # went ahead of the answer to this rank's own. Hence one message per peer, sends first
        # (measured: docs/benchmarks-appendix.md, the cost model against emulated links).
        for peer in outs:  # the sends first: their rendezvous leaves before any answer to the peers'
            requests.append(comm.Isend([message, self._mpi_type], dest=peer, tag=_TAG))
            self._count(peer, message.nbytes)
        requests += [comm.Irecv([frame.numpy(), self._mpi_type], source=peer, tag=_TAG)
                     for peer, frame in zip(ins, frames)]
        wait_all(requests)  # without holding the core: ranks may share cores with the TCP stack
        received = []
        for frame in frames:
            head = frame[:skip].view(torch.float64)
            if head[0]:
                received.append((frame[skip:], float(head[1])))
        return received

    def _count(self, peer: int, nbytes: int) -> None:
        if self._nodes[peer] == self.node:
            self.meter.add_intra(nbytes)
        else:
            self.meter.add_inter(nbytes)

    def describe(self) -> str:
        return f"graph={self.graph_name!r}"

    def _close(self) -> None:
        self.binding.unbind()
        self._comm.Free()
