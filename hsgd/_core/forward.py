"""A property that lives on another object: ``forwarded("engine.on_phase")``.

For the settings a wrapper hands to what it wraps (a mode's ``on_phase`` is its
engine's, an engine's goes to its averagers): read from the first path, written
to every path. A dotted path runs from ``self``; a path through an attribute that
is ``None`` (a part not built) is skipped when written.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

__all__ = ["forwarded"]


def _owner(obj: Any, path: str) -> Tuple[Optional[object], str]:
    *parts, name = path.split(".")
    for part in parts:
        obj = getattr(obj, part)
        if obj is None:
            return None, name
    return obj, name


def forwarded(*paths: str, doc: str = "") -> property:
    """A property read from ``self.<paths[0]>`` and written to ``self.<path>`` for every path."""
    # Any: the helper forwards whatever the attribute at the path holds
    def get(self: Any) -> Any:
        owner, name = _owner(self, paths[0])
        return None if owner is None else getattr(owner, name)

    def set_(self: Any, value: Any) -> None:
        for path in paths:
            owner, name = _owner(self, path)
            if owner is not None:
                setattr(owner, name, value)
    return property(get, set_, doc=doc)
