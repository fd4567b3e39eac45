"""Report on a finished (or killed) run: a per-epoch table and PNG plots.

Reads the ``config.json`` and ``metrics.jsonl`` that
``python -m hsgd.train --run-dir DIR`` writes::

    python -m hsgd.report DIR [--out PLOT_DIR] [--no-plots]

Example::

    >>> run = load_run("runs/resnet50")
    >>> print(summary_table(run))
    >>> plot_run(run)  # runs/resnet50/plots/{loss,accuracy,time_breakdown}.png
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ._trainer.plots import as_number, comm_share, draw_accuracy, draw_loss, draw_time, new_figure, title
from .errors import InputFileNotFoundError, InputValueError

__all__ = ["Run", "load_run", "plot_run", "summary_table", "restart_line", "main"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
_HOW_TO = "produce one with `python -m hsgd.train --run-dir DIR`"


@dataclass
class Run:
    """A run read back by :func:`load_run`.

    ``steps`` and ``epochs`` are the raw ``"step"`` and ``"epoch"`` records,
    one per step / epoch number (the last one logged), sorted by that number;
    ``restarts``: the ``"restart"`` records of ``python -m hsgd.run``, in order.
    """

    config: dict
    steps: list = field(default_factory=list)
    epochs: list = field(default_factory=list)
    run_dir: Optional[Path] = None
    restarts: list = field(default_factory=list)


def load_run(run_dir) -> Run:
    """Read ``run_dir/config.json`` (optional) and ``run_dir/metrics.jsonl``.

    Of ``metrics.jsonl`` (one JSON object per line) only ``"step"`` records (``step``,
    ``loss``) and ``"epoch"`` records are read: ``epoch``, ``step``, ``train_loss``,
    ``train_acc``, ``test_loss``, ``test_acc`` (a fraction), ``samples_per_s``,
    ``seconds``, ``time`` (seconds per phase on rank 0), ``test_bpb`` (bits per byte of a
    language model, ``test_loss / ln 2``, shown when a run has it), ``intra_bytes`` /
    ``inter_bytes`` (bytes moved inside / across nodes by all ranks in the epoch). Other
    events and keys are ignored (a step record's ``ranks``: how many ranks its loss and
    samples/s cover, 1 in the modes whose ranks do not step together; an epoch record's
    ``rank_steps_per_s``: each rank's steps per second up to its last step). A resumed run
    appends to the same file, so the last record for a step or an epoch wins; lines that
    are not JSON (cut off by a killed run) are skipped with a warning. An epoch's
    communication share is ``(intra + inter) / (data + compute + intra + inter)`` of its
    ``time``. ``"restart"`` records (``python -m hsgd.run``: ``restart``, ``from_step``,
    ``lost_hosts``, ``lost_ranks``, ``hosts``, ``world_size``, ``seconds_lost``) are kept in order.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputFileNotFoundError(f"run directory {run_dir} not found: {_HOW_TO}")
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise InputFileNotFoundError(f"{metrics} not found: {_HOW_TO}")
    records = _read_jsonl(metrics)
    steps, epochs = _last_per(records, "step"), _last_per(records, "epoch")
    if not steps and not epochs:
        raise InputValueError(f"{metrics} has no step or epoch records: is the run "
                              "still starting, or was it killed before its first log?")
    restarts = [r for r in records if r.get("event") == "restart"]
    return Run(_read_config(run_dir / CONFIG_FILE), steps, epochs, run_dir, restarts)


def _read_jsonl(path: Path) -> list:
    """The JSON objects in ``path``, one per line, skipping undecodable lines."""
    records = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if line.strip():
                logger.warning("%s:%d is not JSON (cut off by a killed run?); skipped",
                               path, number)
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _last_per(records: list, event: str) -> list:
    """Records of ``event``, the last one for each ``record[event]`` number, sorted."""
    latest = {}
    for record in records:
        index = record.get(event)
        if record.get("event") == event and type(index) is int:  # bool is not an index
            latest[index] = record
    return [latest[index] for index in sorted(latest)]


def _read_config(path: Path) -> dict:
    """The run's config, or ``{}`` (with a warning) when the file is missing."""
    if not path.is_file():
        logger.warning("%s not found; reporting without the run's config", path)
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise InputValueError(f"{path} is not valid JSON ({error}): fix or delete it") from None
    if not isinstance(config, dict):
        raise InputValueError(f"{path} holds a {type(config).__name__}, not a JSON object")
    return config


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    """``value * scale`` formatted with ``spec``, or ``-`` when it is not a number."""
    number = as_number(value)
    return "-" if number is None else format(number * scale, spec)


def _has_bpb(run: Run) -> bool:
    """Whether the run modelled language: an epoch record with bits per byte."""
    return any(as_number(e.get("test_bpb")) is not None for e in run.epochs)


def summary_table(run: Run) -> str:
    """A markdown table with one row per epoch (with a ``test bpb`` column for a language
    model), then a best-accuracy (and best-bpb)/total-time line."""
    bpb = _has_bpb(run)
    header = ["epoch", "train loss", "test loss", "test acc %", *(["test bpb"] if bpb else []),
              "samples/s", "comm share %", "intra MB", "inter MB"]
    rows = [[str(e["epoch"]), _fmt(e.get("train_loss"), ".4f"),
             _fmt(e.get("test_loss"), ".4f"), _fmt(e.get("test_acc"), ".2f", 100.0),
             *([_fmt(e.get("test_bpb"), ".4f")] if bpb else []),
             _fmt(e.get("samples_per_s"), ",.0f"), _fmt(comm_share(e.get("time")), ".1f"),
             _fmt(e.get("intra_bytes"), ",.1f", 1e-6), _fmt(e.get("inter_bytes"), ",.1f", 1e-6)]
            for e in run.epochs]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines + ["", _final_line(run), *map(restart_line, run.restarts)])


def restart_line(record: dict) -> str:
    """One line for a ``restart`` record: ``restart 1 at step 130: lost h3 (ranks 4, 5); 4 ranks on
    h1, h2; 11.2 s lost``."""
    lost = ", ".join(record.get("lost_hosts") or []) or "no host"
    if record.get("startup_timed_out"):
        lost += f" (the job did not start in {record['startup_timed_out']:g} s)"
    ranks = record.get("lost_ranks") or []
    lost += f" (ranks {', '.join(map(str, ranks))})" if ranks else ""
    seconds = as_number(record.get("seconds_lost"))
    return (f"restart {record.get('restart', '?')} at step {record.get('from_step', '?')}: lost {lost}; "
            f"{record.get('world_size', '?')} ranks on {', '.join(record.get('hosts') or [])}; "
            f"{'-' if seconds is None else format(seconds, '.1f')} s lost")


def _final_line(run: Run) -> str:
    """``best test acc: ... (epoch N); total time: ... s over M epochs``, and for a language
    model ``best test bpb: ... (epoch N)`` (the lowest) after the accuracy."""
    scored = [(acc, e["epoch"]) for e in run.epochs
              if (acc := as_number(e.get("test_acc"))) is not None and not math.isnan(acc)]
    best = "-" if not scored else f"{100 * max(scored)[0]:.2f}% (epoch {max(scored)[1]})"
    bpbs = [(bpb, e["epoch"]) for e in run.epochs
            if (bpb := as_number(e.get("test_bpb"))) is not None and not math.isnan(bpb)]
    if bpbs:
        best += f"; best test bpb: {min(bpbs)[0]:.4f} (epoch {min(bpbs)[1]})"
    seconds = [s for s in (as_number(e.get("seconds")) for e in run.epochs) if s is not None]
    total = "-" if not seconds else f"{sum(seconds):.1f} s over {len(seconds)} epochs"
    return f"best test acc: {best}; total time: {total}"


def plot_run(run: Run, out_dir=None) -> list:
    """Write loss.png, accuracy.png and time_breakdown.png; return the paths written.

    ``out_dir`` defaults to ``run.run_dir / "plots"``. A plot whose data the
    run lacks is skipped with a log message. Draws on matplotlib's Agg canvas
    directly: no display needed, pyplot's global state left alone.
    """
    if out_dir is not None:
        out_dir = Path(out_dir)
    elif run.run_dir is not None:
        out_dir = Path(run.run_dir) / "plots"
    else:
        raise InputValueError("plot_run: pass out_dir, this Run has no run_dir")
    written = []
    for name, draw in (("loss.png", draw_loss), ("accuracy.png", draw_accuracy),
                       ("time_breakdown.png", draw_time)):
        fig = new_figure()
        ax = fig.add_subplot()
        if draw(ax, run):
            ax.set_title(title(run.config), fontsize=9, loc="right")
            out_dir.mkdir(parents=True, exist_ok=True)
            fig.savefig(out_dir / name, dpi=110)
            written.append(out_dir / name)
    return written


def main(argv=None) -> int:
    """CLI: print the summary table and the PNG paths; exit 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m hsgd.report",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="directory of hsgd.train --run-dir")
    parser.add_argument("--out", metavar="DIR", help="PNG directory (default: RUN_DIR/plots)")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    logging.basicConfig(format="hsgd.report: %(message)s")
    logger.setLevel(logging.INFO)
    try:
        run = load_run(args.run_dir)
        if title(run.config):
            print(title(run.config) + "\n")
        print(summary_table(run))
        paths = [] if args.no_plots else plot_run(run, args.out)
    except (OSError, ValueError, ImportError) as error:
        print(f"hsgd.report: error: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
