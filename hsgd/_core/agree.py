"""Collective error agreement: every rank raises, or none does.

In a multi-rank program a check that fails on one rank only and raises there
leaves the other ranks waiting in the next collective: the job hangs. Every
check whose inputs may differ between ranks goes through :func:`agree`, which
gathers each rank's verdict and raises the same exception on every rank.

Only :class:`~hsgd.errors.InputError` (a bad value from the user, found by
one of hsgd's checks) is agreed on. Any other exception is a bug: it is not
caught here, keeps its traceback, and the entry point aborts the job.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from ..errors import BY_NAME, InputError, InputValueError

__all__ = ["agree", "attempt", "check_all", "on_root", "collective_error"]


def agree(comm, error: Optional[InputError]) -> None:
    """Raise on every rank of ``comm`` if ``error`` is set on any rank.

    ``error`` is this rank's verdict: ``None`` when its local check passed,
    else the :class:`~hsgd.errors.InputError` the check raised.
    The raised exception has the type and message of the lowest failing
    rank, so every rank reports the same thing. Collective: every rank of
    ``comm`` must call it.
    """
    mine = None if error is None else (type(error).__name__, str(error))
    verdicts = comm.allgather(mine)
    for verdict in verdicts:
        if verdict is not None:
            raise collective_error(BY_NAME.get(verdict[0], InputValueError), verdict[1])


def collective_error(cls, message: str) -> Exception:
    """An exception marked as raised on every rank (``exc.hsgd_agreed``).

    Entry points exit cleanly on a marked exception (every rank has it) and
    abort the MPI job on an unmarked one (it may be on this rank alone).
    """
    exc = cls(message)
    exc.hsgd_agreed = True
    return exc


def attempt(func, *args, **kwargs) -> Tuple[Any, Optional[InputError]]:
    """``(func(*args, **kwargs), None)``, or ``(None, error)`` if it raised an
    :class:`~hsgd.errors.InputError`: this rank's verdict, for :func:`agree` or a caller's own
    agreement (which also compares arguments across ranks, or frees what succeeded here).
    Local; any other exception propagates."""
    try:
        return func(*args, **kwargs), None
    except InputError as exc:
        return None, exc


def check_all(comm, func, *args, **kwargs):
    """Run ``func(*args, **kwargs)`` on every rank and :func:`agree` on the outcome.

    Returns ``func``'s result when it succeeded on every rank. An exception
    other than :class:`~hsgd.errors.InputError` propagates on this rank only.
    """
    result, error = attempt(func, *args, **kwargs)
    agree(comm, error)
    return result


def on_root(comm, func, *args, root: int = 0, **kwargs):
    """Run ``func`` on ``root`` only and broadcast its result to every rank.

    If it raises there, every rank raises the same exception. Collective.
    """
    result, error = attempt(func, *args, **kwargs) if comm.Get_rank() == root else (None, None)
    agree(comm, error)
    return comm.bcast(result, root=root)
