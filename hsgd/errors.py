"""The errors hsgd's own checks raise: the caller gave a bad value, type, file or setting.

Every check that rejects user input raises an :class:`InputError`, which is also the
built-in exception a caller would expect (:class:`InputValueError` is a ``ValueError``,
and so on). In a multi-rank program an :class:`InputError` is *expected*: hsgd agrees on
it over the ranks (:mod:`hsgd._core.agree`), every rank raises the same one, and the
trainer prints it as one ``error:`` line and exits with status 2. Any other exception
is a bug: it keeps its traceback and the job is aborted, since it may have happened on
one rank only. Example::

    >>> try:
    ...     hsgd.LARS(model.parameters(), lr=-1)
    ... except hsgd.InputError as exc:
    ...     print(exc)
    Invalid learning rate: -1
"""

from __future__ import annotations

__all__ = ["InputError", "InputValueError", "InputTypeError", "InputFileNotFoundError",
           "InputPermissionError", "BY_NAME"]


class InputError(Exception):
    """Base class: raised by hsgd's own checks of arguments, files and settings."""


class InputValueError(InputError, ValueError):
    """A value out of range, a bad choice, a malformed file or data set."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (a non-optimizer, an unsupported dtype)."""


class InputFileNotFoundError(InputError, FileNotFoundError):
    """A file or directory the caller named does not exist."""


class InputPermissionError(InputError, PermissionError):
    """A file or directory the caller named cannot be read or written."""


# For re-raising a rank's error on every rank by name (hsgd._core.agree).
BY_NAME = {cls.__name__: cls for cls in (InputValueError, InputTypeError,
                                         InputFileNotFoundError, InputPermissionError)}
