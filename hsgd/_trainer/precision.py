"""``--amp``: mixed precision in the trainer's step and evaluation.

``bf16`` and ``fp16`` run the forward pass and the loss under ``torch.autocast``
on the run's device; parameters, gradients and the optimizer stay float32.
``fp16`` also scales the loss with a ``torch.amp.GradScaler``, so that small
gradients survive float16 (bfloat16 has float32's range and needs none). In
``--sync sync`` the step averages first and unscales the averages
(``opt.synchronize(); scaler.unscale_(opt)``), so every rank's scaler sees the
same gradients, skips the same steps and keeps the same scale; in the other
modes each rank's scaler works on its own gradients (``scaler.step(opt)``).

On the CPU, before any model is built, :func:`check_amp` tries autocast in a
child process once per host (:func:`hsgd.amp.check_autocast`): where it would
crash (bf16 kernels on a CPU that advertises AMX that its hypervisor does not
enable), every rank raises the same error, which says what to set.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .._core.agree import collective_error
from ..amp import check_autocast
from ..errors import InputValueError

__all__ = ["AMP_DTYPES", "check_amp", "MixedPrecision"]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_amp(amp: str, device: torch.device, comm) -> None:
    """Raise the same error on every rank if autocast to ``--amp``'s dtype fails on ``device``
    (tried in a child process on the CPU; nothing to try elsewhere). Collective."""
    if amp == "none":
        return
    problem = check_autocast(device.type, AMP_DTYPES[amp], comm, off="run without mixed precision (--amp none)")
    if problem:
        raise collective_error(InputValueError, f"--amp {amp}: {problem}")


class MixedPrecision:
    """Autocast and, for ``fp16``, the loss scaler; with ``--amp none`` every method is the
    plain step's (no autocast, ``loss.backward()``, ``opt.step()``)."""

    def __init__(self, amp: str, device: torch.device):
        self.amp = amp
        self.dtype = AMP_DTYPES.get(amp)
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None

    def autocast(self):
        """The context of the forward pass and the loss."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, opt) -> None:
        """Divide the loss scale out of the gradients (after ``opt.synchronize()``: the averages)."""
        if self.scaler is not None:
            self.scaler.unscale_(opt)

    def step(self, opt) -> None:
        """``scaler.step(opt)``, which steps only if the gradients are finite; else ``opt.step()``."""
        if self.scaler is None:
            opt.step()
        else:
            self.scaler.step(opt)

    def update(self) -> None:
        """The scaler's end of a step: a skipped step halves the scale, a run of good ones grows it."""
        if self.scaler is not None:
            self.scaler.update()

    def scale(self) -> Optional[float]:
        return None if self.scaler is None else float(self.scaler.get_scale())

    def state_dict(self) -> Optional[dict]:
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: Optional[dict]) -> None:
        """A checkpoint's scaler state; none saved (a run without ``--amp fp16``): a fresh scaler."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
