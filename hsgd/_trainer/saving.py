"""When and how the trainer saves: ``--save-every`` in steps or seconds, the write in the background.

The state is gathered at a step boundary, where every rank is (a collective); rank 0
then hands it to :class:`CheckpointWriter`, whose thread runs ``torch.save``, ``fsync``
and the rename (:func:`~hsgd._trainer.checkpoint.save_checkpoint`) while training goes
on. Invariants: one write at a time (a save waits for the previous write first); a write
that failed fails the next save, or the end of the run, on every rank alike; a crash in
the middle of a write leaves the last good checkpoint. :class:`SaveCadence` decides the
steps to save at, the same on every rank: every N steps, or, for seconds, a step count
that rank 0 re-estimates from its pace at every save and broadcasts.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Optional, Tuple

from ..errors import InputPermissionError
from .checkpoint import save_checkpoint

__all__ = ["parse_save_every", "SaveCadence", "CheckpointWriter", "FIRST_ESTIMATE_STEPS"]

FIRST_ESTIMATE_STEPS = 10  # --save-every in seconds: steps timed before the first estimate

_EVERY = re.compile(r"^\s*(\d+)\s*(s|m)?\s*$")


def parse_save_every(text) -> Tuple[int, float]:
    """``--save-every``: ``"100"`` (steps) or ``"30s"`` / ``"5m"`` (seconds) as
    ``(steps, seconds)``, one of them 0 (``"0"``: only at epoch ends). Raises
    ``ValueError`` with what to write."""
    match = _EVERY.match(str(text))
    if match is None:
        raise ValueError(f"--save-every takes steps (e.g. 100) or seconds (e.g. 30s, 5m), got {text!r}")
    number, unit = int(match.group(1)), match.group(2)
    if unit is None:
        return number, 0.0
    return 0, float(number * (60 if unit == "m" else 1))


class SaveCadence:
    """Whether to save after a step; every rank asks at every step, with the same answers.

    ``comm``: the ranks (a collective at each step it answers for seconds, not for steps);
    ``step``: the step the run starts from. For seconds, rank 0 times its steps and
    broadcasts the step to save at: after the first ``FIRST_ESTIMATE_STEPS`` steps, then at
    every save (:meth:`saved`, also called for the saves at epoch ends).
    """

    def __init__(self, every: Tuple[int, float], comm, step: int):
        self.steps, self.seconds = every
        self.comm = comm
        self._mark = (step, time.monotonic())
        self._next: Optional[int] = step + FIRST_ESTIMATE_STEPS if self.seconds else None
        self._estimating = bool(self.seconds)  # the next point only estimates, it does not save

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` (collective at the steps where a seconds cadence decides)."""
        if self.steps:
            return step % self.steps == 0
        if self._next is None or step < self._next:
            return False
        if self._estimating:  # the first save: --save-every seconds after the run's start
            self._estimating = False
            self._next = self._plan(step, base=self._mark[0])
            return False
        return True

    def saved(self, step: int) -> None:
        """A checkpoint was taken after ``step`` (collective with a seconds cadence): the next
        save comes ``--save-every`` seconds from now, at rank 0's pace since the last one."""
        if self.seconds and not self._estimating:
            self._next = self._plan(step, base=step)
            self._mark = (step, time.monotonic())

    def _plan(self, step: int, base: int) -> int:
        """``base`` plus the steps of ``--save-every`` seconds at rank 0's pace since the mark,
        and at least the next step; rank 0's answer, broadcast."""
        steps, start = self._mark
        pace = (time.monotonic() - start) / max(1, step - steps)  # rank 0's seconds per step
        later = max(1, round(self.seconds / pace)) if pace > 0 else 1
        later = self.comm.bcast(later if self.comm.Get_rank() == 0 else None, root=0)
        return max(step + 1, base + later)


class CheckpointWriter:
    """Writes checkpoints on rank 0 in a background thread, one at a time (local)."""

    def __init__(self, directory, keep: int):
        self.directory, self.keep = directory, keep
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.last_seconds: Optional[float] = None  # how long the last finished write took

    def submit(self, state: dict, step: int) -> None:
        """Wait for the previous write (raising its error, if it failed), then start writing
        ``state`` as the checkpoint of ``step``."""
        self.wait()
        # Not a daemon: an interpreter that exits (an error on every rank) finishes the write first.
        self._thread = threading.Thread(target=self._write, args=(state, step), name="hsgd-checkpoint")
        self._thread.start()

    def _write(self, state: dict, step: int) -> None:
        start = time.perf_counter()
        try:
            save_checkpoint(self.directory, state, step, self.keep)
        except OSError as exc:  # a full or lost file system: every rank stops with this line
            self._error = InputPermissionError(f"cannot write the checkpoint of step {step} to {self.directory}: "
                                               f"{exc.strerror or exc}; free space there or pass another "
                                               "--checkpoint-dir, then --resume")
        except BaseException as exc:  # noqa: BLE001 - raised by wait(), in the training thread
            self._error = exc
        self.last_seconds = time.perf_counter() - start

    def wait(self) -> None:
        """Until the write in progress, if any, is on disk; raises its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
