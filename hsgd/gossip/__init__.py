"""Gossip: each rank averages with a few peers per round, no global collective.

- :class:`GossipSGD`: local steps, then push-sum averaging with the round's
  peers, sending only a model that changed enough (:mod:`hsgd.gossip.sgd`);
- the peer schedules, which every rank computes the same way (``hsgd.gossip.graphs``).
"""

from .graphs import GRAPHS
from .sgd import DEFAULT_THETA, GossipSGD

__all__ = ["GossipSGD", "GRAPHS", "DEFAULT_THETA"]
