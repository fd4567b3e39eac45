"""What rank 0 shows while training: a tqdm bar on a terminal, else epoch lines."""

from __future__ import annotations

import logging
import sys
from collections import Counter

from .hooks import Hook
from .plots import comm_share

__all__ = ["Progress"]

logger = logging.getLogger("hsgd.train")


class Progress(Hook):
    """``mode``: auto (bar if stderr is a terminal), bar, lines or none; rank 0 only."""

    def __init__(self, mode: str, enabled: bool, steps_per_epoch: int):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if enabled else "none"
        self.steps_per_epoch = steps_per_epoch
        self.bar = None

    def epoch_start(self, epoch: int, position: int) -> None:
        if self.mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=self.steps_per_epoch, initial=position, desc=f"epoch {epoch}",
                            leave=False, dynamic_ncols=True)

    def logged(self, record: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.0f}",
                                 comm=f"{comm_share(record['time']) or 0.0:.0f}%", refresh=False)

    def step_end(self, step: int, run_steps: int) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def epoch_end(self, record: dict, times: Counter, steps: int) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.mode != "none":
            bpb = f"bpb {record['test_bpb']:.3f}  " if "test_bpb" in record else ""  # language modelling
            logger.info("epoch %3d  train loss %.4f acc %5.2f%%  test loss %.4f acc %5.2f%%  %s"
                        "lr %.3g  %.0f samples/s  comm %.0f%%  %.1f s",
                        record["epoch"], record["train_loss"], 100 * record["train_acc"],
                        record["test_loss"], 100 * record["test_acc"], bpb, record["lr"],
                        record["samples_per_s"], comm_share(record["time"]) or 0.0, record["seconds"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
