"""``--model package.module:factory``: your own model in the trainer.

Every rank imports ``package.module`` (from ``sys.path``: the working directory,
``PYTHONPATH``, installed packages), looks up ``factory`` (a dotted path such as
``Models.small`` works too) and calls it once, after ``torch.manual_seed(--seed)``, as
``factory(sample_shape=(...), num_classes=N)`` (:func:`build_from_factory`). It
returns a ``torch.nn.Module`` with trainable parameters.

Whatever goes wrong (no colon, a module that cannot be imported, a missing or
uncallable attribute, a factory that raises or returns something else than a module
with trainable parameters) raises an :class:`~hsgd.errors.InputValueError` saying what
to change; the trainer agrees on it over the ranks and prints it once.
"""

from __future__ import annotations

import importlib
import traceback
from typing import Optional, Sequence

from torch import nn

from ..errors import InputValueError

__all__ = ["is_factory", "spec_problem", "load_factory", "build_from_factory"]

_FORM = "package.module:factory, e.g. mypkg.models:build"


def is_factory(name: str) -> bool:
    """Whether ``--model name`` names a factory rather than a built-in model."""
    return ":" in name


def spec_problem(spec: str) -> Optional[str]:
    """What is wrong with the form of ``spec`` (checked before anything is imported), or None."""
    module, colon, attr = spec.partition(":")
    if not colon:
        return f"--model {spec!r} names no factory: give your own model as {_FORM}"
    if not all(name.isidentifier() for name in module.split(".") + attr.split(".")):
        return f"--model {spec!r}: give your own model as {_FORM} (dotted Python names around one colon)"
    return None


def _where(exc: BaseException) -> str:
    """`` (at FILE:LINE)``: where ``exc`` was raised (for a syntax error: the bad line)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _import(module: str, spec: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise InputValueError(f"--model {spec}: there is no module {exc.name!r} to import; put the "
                                  f"directory that holds it on PYTHONPATH (on every rank) or install it, "
                                  f"or fix the name") from None
        raise InputValueError(f"--model {spec}: importing {module!r} failed: {exc}{_where(exc)}; install "
                              f"what it imports or fix the import") from None
    except Exception as exc:  # noqa: BLE001 - the user's module: say where it failed, once
        raise InputValueError(f"--model {spec}: importing {module!r} raised {type(exc).__name__}: "
                              f"{exc}{_where(exc)}; fix the module") from None


def load_factory(spec: str):
    """Import the callable that ``spec`` (``package.module:factory``) names."""
    problem = spec_problem(spec)
    if problem:
        raise InputValueError(problem)
    module_name, _, attr = spec.partition(":")
    found = _import(module_name, spec)
    for part in attr.split("."):
        if not hasattr(found, part):
            public = sorted(n for n in dir(found) if not n.startswith("_") and callable(getattr(found, n, None)))
            raise InputValueError(f"--model {spec}: {getattr(found, '__file__', None) or found!r} has no "
                                  f"attribute {part!r}; its callables: {', '.join(public) or 'none'}. "
                                  f"Name one of them after the colon")
        found = getattr(found, part)
    if not callable(found):
        raise InputValueError(f"--model {spec} names a {type(found).__name__}, which is not callable; name a "
                              f"function or class that returns a torch.nn.Module")
    return found


def build_from_factory(spec: str, sample_shape: Sequence[int], num_classes: int) -> nn.Module:
    """``factory(sample_shape=..., num_classes=...)`` checked: a module with trainable parameters.

    ``sample_shape``: one sample's shape as stored (the x data set's shape without its
    first axis), a tuple of ints. ``num_classes``: for classification the number of
    classes (1 + the largest training label); for token data the vocabulary size (256).
    The data says which task the model runs (:mod:`hsgd._trainer.tasks`): a file written
    by ``python -m hsgd.data text`` (``kind="tokens"``) is language modelling, the model
    mapping ``(B, T)`` int64 tokens to ``(B, T, num_classes)`` logits; any other file is
    classification, ``(B, *sample_shape)`` float32 to ``(B, num_classes)`` logits."""
    factory = load_factory(spec)
    call = f"{spec.partition(':')[2]}(sample_shape={tuple(sample_shape)}, num_classes={num_classes})"
    try:
        model = factory(sample_shape=tuple(int(s) for s in sample_shape), num_classes=int(num_classes))
    except Exception as exc:  # noqa: BLE001 - the user's factory: say where it failed, once
        raise InputValueError(f"--model {spec}: {call} raised {type(exc).__name__}: {exc}{_where(exc)}; "
                              f"fix the factory (it is called with these keyword arguments)") from None
    if not isinstance(model, nn.Module):
        raise InputValueError(f"--model {spec}: {call} returned a {type(model).__name__}, not a "
                              f"torch.nn.Module; return the model")
    if not any(p.requires_grad for p in model.parameters()):
        raise InputValueError(f"--model {spec}: the model from {call} has no trainable parameters "
                              f"(none with requires_grad); there is nothing to train")
    return model
