"""Argument checks shared by every public entry point: one integer rule, one choice rule,
and the per-rank batch shares of load balancing.

Each raises :class:`~hsgd.errors.InputValueError` naming the argument, the
value and what to pass instead, so that the messages read the same across
the library (``HierarchicalSGD``, the loader, the data tools, the trainer).
"""

from __future__ import annotations

import numbers
from typing import Iterable, cast

from ..errors import InputValueError

__all__ = ["check_int", "check_choice", "check_shares"]


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` if it is an integer (Python or numpy, not a bool) >= ``minimum``; else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InputValueError(f"Invalid {name}: {value!r}; use an integer >= {minimum}")
    return cast(int, value)  # a numpy integer passes unchanged, and behaves as an int


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``; else raise, listing them."""
    choices = list(choices)
    if value not in choices:
        raise InputValueError(f"Invalid {name}: {value!r}; choose one of {choices}")
    return value


def check_shares(shares, world_size: int) -> None:
    """Per-rank batch sizes: one positive integer per rank."""
    if isinstance(shares, (str, bytes)) or len(shares) != world_size or \
            any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1 for b in shares):
        raise InputValueError(f"Invalid batch shares {list(shares)!r}: give one positive integer "
                              f"per rank ({world_size} ranks)")
