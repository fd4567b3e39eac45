"""``Engine``: what a family of modes builds to keep the replicas in step.

A :class:`~hsgd._engine.mode.SyncMode` checks its arguments, agrees on them, wraps
the inner optimizer and owns the life cycle; the *engine* is the family's machinery
behind it, built once the arguments hold: for :mod:`hsgd.hierarchical` a shared
window with two-level averaging, the bound tensors and the backward overlap; for
:mod:`hsgd.box` a flat replica and a remote-memory region; for :mod:`hsgd.gossip` a
flat replica, the peer graph and the push-sum transport.

Every engine has ``binding`` (a :class:`~hsgd._engine.binding.SlotBinding`),
``traffic`` (a :class:`~hsgd._core.traffic.Traffic`), ``on_phase`` (``None`` or
``fn(name, start, end)``), :meth:`describe` (its settings for the mode's ``repr``)
and a collective, idempotent ``close()`` after which the parameters and gradients
keep their values. What the trainer evaluates and saves is the mode's, not the engine's.
"""

from __future__ import annotations

from typing import Callable, Optional

from .._core.closable import Closable
from .._core.traffic import Traffic
from .binding import SlotBinding

__all__ = ["Engine", "PhaseCallback"]

#: ``fn(name, start, end)``: a communication phase's name and its start and end times
#: (``time.perf_counter()`` seconds).
PhaseCallback = Callable[[str, float, float], None]


class Engine(Closable):
    """The base of the families' engines (see the module doc)."""

    binding: SlotBinding
    on_phase: Optional[PhaseCallback] = None

    @property
    def traffic(self) -> Traffic:
        raise NotImplementedError

    def describe(self) -> Optional[str]:
        """``"key=value, ..."`` for the mode's ``repr``, or ``None``."""
        return None
