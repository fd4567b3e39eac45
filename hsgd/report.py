"""Report on a finished (or killed) run: a per-epoch table and PNG plots.

Reads the ``config.json`` and ``metrics.jsonl`` that
``python -m hsgd.train --run-dir DIR`` writes::

    python -m hsgd.report DIR [--out PLOT_DIR] [--no-plots]

Of ``metrics.jsonl`` (one JSON object per line) only ``"step"`` records
(``step``, ``loss``) and ``"epoch"`` records (``epoch``, ``step``,
``train_loss``, ``train_acc``, ``test_loss``, ``test_acc`` as a fraction,
``samples_per_s``, ``seconds``, ``time`` = seconds per phase on rank 0,
``intra_bytes`` / ``inter_bytes`` = bytes moved inside / across nodes by all
ranks in the epoch) are read; other events and keys are ignored. A resumed run appends to the same
file, so the last record for a step or an epoch wins. Lines that are not JSON
(cut off by a killed run) are skipped with a warning. An epoch's communication
share is ``(intra + inter) / (data + compute + intra + inter)`` of its ``time``.

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

from .errors import InputFileNotFoundError, InputValueError

__all__ = ["Run", "load_run", "plot_run", "summary_table", "main"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
_HOW_TO = "produce one with `python -m hsgd.train --run-dir DIR`"
_COMM, _WORK = ("intra", "inter"), ("data", "compute")
_PHASES = {"data": "data", "compute": "compute", "intra": "intra-node",
           "inter": "inter-node", "eval": "eval"}


@dataclass
class Run:
    """A run read back by :func:`load_run`.

    ``steps`` and ``epochs`` are the raw ``"step"`` and ``"epoch"`` records,
    one per step / epoch number (the last one logged), sorted by that number.
    """

    config: dict
    steps: list = field(default_factory=list)
    epochs: list = field(default_factory=list)
    run_dir: Optional[Path] = None


def load_run(run_dir) -> Run:
    """Read ``run_dir/config.json`` (optional) and ``run_dir/metrics.jsonl``."""
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
    return Run(_read_config(run_dir / CONFIG_FILE), steps, epochs, run_dir)


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


def _number(value) -> Optional[float]:
    """``value`` as a float when it is a JSON number, else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


def _comm_share(time) -> Optional[float]:
    """Percent of data + compute + intra + inter spent in intra + inter."""
    if not isinstance(time, dict):
        return None
    parts = {key: _number(time.get(key)) for key in _COMM + _WORK}
    if None in parts.values() or sum(parts.values()) <= 0:
        return None
    return 100.0 * sum(parts[key] for key in _COMM) / sum(parts.values())


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    """``value * scale`` formatted with ``spec``, or ``-`` when it is not a number."""
    number = _number(value)
    return "-" if number is None else format(number * scale, spec)


def summary_table(run: Run) -> str:
    """A markdown table with one row per epoch, then a best-accuracy/total-time line."""
    header = ["epoch", "train loss", "test loss", "test acc %", "samples/s", "comm share %",
              "intra MB", "inter MB"]
    rows = [[str(e["epoch"]), _fmt(e.get("train_loss"), ".4f"),
             _fmt(e.get("test_loss"), ".4f"), _fmt(e.get("test_acc"), ".2f", 100.0),
             _fmt(e.get("samples_per_s"), ",.0f"), _fmt(_comm_share(e.get("time")), ".1f"),
             _fmt(e.get("intra_bytes"), ",.1f", 1e-6), _fmt(e.get("inter_bytes"), ",.1f", 1e-6)]
            for e in run.epochs]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines + ["", _final_line(run)])


def _final_line(run: Run) -> str:
    """``best test acc: ... (epoch N); total time: ... s over M epochs``."""
    scored = [(acc, e["epoch"]) for e in run.epochs
              if (acc := _number(e.get("test_acc"))) is not None and not math.isnan(acc)]
    best = "-" if not scored else f"{100 * max(scored)[0]:.2f}% (epoch {max(scored)[1]})"
    seconds = [s for s in (_number(e.get("seconds")) for e in run.epochs) if s is not None]
    total = "-" if not seconds else f"{sum(seconds):.1f} s over {len(seconds)} epochs"
    return f"best test acc: {best}; total time: {total}"


def plot_run(run: Run, out_dir=None) -> list:
    """Write loss.png, accuracy.png and time_breakdown.png; return the paths written.

    ``out_dir`` defaults to ``run.run_dir / "plots"``. A plot whose data the
    run lacks is skipped with a log message. Draws on matplotlib's Agg canvas
    directly: no display needed, pyplot's global state left alone.
    """
    if out_dir is None and run.run_dir is None:
        raise InputValueError("plot_run: pass out_dir, this Run has no run_dir")
    out_dir = Path(out_dir) if out_dir is not None else Path(run.run_dir) / "plots"
    written = []
    for name, draw in (("loss.png", _draw_loss), ("accuracy.png", _draw_accuracy),
                       ("time_breakdown.png", _draw_time)):
        fig = _new_figure()
        ax = fig.add_subplot()
        if draw(ax, run):
            ax.set_title(_title(run.config), fontsize=9, loc="right")
            out_dir.mkdir(parents=True, exist_ok=True)
            fig.savefig(out_dir / name, dpi=110)
            written.append(out_dir / name)
    return written


def _new_figure():
    """A matplotlib Figure on an Agg canvas (no pyplot, no display)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib, "
                          "or pass --no-plots") from None
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _title(config: dict) -> str:
    """``model, optimizer, N ranks, batch B`` from whatever the config has."""
    parts = (("model", "{}"), ("optimizer", "{}"), ("world_size", "{} ranks"),
             ("batch_size", "batch {}"))
    return ", ".join(form.format(config[key]) for key, form in parts if key in config)


def _series(records: list, x_key: str, y_key: str, scale: float = 1.0):
    """(xs, ys) over the records where both keys hold numbers."""
    pairs = [(_number(r.get(x_key)), _number(r.get(y_key))) for r in records]
    pairs = [(x, y * scale) for x, y in pairs if x is not None and y is not None]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _plot(ax, series, style: str, **kwargs) -> None:
    """``ax.plot`` of an (xs, ys) series, unless it is empty."""
    if series[0]:
        ax.plot(*series, style, **kwargs)


def _label(ax, name: str, xlabel: str, ylabel: str, **legend) -> None:
    """Axis labels, a left title, a legend and a grid."""
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(name, loc="left")
    ax.legend(**legend)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    if xlabel == "epoch":
        ax.xaxis.get_major_locator().set_params(integer=True)


def _draw_loss(ax, run: Run) -> bool:
    """Train loss per step and per epoch, test loss per epoch; x in steps when known."""
    by_step = all(_number(e.get("step")) is not None for e in run.epochs)
    x_key = "step" if by_step else "epoch"
    if by_step:
        _plot(ax, _series(run.steps, "step", "loss"), "-", color="C0", lw=0.8, alpha=0.6,
              label="train loss (logged steps)")
    elif run.steps:
        logger.info("loss.png: epoch records carry no 'step'; plotting loss per epoch only")
    _plot(ax, _series(run.epochs, x_key, "train_loss"), "o-", color="C1",
          label="train loss (per epoch)")
    _plot(ax, _series(run.epochs, x_key, "test_loss"), "s--", color="C2", label="test loss")
    if not ax.lines:
        logger.info("skipping loss.png: no 'loss', 'train_loss' or 'test_loss' values")
        return False
    _label(ax, "loss", "training step" if by_step else "epoch", "loss")
    if by_step and run.epochs:  # top axis: the step at which each epoch ended
        top, shown = ax.twiny(), run.epochs[::max(1, math.ceil(len(run.epochs) / 10))]
        top.set_xlim(ax.get_xlim())
        top.set_xticks([e["step"] for e in shown], [str(e["epoch"]) for e in shown])
        top.set_xlabel("end of epoch", fontsize=9)
    return True


def _draw_accuracy(ax, run: Run) -> bool:
    """Train and test accuracy per epoch, in percent."""
    _plot(ax, _series(run.epochs, "epoch", "train_acc", 100.0), "o-", color="C1", label="train")
    _plot(ax, _series(run.epochs, "epoch", "test_acc", 100.0), "s--", color="C2", label="test")
    if not ax.lines:
        logger.info("skipping accuracy.png: no epoch record has 'train_acc' or 'test_acc'")
        return False
    _label(ax, "accuracy", "epoch", "accuracy (%)")
    return True


def _draw_time(ax, run: Run) -> bool:
    """Stacked bars per epoch: seconds in data, compute, intra, inter, eval."""
    timed = [e for e in run.epochs if isinstance(e.get("time"), dict)]
    phases = [p for p in _PHASES if any(_number(e["time"].get(p)) is not None for e in timed)]
    if not phases:
        logger.info("skipping time_breakdown.png: no epoch record has a 'time' breakdown")
        return False
    xs, bottom = [e["epoch"] for e in timed], [0.0] * len(timed)
    for phase in phases:
        heights = [_number(e["time"].get(phase)) or 0.0 for e in timed]
        ax.bar(xs, heights, bottom=bottom, label=_PHASES[phase])
        bottom = [b + h for b, h in zip(bottom, heights)]
    _label(ax, "time per epoch", "epoch", "seconds (rank 0)",
           loc="upper left", bbox_to_anchor=(1.0, 1.0), title="phase")
    return True


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
        if _title(run.config):
            print(_title(run.config) + "\n")
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
