"""Matching operations by name across the ranks of a process set, without a background thread.

Each rank sends rank 0 of the set (the coordinator) one message per operation it submits:
its kind, name and what must be equal on every rank. Once every rank submitted a name (or
called ``join()``), the coordinator checks the descriptions and sends every rank the same
response, in the same order; each rank then starts the operation's non-blocking collective
(:mod:`hsgd.horovod.execution`) on the set's data communicator, or fails it with the
coordinator's message. Ranks may submit in different orders; the responses' order is
the order the collectives start in. Messages and collectives move only inside calls of
``hsgd.horovod`` (MPI progresses inside MPI calls): a rank that computes does not
coordinate, and a rank blocked in another library's collective does not either.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._core.waits import Backoff
from ..errors import InputValueError
from .execution import Transfer, start
from .step_token import StepToken

__all__ = ["Submission", "Entry", "Matcher"]

logger = logging.getLogger(__name__)

_REQUEST, _RESPONSE = 11, 12  # tags on the control communicator
Key = Tuple[str, str]         # (kind, name)


@dataclass
class Submission:
    """What one rank tells the coordinator about one operation."""

    kind: str
    name: str
    match: Tuple[Any, ...] = ()  # (field, value) pairs that must be equal on every rank
    extra: Any = None            # this rank's own part (first dimension, splits, an object)
    error: Optional[str] = None  # this rank refused the operation: the others fail with this

    @property
    def key(self) -> Key:
        return self.kind, self.name


class Entry:
    """One operation on this rank, from submission to result: :attr:`done`, then
    :attr:`result` or :attr:`error` (the coordinator's message)."""

    def __init__(self, kind: str, tensors=(), outputs=(), **params: Any):
        self.kind, self.tensors, self.outputs, self.params = kind, list(tensors), list(outputs), params
        self.done = False
        self.result: Any = None
        self.error: Optional[str] = None

    def finish(self, result: Any) -> None:
        self.done, self.result = True, result

    def fail(self, message: str) -> None:
        self.done, self.error = True, message


class Matcher:
    """The name matching of one process set, on this rank (one of its members).

    ``comm``: the set's communicator (duplicated twice: control messages, data collectives);
    ``hvd_ranks``: each member's rank in the world, for messages.
    """

    def __init__(self, comm, hvd_ranks: List[int]):
        self.ctl, self.data = comm.Dup(), comm.Dup()
        self.rank, self.size, self.hvd_ranks = comm.Get_rank(), comm.Get_size(), list(hvd_ranks)
        self._pending: Dict[Key, Entry] = {}
        self._running: List[Transfer] = []
        self._sends: List[Any] = []
        self._unnamed, self._epoch = 0, 0
        self._closing = False
        self.tokens: List[StepToken] = []  # the set's DistributedOptimizers' (hsgd.horovod.step_token)
        # the coordinator's state (rank 0)
        self._arrived: Dict[Key, Dict[int, Submission]] = {}
        self._since: Dict[Key, float] = {}
        self._joined: List[int] = []
        self._stall_check = float(os.environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", "60") or 60)

    # --- this rank's side -----------------------------------------------------------------
    def auto_name(self) -> str:
        """The name of the next unnamed operation: a counter, so unnamed operations must be
        issued in the same order on every rank. It restarts, in a new epoch, after each
        ``join()``: a rank that joined skipped the others' unnamed operations."""
        self._unnamed += 1
        return f"noname.{self._epoch}.{self._unnamed}"

    def submit(self, submission: Submission, entry: Entry) -> Entry:
        """Hand ``submission`` to the coordinator; ``entry`` gets its result. Raises
        ``ValueError`` if an operation of this kind and name is still in flight here."""
        if submission.key in self._pending:
            raise InputValueError(f"a {submission.kind} named {submission.name!r} is already in flight on this "
                                  "rank; wait for it (hvd.synchronize) or give the new one another name")
        self._pending[submission.key] = entry
        self._send(submission)
        self.progress()
        return entry

    def refuse(self, submission: Submission) -> None:
        """This rank refused the operation (``submission.error``): the other ranks' copies fail
        with that message instead of waiting for it."""
        self._send(submission)
        self.progress()

    def join_steps(self) -> None:
        """This rank joined: take part in the set's optimizer steps (zero gradients) from now on,
        until every member joined (:meth:`following` turns false)."""
        for token in self.tokens:
            token.join()

    def following(self) -> bool:
        """Whether this rank still follows, joined, the steps of an optimizer of the set."""
        return any(token.joined for token in self.tokens)

    def in_flight(self) -> int:
        """Operations submitted here and not finished."""
        return len(self._pending) + len(self._running)

    def _send(self, submission: Submission) -> None:
        if self.rank == 0:
            self._arrive(0, submission)
        else:
            self._sends.append(self.ctl.isend(submission, dest=0, tag=_REQUEST))

    def progress(self) -> bool:
        """Move everything one step: requests, responses, collectives. Whether anything moved."""
        moved = False
        if self.rank == 0:
            moved = self._drain(_REQUEST, self._arrive) | self._match()
        moved |= self._drain(_RESPONSE, self._respond_all)
        for token in list(self.tokens):  # on a rank in join(): the optimizers' steps
            moved |= token.progress()
        running = [t for t in self._running if not t.test()]
        moved |= len(running) != len(self._running)
        self._running = running
        self._sends = [req for req in self._sends if not req.Test()]
        return moved

    def _drain(self, tag: int, handle: Callable[[int, Any], Any]) -> bool:
        from mpi4py import MPI

        moved, status = False, MPI.Status()
        while True:
            message = self.ctl.improbe(source=MPI.ANY_SOURCE, tag=tag, status=status)
            if message is None:
                return moved
            handle(status.Get_source(), message.recv())
            moved = True

    def _respond_all(self, _source: int, batch: List[Tuple[str, str, str, Any]]) -> None:
        for response in batch:
            self._respond(response)

    def _respond(self, response: Tuple[str, str, str, Any]) -> None:
        """Act on one response from the coordinator (every rank, in the coordinator's order)."""
        kind, name, status, payload = response
        entry = self._pending.pop((kind, name), None)
        if status == "error":
            if entry is not None:
                entry.fail(payload)
        elif kind in ("join", "object_gather", "object_bcast"):
            if entry is not None:
                entry.finish(payload)
            if kind == "join":  # every member is here: the unnamed counters restart together
                self._unnamed, self._epoch = 0, self._epoch + 1
        else:
            self._running.append(start(self.data, kind, entry, payload, self.rank))

    # --- the coordinator (rank 0 of the set) -------------------------------------------------
    def _arrive(self, rank: int, submission: Submission) -> None:
        if self._closing:
            return
        if submission.kind == "join":
            self._joined.append(rank)
            return
        self._arrived.setdefault(submission.key, {})[rank] = submission
        self._since.setdefault(submission.key, time.monotonic())

    def _match(self) -> bool:
        """Respond to every operation all ranks submitted (joined ranks count), in order of
        first arrival; then to ``join`` once every rank joined."""
        responses = []
        for key, subs in list(self._arrived.items()):
            if all(r in subs or r in self._joined for r in range(self.size)):
                del self._arrived[key]
                self._since.pop(key, None)
                responses.append(self._response(key, subs))
        if len(self._joined) == self.size:
            responses.append(("join", "join", "ok", self.hvd_ranks[self._joined[-1]]))
            self._joined = []
        self._warn_stalled()
        if not responses:
            return False
        for rank in range(1, self.size):
            self._sends.append(self.ctl.isend(responses, dest=rank, tag=_RESPONSE))
        for response in responses:
            self._respond(response)
        return True

    def _response(self, key: Key, subs: Dict[int, Submission]):
        kind, name = key
        ranks = sorted(subs)
        refused = [r for r in ranks if subs[r].error is not None]
        if refused:
            r = refused[0]
            return kind, name, "error", f"{kind} {name!r} failed on rank {self.hvd_ranks[r]}: {subs[r].error}"
        first = subs[ranks[0]]
        for r in ranks[1:]:
            diff = _difference(subs[r].match, first.match)
            if diff is not None:
                label, mine, theirs = diff
                return kind, name, "error", (
                    f"{kind} {name!r}: rank {self.hvd_ranks[r]} passed {label}{mine} but rank "
                    f"{self.hvd_ranks[ranks[0]]} passed {label}{theirs}; every rank must pass the same")
        joined = [r for r in range(self.size) if r not in subs]
        if joined and kind not in ("allreduce", "barrier"):
            return kind, name, "error", (
                f"{kind} {name!r} is not supported with join(): rank(s) "
                f"{[self.hvd_ranks[r] for r in joined]} joined; only allreduce, barrier and the "
                "DistributedOptimizer's step run beside joined ranks")
        extras = [subs[r].extra if r in subs else None for r in range(self.size)]
        if kind == "object_bcast":
            return kind, name, "ok", extras[dict(first.match)["root"]]
        if kind == "object_gather":
            return kind, name, "ok", extras
        return kind, name, "ok", {"match": dict(first.match), "extras": extras, "joined": joined}

    def _warn_stalled(self) -> None:
        """Horovod's stall inspector: name the ranks an operation waits for, once."""
        now = time.monotonic()
        for key, since in list(self._since.items()):
            if self._stall_check > 0 and now - since > self._stall_check:
                missing = [self.hvd_ranks[r] for r in range(self.size)
                           if r not in self._arrived[key] and r not in self._joined]
                logger.warning("hsgd.horovod: %s %r has waited %.0f s for rank(s) %s; every rank must submit "
                               "it (check the names, and that no rank skipped it)", key[0], key[1], now - since,
                               missing)
                self._since[key] = float("inf")

    # --- life cycle ---------------------------------------------------------------------------
    def free(self) -> None:
        """Fail what is in flight here and free the communicators (collective over the set).

        Nothing new is matched from here on; the members keep draining messages and finishing
        started collectives until each has nothing outstanding and all passed a non-blocking
        barrier, so no message or collective is left on a freed communicator."""
        for entry in self._pending.values():
            entry.fail("hvd.shutdown() or hvd.remove_process_set() ran before it finished")
        self._pending.clear()
        self._closing, self.tokens = True, []
        barrier, backoff = None, Backoff()
        while True:
            moved = self.progress()
            if not self._sends and not self._running:
                if barrier is None:
                    barrier = self.ctl.Ibarrier()  # entered once this member has nothing outstanding
                elif barrier.Test():
                    break
            if not moved:
                backoff.idle()
        self.ctl.Free()
        self.data.Free()


def _difference(mine, theirs) -> Optional[Tuple[str, str, str]]:
    """The first field of two ``match`` descriptions that differs: (label, mine, theirs)."""
    for (field, a), (_, b) in zip(mine, theirs):
        if a == b:
            continue
        if field == "tensors" and len(a) == len(b):
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            return (f"as tensor {i} " if len(a) > 1 else ""), _show(a[i]), _show(b[i])
        return f"{field} ", _show(a), _show(b)
    if len(mine) != len(theirs):
        return "", _show(mine), _show(theirs)
    return None


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], tuple):
        shape, dtype, device = value
        return f"a {dtype} tensor of shape {list(shape)} on {device}"
    return repr(value)
