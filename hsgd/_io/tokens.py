"""Byte-level token data for language modelling: a text corpus cut into blocks.

A token is a byte (vocabulary 256). The corpus is the files' bytes concatenated in
the order given (for the default corpus: the running Python's standard-library
sources, :func:`stdlib_files`), cut after ``max_bytes``. With ``B`` the block size and
``L`` the corpus length there are ``N = (L - 1) // B`` blocks; block ``i`` is ``x =
corpus[i*B : (i+1)*B]`` and its next-token targets ``y = corpus[i*B + 1 : (i+1)*B + 1]``.
A seeded random choice of ``round(val_fraction * N)`` whole blocks (at least one) is the
validation split. Training blocks are written in a seeded random order (the loader
shuffles within windows, so the file should not be sorted by source file), validation
blocks in corpus order. The file's layout: :func:`write_tokens`.
"""

from __future__ import annotations

import hashlib
import numbers
import os
import platform
import sysconfig
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import h5py
import numpy as np

from ..errors import InputFileNotFoundError, InputValueError
from .h5write import write_pairs

__all__ = ["stdlib_files", "read_corpus", "token_blocks", "split_blocks", "write_tokens",
           "write_stdlib_tokens", "VOCAB_SIZE", "TOKENS_KIND"]

VOCAB_SIZE = 256
TOKENS_KIND = "tokens"  # the file attribute ``kind`` of token data
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _check_positive(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputValueError(f"{flag} must be a positive integer, got {value!r}")


def stdlib_files() -> Tuple[Path, List[str]]:
    """The running Python's standard library: its directory and every ``*.py`` file below it,
    as sorted POSIX paths relative to it (``site-packages`` left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirs, names in os.walk(root):  # symbolic links to directories not followed
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        rel = Path(directory).relative_to(root)
        found += [(rel / name).as_posix() for name in names
                  if name.endswith(".py") and os.path.isfile(os.path.join(directory, name))]
    return root, sorted(found)


def read_corpus(files: Sequence[str], root=None, max_bytes: Optional[int] = None):
    """The files' bytes concatenated, at most ``max_bytes``; returns ``(uint8 array, files
    read, sha256 hex digest)``. ``files`` are relative to ``root`` when it is given."""
    if max_bytes is not None:
        _check_positive("--max-bytes", max_bytes)
    parts, used, total, digest = [], [], 0, hashlib.sha256()
    for name in files:
        if max_bytes is not None and total >= max_bytes:
            break
        path = Path(root, name) if root is not None else Path(name)
        if not path.exists():
            raise InputFileNotFoundError(f"text file not found: '{path}'; check the path")
        if not path.is_file():
            raise InputValueError(f"'{path}' is not a regular file; pass text files (a shell glob "
                                  f"such as dir/*.txt expands a directory)")
        data = path.read_bytes()
        if max_bytes is not None:
            data = data[:max_bytes - total]
        parts.append(data)
        used.append(str(name))
        total += len(data)
        digest.update(data)
    return np.frombuffer(b"".join(parts), dtype=np.uint8), used, digest.hexdigest()


def token_blocks(corpus: np.ndarray, block_size: int):
    """``(x, y)``: ``(N, block_size)`` views of ``corpus``, y the bytes after x's."""
    _check_positive("--block-size", block_size)
    n = (len(corpus) - 1) // block_size if len(corpus) else 0
    if n < 2:
        raise InputValueError(f"the corpus has {len(corpus)} bytes, fewer than two blocks of "
                              f"{block_size} bytes plus one (one to train on, one to validate); "
                              f"use a smaller --block-size or more text (--max-bytes)")
    end = n * block_size
    return corpus[:end].reshape(n, block_size), corpus[1:end + 1].reshape(n, block_size)


def split_blocks(n: int, val_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(training rows in a seeded random order, validation rows in corpus order)`` of ``n``
    blocks: a seeded random choice of ``round(val_fraction * n)`` blocks (at least 1) validates."""
    if not 0.0 < val_fraction < 1.0:
        raise InputValueError(f"--val-fraction must be between 0 and 1 (e.g. 0.1), got {val_fraction}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise InputValueError(f"--seed must be an integer >= 0, got {seed!r}")
    num_val = max(1, int(round(n * val_fraction)))
    if num_val >= n:
        raise InputValueError(f"--val-fraction {val_fraction} of {n} blocks leaves no training block; "
                              f"lower it or use more text")
    order = np.random.default_rng(seed).permutation(n)
    return order[num_val:], np.sort(order[:num_val])


def write_tokens(path, files: Sequence[str], *, root=None, block_size: int = 256, val_fraction: float = 0.1,
                 seed: int = 0, max_bytes: Optional[int] = None, compress: bool = False,
                 source: str = "files") -> Path:
    """Write the token blocks of ``files`` (relative to ``root`` if given) to ``path``
    atomically. Layout, ``B`` the block size::

        x_train, y_train   (N_train, B) uint8     x_test, y_test   (N_val, B) uint8
        block_train        (N_train,) int64       block_test       (N_val,) int64
        files              (F,) str: the files read, relative to attribute ``root`` if set

    ``block_*[k]`` is row k's block index in the corpus: ``x_train[k] ==
    corpus[B*block_train[k] : B*block_train[k] + B]``. Attributes: ``kind="tokens"``,
    ``vocab_size=256``, ``block_size``, ``val_fraction``, ``seed``, ``source``
    (``"stdlib"`` or ``"files"``), ``root``, ``num_files``, ``corpus_bytes`` (bytes read,
    after ``max_bytes``), ``sha256`` (of those bytes), and for the standard library
    ``python_version``."""
    if not files:
        raise InputValueError("no text files to read; pass FILES or leave them out for the "
                              "standard library's sources")
    corpus, used, sha256 = read_corpus(files, root, max_bytes)
    x, y = token_blocks(corpus, block_size)
    train, val = split_blocks(len(x), val_fraction, seed)
    attrs = {"kind": TOKENS_KIND, "vocab_size": VOCAB_SIZE, "block_size": int(block_size),
             "val_fraction": float(val_fraction), "seed": int(seed), "source": source,
             "root": "" if root is None else str(root), "num_files": len(used),
             "corpus_bytes": len(corpus), "sha256": sha256}
    if source == "stdlib":
        attrs["python_version"] = platform.python_version()
    extra = {"block_train": train.astype(np.int64), "block_test": val.astype(np.int64),
             "files": np.array(used, dtype=h5py.string_dtype())}
    pairs = [("x_train", "y_train", x, y, train), ("x_test", "y_test", x, y, val)]
    return write_pairs(path, pairs, compress=compress, attrs=attrs, extra=extra)


def write_stdlib_tokens(path, **kwargs) -> Path:
    """:func:`write_tokens` of the running Python's standard-library sources."""
    root, files = stdlib_files()
    return write_tokens(path, files, root=root, source="stdlib", **kwargs)
