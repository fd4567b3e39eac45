"""``Engine``: what a family of modes builds to keep the replicas in step.

A :class:`~hsgd._engine.mode.SyncMode` checks its arguments, agrees on them,
wraps the inner optimizer and owns the life cycle; the *engine* is the
family's machinery behind it, built once the arguments hold:

- the hierarchical family (:mod:`hsgd.hierarchical`): a shared window with
  two-level averaging, the bound gradients or parameters, and the backward
  overlap;
- the parameter box (:mod:`hsgd.box`): a flat replica and a remote-memory region;
- gossip (:mod:`hsgd.gossip`): a flat replica, the peer graph and the push-sum transport.

The interface every engine states:

- ``binding``: the :class:`~hsgd._engine.binding.SlotBinding` of the trained tensors;
- ``traffic``: a :class:`~hsgd._core.traffic.Traffic` of this rank's bytes;
- ``on_phase``: ``None`` or ``fn(name, start, end)``, told each communication phase;
- :meth:`describe`: the engine's settings for the mode's ``repr``;
- ``close()``: collective, idempotent; the parameters and gradients keep their values.

What the trainer evaluates and saves (``shared_state_dict``) is the mode's: it
depends on what the mode means by "the model", not on the machinery.
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
