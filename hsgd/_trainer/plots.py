"""The drawing half of :mod:`hsgd.report`: one matplotlib figure per plot, no pyplot.

Each ``draw_*`` function draws one plot of a :class:`~hsgd.report.Run` on an
axis and returns False when the run lacks the data for it (logged, skipped).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

__all__ = ["new_figure", "title", "draw_loss", "draw_accuracy", "draw_time", "as_number"]

logger = logging.getLogger("hsgd.report")

_PHASES = {"data": "data", "compute": "compute", "intra": "intra-node",
           "inter": "inter-node", "eval": "eval"}


def as_number(value) -> Optional[float]:
    """``value`` as a float when it is a JSON number, else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


def comm_share(time) -> Optional[float]:
    """Percent of a record's ``time`` (data + compute + intra + inter) spent in intra + inter;
    ``None`` when a value is not a number or nothing took time. A phase missing from the record
    took no time (a run on one node has no ``inter``)."""
    if not isinstance(time, dict):
        return None
    parts = {key: as_number(time.get(key, 0.0)) for key in ("data", "compute", "intra", "inter")}
    known = {key: value for key, value in parts.items() if value is not None}
    if len(known) < len(parts) or sum(known.values()) <= 0:
        return None
    return 100.0 * (known["intra"] + known["inter"]) / sum(known.values())


def new_figure():
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


def title(config: dict) -> str:
    """``model, optimizer, N ranks, batch B`` from whatever the config has."""
    parts = (("model", "{}"), ("optimizer", "{}"), ("world_size", "{} ranks"),
             ("batch_size", "batch {}"))
    return ", ".join(form.format(config[key]) for key, form in parts if key in config)


def _series(records: list, x_key: str, y_key: str, scale: float = 1.0):
    """(xs, ys) over the records where both keys hold numbers."""
    pairs = [(as_number(r.get(x_key)), as_number(r.get(y_key))) for r in records]
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


def draw_loss(ax, run) -> bool:
    """Train loss per step and per epoch, test loss per epoch; x in steps when known."""
    by_step = all(as_number(e.get("step")) is not None for e in run.epochs)
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


def draw_accuracy(ax, run) -> bool:
    """Train and test accuracy per epoch, in percent."""
    _plot(ax, _series(run.epochs, "epoch", "train_acc", 100.0), "o-", color="C1", label="train")
    _plot(ax, _series(run.epochs, "epoch", "test_acc", 100.0), "s--", color="C2", label="test")
    if not ax.lines:
        logger.info("skipping accuracy.png: no epoch record has 'train_acc' or 'test_acc'")
        return False
    _label(ax, "accuracy", "epoch", "accuracy (%)")
    return True


def draw_time(ax, run) -> bool:
    """Stacked bars per epoch: seconds in data, compute, intra, inter, eval."""
    timed = [e for e in run.epochs if isinstance(e.get("time"), dict)]
    phases = [p for p in _PHASES if any(as_number(e["time"].get(p)) is not None for e in timed)]
    if not phases:
        logger.info("skipping time_breakdown.png: no epoch record has a 'time' breakdown")
        return False
    xs, bottom = [e["epoch"] for e in timed], [0.0] * len(timed)
    for phase in phases:
        heights = [as_number(e["time"].get(phase)) or 0.0 for e in timed]
        ax.bar(xs, heights, bottom=bottom, label=_PHASES[phase])
        bottom = [b + h for b, h in zip(bottom, heights)]
    _label(ax, "time per epoch", "epoch", "seconds (rank 0)",
           loc="upper left", bbox_to_anchor=(1.0, 1.0), title="phase")
    return True
