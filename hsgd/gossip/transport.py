"""The gossip family's engine: a flat replica, the peer graph, and the messages between peers.

Kept apart as SGP keeps them: the *graph* (``hsgd.gossip.graphs``) says
whom each rank hears from in a round, this *transport* moves a round's
headers and models, and the *mixing* (push-sum, :func:`hsgd.gossip.sgd.push_sum`)
says what a rank does with what arrived.

A round: every rank sends each out-peer a 16-byte header (whether a model
follows, and the weight share that goes with it) and, if it sends, its
model; it receives every in-peer's header, then the models that the headers
announce. Messages are MPI point-to-point (``Isend``/``Irecv``) on a duplicate
of the world communicator (our tags never meet the user's), waited for without
holding the core (:func:`hsgd._core.waits.wait_all`).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .._core.traffic import Traffic
from .._core.waits import wait_all
from .._engine.binding import FlatSlot, SlotBinding
from .._engine.engine import Engine
from .graphs import make_graph

__all__ = ["GossipEngine"]

_HEADER, _MODEL = 1, 2  # message tags
_MPI_TYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}


class GossipEngine(Engine):
    """The replica ``local`` (the parameters are views into it), the ``graph`` and the
    exchange of a round. Collective to build and to close."""

    def __init__(self, topology, params, graph: str, seed: int):
        self.slot = FlatSlot(params, "GossipSGD")
        self._mpi_type = _MPI_TYPES[self.slot.dtype]
        self.binding = SlotBinding(self.slot, params, "data")
        self.local = self.slot.buffer  # x: this rank's model
        self.graph_name = graph
        self.graph = make_graph(graph, topology.size, seed)
        self.node = topology.node_index
        self._nodes = topology.comm.allgather(topology.node_index)
        self._comm = topology.comm.Dup()
        self._inbox: Dict[int, torch.Tensor] = {}  # in-peer -> receive buffer
        self._traffic = Traffic()
        self._opened()

    @property
    def traffic(self) -> Traffic:
        return self._traffic

    def same_node(self, peers) -> bool:
        """Whether every rank of ``peers`` is on this rank's node."""
        return all(self._nodes[p] == self.node for p in peers)

    def exchange(self, outs: Sequence[int], ins: Sequence[int], send: bool,
                 share: float) -> List[Tuple[torch.Tensor, float]]:
        """One round: tell every out-peer whether ``local`` follows (with ``share``), send it
        if ``send``; returns ``(model, share)`` of every in-peer that sent one. ``local`` is
        read by the sends until this returns."""
        comm, x = self._comm, self.local
        header = np.array([1.0 if send else 0.0, share])
        heads = {peer: np.empty(2) for peer in ins}
        requests = [comm.Irecv([heads[peer], MPI.DOUBLE], source=peer, tag=_HEADER) for peer in ins]
        for peer in outs:
            requests.append(comm.Isend([header, MPI.DOUBLE], dest=peer, tag=_HEADER))
            nbytes = header.nbytes
            if send:
                requests.append(comm.Isend([x.numpy(), self._mpi_type], dest=peer, tag=_MODEL))
                nbytes += x.numel() * x.element_size()
            self._count(peer, nbytes)
        wait_all(requests[:len(ins)])  # the headers: who sends a model this round
        received = []
        for peer in ins:
            if heads[peer][0]:
                buf = self._inbox.get(peer)
                if buf is None:
                    buf = self._inbox[peer] = torch.empty_like(x)
                requests.append(comm.Irecv([buf.numpy(), self._mpi_type], source=peer, tag=_MODEL))
                received.append((buf, float(heads[peer][1])))
        wait_all(requests)  # x is read by the sends until here; the models are in
        return received

    def _count(self, peer: int, nbytes: int) -> None:
        if self._nodes[peer] == self.node:
            self._traffic.add_intra(nbytes)
        else:
            self._traffic.add_inter(nbytes)

    def describe(self) -> str:
        return f"graph={self.graph_name!r}"

    def _close(self) -> None:
        self.binding.unbind()
        self._comm.Free()
