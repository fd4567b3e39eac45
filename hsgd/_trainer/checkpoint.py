"""Checkpoints: written atomically by rank 0, loaded safely, shared with all ranks.

A checkpoint is one ``torch.save`` file ``ckpt-<step>.pt`` holding a dict of tensors and
plain values (model, optimizer, scheduler, loader position, RNG states of every rank,
step, epoch, config). Invariants: a crash, even SIGKILL in the middle of a write, never
leaves a torn checkpoint under a checkpoint's name (:func:`save_checkpoint`); a damaged
file fails to load, and :func:`newest_loadable` then falls back to the newest older one
that loads; only the newest ``keep`` checkpoints stay.

Example::

    >>> path = save_checkpoint("ckpts", {"model": model.state_dict(), "step": 10}, step=10)
    >>> state = load_checkpoint(latest_checkpoint("ckpts"))
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ..errors import InputError, InputFileNotFoundError, InputPermissionError, InputValueError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "newest_loadable", "check_writable",
           "DEFAULT_KEEP"]

DEFAULT_KEEP = 3

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def check_writable(directory) -> None:
    """Create ``directory`` if needed and prove a file can be written there.

    Raises ``PermissionError``/``OSError`` with a message naming the directory.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as exc:
        raise InputPermissionError(f"cannot write checkpoints to {directory}: {exc.strerror or exc}; "
                                   "pass a writable --checkpoint-dir") from None


def save_checkpoint(directory, state: dict, step: int, keep: int = DEFAULT_KEEP) -> Path:
    """Write ``state`` as ``directory/ckpt-<step>.pt`` atomically; keep the newest ``keep``.

    Checkpoints of later steps than ``step`` belong to an abandoned run (this
    one resumed from an earlier checkpoint) and are removed, so that
    :func:`latest_checkpoint` always finds this run's newest. Writing goes to a temporary
    file in the same directory, then ``os.replace``; the next save removes a partial
    temporary file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for partial in directory.glob(".ckpt-*.tmp"):  # a writer killed mid-write (one writer: rank 0)
        partial.unlink(missing_ok=True)
    final = directory / f"ckpt-{step:09d}.pt"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".ckpt-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)  # the rename itself survives a crash
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    ours = [p for p in _checkpoints(directory) if _step(p) <= step]
    for old in ours[:-keep] + [p for p in _checkpoints(directory) if _step(p) > step]:
        old.unlink(missing_ok=True)
    return final


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step(path: Path) -> int:
    match = _NAME.match(path.name)
    assert match is not None  # _checkpoints() lists matching names only
    return int(match.group(1))


def _checkpoints(directory: Path):
    """``ckpt-<step>.pt`` files in ``directory``, oldest step first."""
    return sorted((p for p in directory.glob("ckpt-*.pt") if _NAME.match(p.name)), key=_step)


def latest_checkpoint(directory) -> Optional[Path]:
    """The newest ``ckpt-*.pt`` in ``directory``, or ``None``."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = _checkpoints(directory)
    return found[-1] if found else None


def newest_loadable(directory) -> Tuple[Optional[Path], Optional[dict], List[str]]:
    """The newest checkpoint in ``directory`` that loads: ``(path, state, problems)``, where
    ``problems`` describes each newer one that did not (damaged). ``(None, None, [])`` if the
    directory holds none; an ``InputValueError`` listing them all if none loads."""
    directory = Path(directory)
    found = _checkpoints(directory) if directory.is_dir() else []
    problems: List[str] = []
    for path in reversed(found):
        try:
            return path, load_checkpoint(path), problems
        except InputError as exc:
            problems.append(str(exc))
    if problems:
        raise InputValueError(f"no checkpoint in {directory} can be loaded: " + "; ".join(problems))
    return None, None, []


def load_checkpoint(path) -> dict:
    """Load a checkpoint onto the CPU with ``weights_only=True``, which refuses arbitrary
    pickled objects and reads every tensor, so a truncated or overwritten file fails here.

    Raises ``FileNotFoundError`` (:class:`~hsgd.errors.InputFileNotFoundError`) when there is no
    such file, and ``ValueError`` saying what is wrong when the file is not a checkpoint written
    by :func:`save_checkpoint`.
    """
    path = Path(path)
    if not path.is_file():
        raise InputFileNotFoundError(f"no checkpoint file {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not ours"
        raise InputValueError(f"{path} is not a readable hsgd checkpoint ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise InputValueError(f"{path} is not an hsgd checkpoint (no 'model'/'step' entries)")
    return state
