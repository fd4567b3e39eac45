"""``GossipSGD``: local steps, then averaging with peers; adaptive: only a changed model is sent.

Gossip SGD (``shared/PAPERS.md``, sections 3 and 4): after each local step a rank
averages its model with its peers of the round (:mod:`hsgd.gossip.graphs`); there is no
global collective in the step, only messages between peers (:mod:`hsgd.gossip.transport`).
Every exchange is push-sum (Kempe et al. 2003; SGP's ``PushSum``, :func:`push_sum`), and
a rank sends its model only when it moved enough since it last sent it (Ho et al.,
CCGrid 2018; EventGraD's trigger). The traffic counters count every byte sent, headers
included: ``intra_bytes`` to peers on this rank's node, ``inter_bytes`` to others.

Invariants: every round leaves the total mass, and so the mean of all models weighted
by ``w``, unchanged, whoever sends; a receiver waits only for peers that the schedule
puts in the same round, never for a sender's decision, so no deadlock is possible. The
model worth evaluating and saving is the consensus ``sum(w_i x_i) / sum(w_i)``
(:meth:`GossipSGD.shared_state_dict`, one collective), never one rank's replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Sequence, Tuple, get_args

import torch
from mpi4py import MPI

from .._core.settings import Choice, Integer, Real, setting
from .._engine.binding import FlatSlot
from .._engine.mode import SyncMode, collective
from .graphs import GRAPHS, Graph
from .transport import GossipEngine

__all__ = ["GossipSGD", "DEFAULT_THETA", "push_sum"]

#: The default ``theta`` (and ``--gossip-theta``): on the default MNIST-1D run (4 ranks) it cut
#: nearly all the bytes of every-step gossip at the same test accuracy (docs/benchmarks.md,
#: gossip with adaptive communication). On a harder problem a smaller theta keeps replicas closer.
DEFAULT_THETA = 0.1
#: The peer graphs, as a type: what ``graph`` takes (the keys of :data:`hsgd.gossip.graphs.GRAPHS`).
GraphName = Literal["random", "ring", "exponential"]
assert get_args(GraphName) == tuple(GRAPHS), "GraphName names hsgd.gossip.graphs.GRAPHS, in its order"


def push_sum(x: torch.Tensor, weight: float, received: List[Tuple[torch.Tensor, float]]) -> float:
    """The mixing: ``x`` becomes ``(weight x + sum(w_i x_i)) / (weight + sum(w_i))`` over the
    ``(x_i, w_i)`` received, in place; returns the new weight.

    Each rank keeps a weight ``w`` (1 at the start) and its model ``x``; a rank that sends
    to ``k`` peers keeps ``1/(k+1)`` of its mass ``(w x, w)`` and sends each peer the same
    share; a receiver adds what arrives and divides by its new weight. On a symmetric graph
    with every rank sending, ``w`` stays 1 and a pair's exchange is exactly
    ``x_i, x_j <- (x_i + x_j) / 2``."""
    if not received:
        return weight
    total = weight + sum(w for _, w in received)
    x.mul_(weight / total)
    for buf, w in received:
        x.add_(buf, alpha=w / total)
    return total


class GossipSGD(SyncMode):
    """Wraps ``optimizer``: a local step, then one gossip round with this round's peers.

    Args:
        optimizer, model, topology, broadcast, stall: see :class:`~hsgd._engine.mode.SyncMode`.
        **settings: the fields of :class:`GossipSGD.Settings` (``graph``, ``theta``, ``seed``).

    A rank sends its model only when ``||x - x_sent|| > theta * ||x_sent||``, ``x_sent``
    being what it last sent; ``theta = inf`` sends no messages at all. A silent sender
    still sends a 16-byte header (a flag and its weight share, 0) every round it has a
    peer, so every receiver knows what to wait for.

    Example::

        >>> opt = hsgd.GossipSGD(torch.optim.SGD(model.parameters(), lr=0.05), model,
        ...                      graph="exponential", theta=0.01)
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()           # local step, then one gossip round
        >>> consensus = opt.shared_state_dict()
        >>> opt.close()
    """

    @dataclass(frozen=True)
    class Settings(SyncMode.Settings):
        """:class:`GossipSGD`'s settings."""

        graph: GraphName = setting("exponential", "peers of each gossip round: exponential (directed, push-sum) | "
                                                  "ring | random (matchings); see hsgd.gossip.graphs",
                                   Choice(get_args(GraphName)), flag="gossip_graph")
        theta: float = setting(DEFAULT_THETA, "gossip sends a model only when it moved more than THETA times the "
                                              "norm of the one it last sent; 0: every step, inf: never",
                               Real(0, hint="(0: send every round, inf: never)"), flag="gossip_theta")
        seed: int = setting(0, "the shared seed of the random graph", Integer(0), flag="seed", shared=True)

    settings: Settings
    name = "gossip"
    replicas_differ = True
    lockstep = False  # peers wait for peers, nobody for everybody
    engine: GossipEngine

    def _make_engine(self, params: List[torch.nn.Parameter]) -> GossipEngine:
        engine = GossipEngine(self.topology, params, self.settings.graph, self.settings.seed, self.meter)
        self.sent = engine.local.clone()  # x_sent
        self.weight = 1.0
        self.sends = 0  # rounds in which this rank sent its model
        return engine

    # --- the step -----------------------------------------------------------------------------
    def _step(self) -> None:
        self._unscale_local()
        self._optimizer_step()
        if math.isinf(self.settings.theta):
            return  # nobody ever sends: no round at all
        outs, ins = self.graph.peers(self.num_steps, self.topology.rank)
        if not outs and not ins:
            return
        with self.meter.phase("intra" if self.engine.same_node(set(outs) | set(ins)) else "inter"):
            self._binding.gather()
            self._round(outs, ins)
            self._binding.scatter()

    @property
    def local(self) -> torch.Tensor:
        """``x``: this rank's flat model; the parameters are views into it."""
        return self.engine.local

    @property
    def graph(self) -> Graph:
        """The peer graph (``hsgd.gossip.graphs``)."""
        return self.engine.graph

    @property
    def _slot(self) -> FlatSlot:
        return self.engine.slot

    def triggered(self) -> bool:
        """Whether this rank's model moved enough since its last send to send it now."""
        theta = self.settings.theta
        if theta == 0:
            return True
        moved = torch.dist(self.local, self.sent).item()
        return moved > theta * torch.linalg.vector_norm(self.sent).item()

    def _round(self, outs: Sequence[int], ins: Sequence[int]) -> None:
        send = bool(outs) and self.triggered()
        share = self.weight / (len(outs) + 1) if send else 0.0
        received = self.engine.exchange(outs, ins, send, share)
        if send:
            self.sent.copy_(self.local)
            self.sends += 1
            self.weight = share  # kept: the same share as each peer got
        self.weight = push_sum(self.local, self.weight, received)

    # --- what the trainer evaluates, saves and resumes ---------------------------------------------
    @collective("consensus()")
    def consensus(self) -> torch.Tensor:
        """``sum(w_i x_i) / sum(w_i)`` over all ranks, flat, in float64. Collective."""
        self._check_open()
        self._binding.gather()
        mass = torch.cat([self.local.to(torch.float64) * self.weight, torch.tensor([self.weight],
                                                                                   dtype=torch.float64)])
        self.topology.comm.Allreduce(MPI.IN_PLACE, mass.numpy(), op=MPI.SUM)
        return mass[:-1] / mass[-1]

    @collective("shared_state_dict()")
    def shared_state_dict(self) -> Dict[str, Any]:
        """The model with the consensus as its parameters (buffers averaged). Collective."""
        state = super().shared_state_dict()
        flat = self.consensus()
        for name, p, (_, off) in zip(self._trained_names(), self._binding.params, self._slot.layout.places):
            state[name] = flat[off:off + p.numel()].view(p.shape).to(p.dtype)
        return state

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state, the step count, and this rank's push-sum weight and ``x_sent``."""
        state = super().state_dict()
        state["hsgd_gossip"] = {"weight": self.weight, "sent": self.sent.clone()}
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned. Without ``"hsgd_gossip"`` (e.g. a checkpoint of
        another mode) the push-sum weight restarts at 1 and ``x_sent`` at the loaded model."""
        state_dict = dict(state_dict)
        gossip = state_dict.pop("hsgd_gossip", None)
        super().load_state_dict(state_dict)
        self._binding.gather()
        if gossip is None:  # e.g. another number of ranks: start from the loaded model
            self.weight = 1.0
            self.sent.copy_(self.local)
        else:
            self.weight = float(gossip["weight"])
            self.sent.copy_(gossip["sent"])

    def merge_state_dicts(self, states: Sequence[Dict[str, Any]], world_size: int) -> Dict[str, Any]:
        """The mean of the old ranks' inner optimizer states, without the push-sum state: every
        new rank starts from the checkpoint's consensus with weight 1 (the weights then sum to
        the rank count, as at the start of a run)."""
        merged = super().merge_state_dicts(states, world_size)
        merged.pop("hsgd_gossip", None)
        return merged

    def __repr__(self) -> str:
        return (f"GossipSGD({type(self.optimizer).__name__}, graph={self.settings.graph!r}, "
                f"theta={self.settings.theta}, {self.topology})")
