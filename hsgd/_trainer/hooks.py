"""What the trainer does around its steps, besides the step itself: hooks.

:class:`Hook` names the points of the loop (:mod:`hsgd._trainer.loop`) where one is
called; each does nothing unless overridden. The trainer's hooks: :class:`Straggler`
(``--straggler``), :class:`~hsgd._trainer.balancing.Balancing` (``--balance``), the stop
agreement (:mod:`hsgd._trainer.stopping`), :class:`StopAfter` (``--stop-after``) and
:class:`~hsgd._trainer.progress_bar.Progress`. Every rank builds the same hooks in the
same order, so that their collectives meet.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Iterable, Optional

__all__ = ["Hook", "Hooks", "Straggler", "StopAfter", "OWN_WORK"]

OWN_WORK = ("data", "compute")  # a step's own work: what --straggler stretches (not waiting for others)


class Hook:
    """A no-op at every point of the loop; a hook overrides the points it needs.

    - ``epoch_start(epoch, position)``: before an epoch's first step, or its rest after a
      resume (``position``: the steps already done). Collective.
    - ``step_start()``: before a step's data.
    - ``step_end(step, run_steps)``: after the step and the LR schedule (``step``: the
      steps done in the whole run, ``run_steps``: in this process); returns a reason to
      stop (``"signal"``, ``"stop-after"``) or ``None``. Every hook is called, whatever
      another returned: some are collective.
    - ``logged(record)``: a step record was written (every ``--log-every`` steps).
    - ``epoch_end(record, times, steps)``: the epoch ran to its end and was evaluated
      (``times``: this rank's phase seconds, ``steps``: its steps).
    - ``close()``: the run is over.
    """

    def epoch_start(self, epoch: int, position: int) -> None:
        pass

    def step_start(self) -> None:
        pass

    def step_end(self, step: int, run_steps: int) -> Optional[str]:
        return None

    def logged(self, record: dict) -> None:
        pass

    def epoch_end(self, record: dict, times: Counter, steps: int) -> None:
        pass

    def close(self) -> None:
        pass


class Hooks:
    """The trainer's hooks, called in order."""

    def __init__(self, hooks: Iterable[Optional[Hook]]):
        self.hooks = [hook for hook in hooks if hook is not None]

    def epoch_start(self, epoch: int, position: int) -> None:
        for hook in self.hooks:
            hook.epoch_start(epoch, position)

    def step_start(self) -> None:
        for hook in self.hooks:
            hook.step_start()

    def step_end(self, step: int, run_steps: int) -> Optional[str]:
        """The first reason to stop that a hook gave, after calling every one."""
        reasons = [hook.step_end(step, run_steps) for hook in self.hooks]
        return next((reason for reason in reasons if reason), None)

    def logged(self, record: dict) -> None:
        for hook in self.hooks:
            hook.logged(record)

    def epoch_end(self, record: dict, times: Counter, steps: int) -> None:
        for hook in self.hooks:
            hook.epoch_end(record, times, steps)

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()


class Straggler(Hook):
    """``--straggler``: this rank computes ``slowdown`` times slower than it does.

    Each step's own work (its data and compute on the trainer's ``clock``, not the
    waiting for other ranks) is stretched to ``slowdown`` times by keeping the CPU busy,
    as a slower processor would (a sleep would hand the core to the other ranks); the
    stretch is the ``straggler`` phase. A benchmark's tool, never on by default.
    """

    def __init__(self, slowdown: float, clock):
        self.slowdown, self.clock = slowdown, clock
        self._own_start = 0.0

    def step_start(self) -> None:
        self._own_start = self.clock.total(*OWN_WORK)

    def step_end(self, step: int, run_steps: int) -> None:
        self.stretch(self.clock.total(*OWN_WORK) - self._own_start)

    def stretch(self, seconds: float) -> None:
        """Busy-wait ``(slowdown - 1) * seconds``: work of ``seconds`` takes ``slowdown`` times."""
        with self.clock.phase("straggler"):
            end = time.perf_counter() + (self.slowdown - 1) * seconds
            while time.perf_counter() < end:
                pass


class StopAfter(Hook):
    """``--stop-after N``: stop after ``N`` steps of this process (a test's or a benchmark's run)."""

    def __init__(self, steps: int):
        self.steps = steps

    def step_end(self, step: int, run_steps: int) -> Optional[str]:
        return "stop-after" if run_steps >= self.steps else None
