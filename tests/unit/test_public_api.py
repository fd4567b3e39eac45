"""The public API is typed and documented: every name in ``hsgd.__all__``.

A function needs a non-empty docstring, an annotation on every parameter (but
``self``/``cls``) and a return annotation. A class needs a docstring, and so do its
``__init__`` and every public method and property that hsgd code defines for it
(its own, or inherited from an hsgd base class; what it inherits from torch or the
standard library is not ours to document), each annotated like a function; a
property's getter needs a return annotation and its setter an annotated value.
Every offender is listed in the failure, not just the first.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator, List, Tuple

import hsgd

_NO_DOC_NEEDED = {"__init__"}  # the class docstring documents construction (Sphinx merges them)


def _missing_annotations(func: Any) -> List[str]:
    """What of ``func``'s signature is not annotated: parameter names, and ``return``."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return []
    missing = [p.name for i, p in enumerate(sig.parameters.values())
               if p.annotation is inspect.Parameter.empty and not (i == 0 and p.name in ("self", "cls"))]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def _has_doc(obj: Any) -> bool:
    return bool((getattr(obj, "__doc__", None) or "").strip())


def _members(cls: type) -> Iterator[Tuple[str, str, Any]]:
    """``(qualified name, name, raw attribute)`` for each public member (and ``__init__``) that
    an hsgd class in ``cls``'s MRO defines, the most derived definition only."""
    seen = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("hsgd"):
            continue
        for name, value in vars(base).items():
            if name in seen or (name.startswith("_") and name != "__init__"):
                continue
            seen.add(name)
            yield f"{cls.__module__}.{cls.__qualname__}.{name} (from {base.__qualname__})", name, value


def _check_function(qualname: str, func: Any, problems: List[str], *, doc: bool = True) -> None:
    missing = _missing_annotations(func)
    if missing:
        problems.append(f"{qualname}: not annotated: {', '.join(missing)}")
    if doc and not _has_doc(func):
        problems.append(f"{qualname}: no docstring")


def _check_class(qualname: str, cls: type, problems: List[str]) -> None:
    if not _has_doc(cls):
        problems.append(f"{qualname}: no docstring")
    for member, name, value in _members(cls):
        if isinstance(value, property):
            if not _has_doc(value):
                problems.append(f"{member}: no docstring")
            if value.fget is not None and _missing_annotations(value.fget):
                problems.append(f"{member}: getter not annotated: {', '.join(_missing_annotations(value.fget))}")
            if value.fset is not None and _missing_annotations(value.fset):
                problems.append(f"{member}: setter not annotated: {', '.join(_missing_annotations(value.fset))}")
        elif isinstance(value, (staticmethod, classmethod)):
            _check_function(member, value.__func__, problems)
        elif inspect.isfunction(value):
            _check_function(member, value, problems, doc=name not in _NO_DOC_NEEDED)
        # anything else (a class attribute, a constant) is data: documented in the class docstring


def _public_problems() -> List[str]:
    problems: List[str] = []
    for name in hsgd.__all__:
        if name == "__version__":
            continue
        obj = getattr(hsgd, name)
        qualname = f"hsgd.{name}"
        if inspect.isclass(obj):
            _check_class(qualname, obj, problems)
        elif callable(obj):
            _check_function(qualname, obj, problems)
        else:
            problems.append(f"{qualname}: neither a class nor a function ({type(obj).__name__})")
    return problems


def test_public_api_is_annotated_and_documented():
    problems = _public_problems()
    assert not problems, "public API without annotations or docstrings:\n  " + "\n  ".join(problems)


def test_errors_are_documented():
    from hsgd import errors

    for name in errors.__all__:
        assert _has_doc(getattr(errors, name)), f"hsgd.errors.{name}: no docstring"


def test_all_lists_every_export():
    # the lazy loader's table and __all__ agree, and every name resolves
    assert set(hsgd.__all__) == set(hsgd._EXPORTS) | {"__version__"}
    for name in hsgd._EXPORTS:
        assert getattr(hsgd, name) is not None
