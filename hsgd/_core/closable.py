"""The life cycle that hsgd's objects over MPI resources share: ``close()`` once, then refuse.

A subclass implements :meth:`Closable._close` (free what it holds; collective where the
resource is) and calls :meth:`Closable._opened` once it holds everything. :meth:`close`
runs ``_close`` at most once, and not at all for an object whose construction failed
before ``_opened``; ``with`` closes on the way out, whatever happened inside.
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["Closable"]

_Self = TypeVar("_Self", bound="Closable")


class Closable:
    """``close()`` (idempotent), ``closed``, and the context manager."""

    _closed: bool = True  # until _opened(): a half-built object has nothing to close

    def _opened(self) -> None:
        """Mark the object as holding its resources: :meth:`close` will free them."""
        self._closed = False

    def _close(self) -> None:
        """Free the resources (called once, by :meth:`close`)."""

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or construction never finished): the object holds nothing."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; build a new one")

    def close(self) -> None:
        """Free what this object holds; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._close()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
