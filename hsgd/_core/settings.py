"""A synchronization mode's settings, each declared once: one frozen dataclass per mode.

Every field is a :func:`setting`: its default, its help text, its check and
the trainer flag it is set by, in one place (as in torchtitan's job config,
or torch's ``PowerSGDState``, which holds each hyperparameter once). From
these the library takes its keyword arguments and their checks
(:meth:`Settings.validate`), and the trainer its flags, their ``--help`` and
their checks (:mod:`hsgd._trainer.mode_flags`). A check that spans fields lives in
the dataclass that owns them, in :meth:`Settings._check_together`.

Messages name a field through :class:`Names`: as a keyword argument
(``intra_period=0``) for the library, as a flag (``--intra-period 0``) for
the trainer; the same check says what to change in either.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Tuple, Type

from ..errors import InputTypeError, InputValueError
from .checks import check_choice, check_int

__all__ = ["Settings", "setting", "flag_of", "Names", "Integer", "Real", "Choice", "Boolean", "Check", "fields_of"]

#: ``check(name, value)``: raise an :class:`~hsgd.errors.InputError` naming ``name`` if ``value`` is bad.
Check = Callable[[str, Any], None]
_SAME = object()  # setting(flag=...)'s default: the flag is the field's name


def setting(default: Any, help: str, check: Optional[Check] = None, *, flag: Optional[object] = _SAME,
            shared: bool = False) -> Any:
    """A field of a :class:`Settings` dataclass.

    Args:
        default: the keyword argument's default, and the flag's.
        help: what it does: the trainer's ``--help`` for its flag, and its entry in the
            mode's documentation.
        check: ``check(name, value)`` (:class:`Integer`, :class:`Real`, :class:`Choice`,
            :class:`Boolean`, or a function) that raises an :class:`~hsgd.errors.InputError`.
        flag: the trainer flag that sets it, as a field name (``"gossip_theta"`` for
            ``--gossip-theta``); the field's own name by default; ``None``: no flag (a callable,
            or what the trainer sets itself).
        shared: the flag is the trainer's own (``--seed``), declared with the trainer's
            options; the mode only reads it.
    """
    return field(default=default, metadata={"help": help, "check": check, "flag": flag, "shared": shared})


def flag_of(f: dataclasses.Field) -> Optional[str]:
    """The trainer flag (as a field name) that sets field ``f``; ``None`` if none does."""
    flag = f.metadata.get("flag")
    return f.name if flag is _SAME else flag


class Names:
    """How a message names a field and a value of it.

    ``Names()``: as the keyword argument (``intra_period``, ``intra_period=0``);
    ``Names(flags)``, ``flags`` mapping a field to its flag's name: as the trainer's flag
    (``--intra-period``, ``--intra-period 0``, ``--no-outer-nesterov``).
    """

    def __init__(self, flags: Optional[Dict[str, str]] = None) -> None:
        self.flags = flags

    def __call__(self, name: str) -> str:
        if self.flags is None:
            return name
        return "--" + self.flags.get(name, name).replace("_", "-")

    def given(self, name: str, value: Any) -> str:
        """The setting ``name`` given as ``value``, as the caller would write it."""
        if self.flags is None:
            return f"{name}={value!r}"
        flag = self(name)
        if isinstance(value, bool):
            return flag if value else "--no-" + flag[2:]
        return f"{flag} {value}"


@dataclass(frozen=True)
class Integer:
    """An integer (Python or numpy, not a bool) ``>= minimum``."""

    minimum: int = 1

    def __call__(self, name: str, value: Any) -> None:
        check_int(name, value, self.minimum)


@dataclass(frozen=True)
class Real:
    """A real number (not a bool) in a range; NaN is never in one.

    ``low`` / ``high``: bounds (``None``: none), ``open_low`` / ``open_high``: excluded;
    ``finite``: infinity refused; ``hint``: what the message adds, e.g. ``"(DiLoCo: 0.7)"``.
    """

    low: Optional[float] = None
    high: Optional[float] = None
    open_low: bool = False
    open_high: bool = False
    finite: bool = False
    hint: str = ""

    def range(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"
        if self.low is not None:
            return f"{'>' if self.open_low else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.open_high else '<='} {self.high:g}"
        return "that is a real number"

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        x = float(value)
        if math.isnan(x) or (self.finite and math.isinf(x)):
            return False
        if self.low is not None and not (x > self.low if self.open_low else x >= self.low):
            return False
        return self.high is None or (x < self.high if self.open_high else x <= self.high)

    def __call__(self, name: str, value: Any) -> None:
        if not self.holds(value):
            hint = f" {self.hint}" if self.hint else ""
            raise InputValueError(f"Invalid {name}: {value!r}; use a{' finite' if self.finite else ''} number "
                                  f"{self.range()}{hint}")


@dataclass(frozen=True)
class Choice:
    """One of ``options``, written once (a ``Literal``'s arguments, a strategy table's keys)."""

    options: Tuple[Any, ...]
    also: Tuple[Any, ...] = ()  # accepted besides, not offered (``None`` for ``"none"``)

    def __call__(self, name: str, value: Any) -> None:
        if value in self.also:
            return
        check_choice(name, value, self.options)


@dataclass(frozen=True)
class Boolean:
    """``True`` or ``False``."""

    def __call__(self, name: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise InputTypeError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class Settings:
    """The base of a mode's settings: a frozen dataclass of :func:`setting` fields.

    Subclasses add fields (a mode's settings class extends its family's, so a setting that
    several modes share is declared once) and checks that span fields
    (:meth:`_check_together`).
    """

    #: fields the trainer's ``--sync`` of this mode does not take (their flags belong to
    #: another mode, which extends this one's settings).
    flags_off: ClassVar[Tuple[str, ...]] = ()

    def validate(self, names: Optional[Names] = None) -> None:
        """Raise an :class:`~hsgd.errors.InputError` for the first bad setting, named by ``names``
        (default: as keyword arguments)."""
        names = names or Names()
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                check(names(f.name), getattr(self, f.name))
        self._check_together(names)

    def _check_together(self, names: Names) -> None:
        """Checks across fields (each field's own passed)."""

    def agreed(self) -> List[Tuple[str, str]]:
        """What the ranks compare: each field's ``repr``, a callable's by its qualified name."""
        return [(f.name, _comparable(getattr(self, f.name))) for f in dataclasses.fields(self)]

    @classmethod
    def build(cls, given: Dict[str, Any], owner: str) -> Settings:
        """``cls(**given)``, an unknown keyword refused naming the settings there are."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [name for name in given if name not in known]
        if unknown:
            raise InputTypeError(f"{owner} has no setting {unknown[0]!r}; its settings: {', '.join(known) or 'none'}")
        return cls(**given)

    @classmethod
    def describe(cls) -> str:
        """The fields as a reST list (their help texts): the settings class's documentation."""
        lines = [f"- ``{f.name}`` (default ``{f.default!r}``): {f.metadata['help']}"
                 for f in dataclasses.fields(cls)]
        return "\n".join(lines)


def _comparable(value: Any) -> str:
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '?')}"
    return repr(value)


def fields_of(classes: Iterable[Type[Settings]]) -> List[dataclasses.Field]:
    """The fields of ``classes`` in order of first declaration, each once."""
    seen: Dict[str, dataclasses.Field] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            seen.setdefault(f.name, f)
    return list(seen.values())
