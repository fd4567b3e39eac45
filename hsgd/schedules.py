"""Learning-rate schedules for large-batch training: warm-up then poly or step decay.

Both schedulers are ``torch.optim.lr_scheduler.LRScheduler`` subclasses and work with
any torch optimizer (including :class:`hsgd.lars.LARS`), with ``state_dict()`` /
``load_state_dict()`` and ``last_epoch`` resumption. The rate is a closed form of the
step index :math:`t`, the number of ``scheduler.step()`` calls so far (0 right after
construction); ``warmup_steps``, ``total_steps`` and ``milestones`` count whatever one
``step()`` stands for (an optimizer step, or an epoch). The formulas are in the class
docstrings; :func:`scaled_lr` is the linear scaling rule (Goyal et al. 2017). Example::

    >>> opt = LARS(model.parameters(), lr=scaled_lr(0.1, global_batch=8192))
    >>> sched = WarmupPolyLR(opt, total_steps=90 * steps_per_epoch,
    ...                      warmup_steps=5 * steps_per_epoch)
    >>> for batch in loader:
    ...     train_step(batch); opt.step(); sched.step()
"""

from __future__ import annotations

import operator
import warnings
from typing import List, Sequence, Union

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from .errors import InputValueError

__all__ = ["WarmupPolyLR", "WarmupMultiStepLR", "scaled_lr"]


def _as_int(name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, else a ValueError naming it."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise InputValueError(f"Invalid {name}: {value!r}; use an integer >= {minimum}") from None
    if number < minimum:
        raise InputValueError(f"Invalid {name}: {number}; use an integer >= {minimum}")
    return number


def _check_start_factor(warmup_start_factor: float) -> float:
    if not 0.0 <= warmup_start_factor <= 1.0:
        raise InputValueError(f"Invalid warmup_start_factor: {warmup_start_factor}; use a "
                              "value in [0, 1] (warm-up starts at lr * warmup_start_factor)")
    return float(warmup_start_factor)


class _WarmupLR(LRScheduler):
    """Linear warm-up then ``_decayed(base_lr, t)``, as a closed form of t."""

    warmup_steps: int
    warmup_start_factor: float

    def get_lr(self) -> List[Union[float, Tensor]]:
        """The learning rate of each parameter group at step ``last_epoch`` (a closed form of the
        step: warm-up, then the schedule's decay of the group's initial rate)."""
        # A closed form of last_epoch: step(epoch) and SequentialLR land on the
        # right rate; rates set by other schedulers (ChainedScheduler) are overwritten.
        return [self._lr_at(base_lr, self.last_epoch) for base_lr in self.base_lrs]

    def _lr_at(self, base_lr: Union[float, Tensor], t: int) -> Union[float, Tensor]:
        if t < self.warmup_steps:
            f0 = self.warmup_start_factor
            return base_lr * (f0 + (1.0 - f0) * t / self.warmup_steps)
        return self._decayed(base_lr, t)

    def _decayed(self, base_lr: Union[float, Tensor], t: int) -> Union[float, Tensor]:
        raise NotImplementedError


class WarmupPolyLR(_WarmupLR):
    r"""Linear warm-up over ``warmup_steps``, then polynomial decay to ``end_lr``.

    :math:`\gamma_t = \gamma_0 (f_0 + (1 - f_0) t / W)` for :math:`t < W`;
    :math:`\gamma_t = e + (\gamma_0 - e)(1 - (t - W)/(T - W))^p` for
    :math:`W \le t \le T`; :math:`e` after :math:`T`. So: step 0 has
    :math:`\gamma_0 f_0` (:math:`\gamma_0` without warm-up), step :math:`W`
    exactly :math:`\gamma_0`, step :math:`T` (after ``total_steps`` calls to
    ``step()``) exactly ``end_lr``; the last of :math:`T` optimizer steps,
    :math:`t = T - 1`, runs at :math:`e + (\gamma_0 - e) / (T - W)^p`.
    With ``warmup_steps=0, power=2, end_lr=0`` this is the LARS paper's
    :math:`\gamma_0 (1 - t/T)^2`. ``end_lr`` is absolute, the same for every
    parameter group.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: :math:`T`, > ``warmup_steps``.
        warmup_steps: :math:`W` >= 0.
        power: :math:`p` > 0 (1 is linear decay).
        end_lr: :math:`e` >= 0.
        warmup_start_factor: :math:`f_0` in [0, 1].
        last_epoch: as in torch; -1 starts a new schedule.
    """

    def __init__(self, optimizer: Optimizer, total_steps: int, warmup_steps: int = 0,
                 power: float = 2.0, end_lr: float = 0.0,
                 warmup_start_factor: float = 0.0, last_epoch: int = -1) -> None:
        self.total_steps = _as_int("total_steps", total_steps, 1)
        self.warmup_steps = _as_int("warmup_steps", warmup_steps, 0)
        if self.warmup_steps >= self.total_steps:
            raise InputValueError(f"Invalid warmup_steps: {warmup_steps} is not shorter than "
                                  f"total_steps={total_steps}; shorten the warm-up or train longer")
        if not power > 0:
            raise InputValueError(f"Invalid power: {power}; use power > 0 (2 in the LARS paper)")
        if not end_lr >= 0:
            raise InputValueError(f"Invalid end_lr: {end_lr}; use end_lr >= 0")
        self.power, self.end_lr = float(power), float(end_lr)
        self.warmup_start_factor = _check_start_factor(warmup_start_factor)
        super().__init__(optimizer, last_epoch)
        if any(end_lr > base_lr for base_lr in self.base_lrs):
            warnings.warn(f"end_lr={end_lr} exceeds a group's lr {self.base_lrs}: "
                          "the 'decay' will raise that group's rate", stacklevel=2)

    def _decayed(self, base_lr: Union[float, Tensor], t: int) -> Union[float, Tensor]:
        remaining = max(0.0, 1.0 - (t - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.end_lr + (base_lr - self.end_lr) * remaining ** self.power


class WarmupMultiStepLR(_WarmupLR):
    r"""Linear warm-up over ``warmup_steps``, then decay by ``gamma`` at milestones.

    :math:`\gamma_t = \gamma_0 (f_0 + (1 - f_0) t / W)` for :math:`t < W`, and
    :math:`\gamma_0 \, g^{k}` for :math:`t \ge W`, where :math:`k` is the number
    of milestones :math:`\le t`. So step 0 has :math:`\gamma_0 f_0`
    (:math:`\gamma_0` without warm-up), step :math:`W` exactly :math:`\gamma_0`
    (unless a milestone equals :math:`W`), and from milestone :math:`M_i` on
    the rate is :math:`\gamma_0 g^i`. Goyal et al.: 5 epochs of warm-up from
    :math:`\gamma_0 / k`, ``milestones`` at epochs 30, 60, 80, ``gamma=0.1``.

    Args:
        optimizer: the wrapped optimizer.
        milestones: strictly increasing step indices, each >= ``warmup_steps``.
        gamma: decay factor :math:`g` > 0.
        warmup_steps: :math:`W` >= 0.
        warmup_start_factor: :math:`f_0` in [0, 1].
        last_epoch: as in torch; -1 starts a new schedule.
    """

    def __init__(self, optimizer: Optimizer, milestones: Sequence[int], gamma: float = 0.1,
                 warmup_steps: int = 0, warmup_start_factor: float = 0.0,
                 last_epoch: int = -1) -> None:
        self.warmup_steps = _as_int("warmup_steps", warmup_steps, 0)
        self.milestones = [_as_int("milestone", m, 1) for m in milestones]
        for before, after in zip(self.milestones, self.milestones[1:]):
            if after <= before:
                raise InputValueError(f"Invalid milestones: {list(milestones)} are not strictly "
                                      "increasing; sort them and drop duplicates")
        if self.milestones and self.milestones[0] < self.warmup_steps:
            raise InputValueError(f"Invalid milestones: {self.milestones[0]} falls inside the "
                                  f"warm-up (warmup_steps={warmup_steps}); move the milestone "
                                  "to >= warmup_steps or shorten the warm-up")
        if not gamma > 0:
            raise InputValueError(f"Invalid gamma: {gamma}; use 0 < gamma < 1 (e.g. 0.1)")
        if gamma >= 1:
            warnings.warn(f"gamma={gamma} >= 1: the rate does not decay at the milestones",
                          stacklevel=2)
        self.gamma = float(gamma)
        self.warmup_start_factor = _check_start_factor(warmup_start_factor)
        super().__init__(optimizer, last_epoch)

    def _decayed(self, base_lr: Union[float, Tensor], t: int) -> Union[float, Tensor]:
        passed = sum(1 for m in self.milestones if m <= t)
        return base_lr * self.gamma ** passed


def scaled_lr(base_lr: float, global_batch: int, base_batch: int = 256) -> float:
    r"""The linear scaling rule: ``base_lr * global_batch / base_batch``.

    Goyal et al. 2017: "when the minibatch size is multiplied by k, multiply
    the learning rate by k", with ``base_lr = 0.1`` for ``base_batch = 256``.
    ``global_batch`` is the batch summed over all ranks.

    Example::

        >>> scaled_lr(0.1, global_batch=8192)
        3.2
    """
    if not base_lr >= 0:
        raise InputValueError(f"Invalid base_lr: {base_lr}; use base_lr >= 0")
    global_batch = _as_int("global_batch", global_batch, 1)
    base_batch = _as_int("base_batch", base_batch, 1)
    return base_lr * global_batch / base_batch
