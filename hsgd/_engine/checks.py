"""Argument checks shared by every public entry point: one integer rule, one choice rule.

Each raises :class:`~hsgd.errors.InputValueError` naming the argument, the
value and what to pass instead, so that the messages read the same across
the library (``HierarchicalSGD``, the loader, the data tools, the trainer).
"""

from __future__ import annotations

import numbers
from typing import Iterable

from ..errors import InputValueError

__all__ = ["check_int", "check_choice"]


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` if it is an integer (Python or numpy, not a bool) >= ``minimum``; else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InputValueError(f"Invalid {name}: {value!r}; use an integer >= {minimum}")
    return value


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``; else raise, listing them."""
    choices = list(choices)
    if value not in choices:
        raise InputValueError(f"Invalid {name}: {value!r}; choose one of {choices}")
    return value
