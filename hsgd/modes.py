"""The synchronization modes, by the name the trainer's ``--sync`` flag takes.

Every mode is a :class:`~hsgd._engine.mode.SyncMode` subclass with a
``name``; this table is the one list of them. ``python -m hsgd.train
--sync NAME`` builds the mode from its config (:mod:`hsgd._trainer.mode_flags`)
and never branches on the name itself.

Example::

    >>> from hsgd.modes import SYNC_MODES
    >>> sorted(SYNC_MODES)
    ['async', 'diloco', 'elastic', 'gossip', 'local', 'sync']
"""

from __future__ import annotations

from ._engine.mode import SyncMode
from .box import AsyncSGD, ElasticSGD
from .gossip import GossipSGD
from .hierarchical import HierarchicalDiLoCo, HierarchicalLocalSGD, HierarchicalSGD

__all__ = ["SYNC_MODES", "SyncMode"]

SYNC_MODES = {cls.name: cls for cls in (HierarchicalSGD, HierarchicalLocalSGD, HierarchicalDiLoCo, ElasticSGD, AsyncSGD,
                                        GossipSGD)}
