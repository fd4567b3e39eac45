"""A model for ``--model recording_model:build`` (with this directory on ``PYTHONPATH``) that
writes down which samples each training step gave this rank, and takes its time.

The data's first feature is the sample's index; the model sees the others. Every forward
pass in training mode (one per step) appends the batch's indices as one line to
``$HSGD_SAMPLES_DIR/<pid>.txt``, whose first line is ``rank world_size wall_time``, then
sleeps ``$HSGD_STEP_SLEEP`` seconds, so that a test can act between steps.
"""

import os
import time

import torch
from torch import nn


class Recording(nn.Module):
    def __init__(self, features: int, classes: int):
        super().__init__()
        self.linear = nn.Linear(features - 1, classes)
        self.path = None

    def forward(self, x):
        if self.training and os.environ.get("HSGD_SAMPLES_DIR"):
            self._record(x[:, 0])
            time.sleep(float(os.environ.get("HSGD_STEP_SLEEP", "0")))
        return self.linear(x[:, 1:])

    def _record(self, index: torch.Tensor) -> None:
        if self.path is None:
            from mpi4py import MPI

            self.path = os.path.join(os.environ["HSGD_SAMPLES_DIR"], f"{os.getpid()}.txt")
            with open(self.path, "w") as f:
                f.write(f"{MPI.COMM_WORLD.Get_rank()} {MPI.COMM_WORLD.Get_size()} {time.time()}\n")
        with open(self.path, "a") as f:
            f.write(",".join(str(int(i)) for i in index.tolist()) + "\n")


def build(sample_shape, num_classes):
    return Recording(int(sample_shape[0]), num_classes)
