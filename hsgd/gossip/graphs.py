"""Who talks to whom in each gossip round: schedules that every rank computes the same way.

A graph maps ``(round, rank)`` to this rank's out-peers (it sends to them) and in-peers
(it receives from them). Every rank computes the whole round from the same inputs, so
a receiver always knows whom it receives from: the deadlock that users of sampled
peers hit ("nodes do not know who to receive from") cannot happen, as in SGP's
``graph_manager.py``. The graphs: :class:`RandomGraph`, :class:`RingGraph`,
:class:`ExponentialGraph` (directed; needs push-sum weights).

Example::

    >>> graph = make_graph("exponential", size=8)
    >>> [graph.peers(t, rank=0) for t in range(3)]
    [([1], [7]), ([2], [6]), ([4], [4])]
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

__all__ = ["GRAPHS", "make_graph", "Graph"]

Peers = Tuple[List[int], List[int]]  # (out-peers, in-peers)


class Graph:
    """A peer schedule over ``size`` ranks; ``symmetric``: every edge goes both ways each round."""

    name = ""
    symmetric = True

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seed = size, seed

    def peers(self, round: int, rank: int) -> Peers:
        raise NotImplementedError


class _Matching(Graph):
    """A symmetric graph given by one matching per round."""

    def matching(self, round: int) -> Dict[int, int]:
        raise NotImplementedError

    def peers(self, round: int, rank: int) -> Peers:
        partner = self.matching(round).get(rank)
        return ([], []) if partner is None else ([partner], [partner])


def _pairs(order) -> Dict[int, int]:
    """Pair consecutive entries of ``order``; a last odd entry stays unpaired."""
    match = {}
    for a, b in zip(order[0::2], order[1::2]):
        match[int(a)], match[int(b)] = int(b), int(a)
    return match


class RandomGraph(_Matching):
    """``"random"``: a fresh perfect matching each round, drawn from a seed that all ranks
    share; never a rank with itself; with an odd number of ranks the one left over sits
    the round out. Symmetric: out-peers = in-peers."""

    name = "random"

    def matching(self, round: int) -> Dict[int, int]:
        return _pairs(np.random.default_rng([self.seed, round]).permutation(self.size))


class RingGraph(_Matching):
    """``"ring"``: neighbours on the ring ``0 - 1 - ... - (n-1) - 0``, as a matching that
    shifts by one each round (``(s, s+1), (s+2, s+3), ...`` for ``s = round mod n``), so
    every ring edge is used and with an odd ``n`` the rank that sits out rotates. Symmetric."""

    name = "ring"

    def matching(self, round: int) -> Dict[int, int]:
        start = round % self.size
        return _pairs([(start + i) % self.size for i in range(self.size)])


class ExponentialGraph(Graph):
    """``"exponential"``: directed, as in SGP: in round ``t`` rank ``i`` sends to ``i + 2^k``
    and receives from ``i - 2^k`` (mod ``n``), ``k = t mod K`` over the ``K`` powers of two
    below ``n``. Needs push-sum weights."""

    name = "exponential"
    symmetric = False

    def __init__(self, size: int, seed: int = 0):
        super().__init__(size, seed)
        self.distances = [1 << k for k in range(max(size - 1, 0).bit_length())]  # 2^k < size

    def peers(self, round: int, rank: int) -> Peers:
        if self.size < 2:
            return [], []
        d = self.distances[round % len(self.distances)]
        return [(rank + d) % self.size], [(rank - d) % self.size]


GRAPHS = {cls.name: cls for cls in (RandomGraph, RingGraph, ExponentialGraph)}


def make_graph(name: str, size: int, seed: int = 0) -> Graph:
    """The graph called ``name`` (a key of ``GRAPHS``) over ``size`` ranks."""
    return GRAPHS[name](size, seed)
