"""``InnerOptimizer``: a ``torch.optim.Optimizer`` whose groups, state and defaults are another's.

A mode wraps the user's optimizer by composition, yet torch's LR schedulers,
``GradScaler`` and optimizer hooks must take the mode itself. This class is
that surface: ``param_groups``, ``state`` and ``defaults`` are the inner
optimizer's own objects (an LR set through either is seen by both), and the
state-dict hooks registered on the wrapper run around the inner state dict,
which carries the step count as ``"hsgd_steps"``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Sequence

import torch

from ..errors import InputValueError
from .torch_compat import init_optimizer_hooks, load_state_dict_with_hooks, state_dict_with_hooks

__all__ = ["InnerOptimizer", "mean_of_states"]


class InnerOptimizer(torch.optim.Optimizer):
    """The optimizer surface over ``self.optimizer``; the subclass sets ``optimizer`` and ``num_steps``."""

    optimizer: torch.optim.Optimizer
    num_steps: int

    def _init_optimizer_hooks(self) -> None:
        """What ``torch.optim.Optimizer.__init__`` sets up for hooks (that one would also
        copy the parameter groups: ours are the inner optimizer's)."""
        init_optimizer_hooks(self)  # step() runs the step pre- and post-hooks

    # torch declares these three as plain attributes; here they are read-only views of the
    # inner optimizer's own objects, which is what the override error flags.
    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's list itself, so an LR set through either is seen by both."""
        return self.optimizer.param_groups

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:  # type: ignore[override]
        """The inner optimizer's per-parameter state (the same dict, not a copy)."""
        return self.optimizer.state

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's default hyperparameters (the same dict, not a copy)."""
        return self.optimizer.defaults

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Not supported: raises :class:`~hsgd.errors.InputValueError` (the parameters are
        bound at construction; add the group to the inner optimizer before wrapping it)."""
        raise InputValueError(f"{type(self).__name__} binds its parameters at construction; add the "
                              "group to the inner optimizer before wrapping it")

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state dict, plus ``"hsgd_steps"`` (the step count).
        Runs the state-dict hooks registered on this optimizer."""
        return state_dict_with_hooks(self, self._inner_state_dict)

    def _inner_state_dict(self) -> Dict[str, Any]:
        state = self.optimizer.state_dict()
        state["hsgd_steps"] = self.num_steps
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` into the inner optimizer and restore the
        step count (``"hsgd_steps"``, 0 if absent). Runs the load-state-dict hooks registered
        on this optimizer."""
        load_state_dict_with_hooks(self, state_dict, self._load_inner_state_dict)

    def _load_inner_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.num_steps = int(state_dict.pop("hsgd_steps", 0))
        self.optimizer.load_state_dict(state_dict)

    def merge_state_dicts(self, states: Sequence[Dict[str, Any]], world_size: int) -> Dict[str, Any]:
        """The state each rank of a ``world_size``-rank run loads, made from every rank's
        :meth:`state_dict` of a run at another rank count (a resume on more or fewer ranks):
        floating-point tensors and numbers averaged over the old ranks, everything else rank
        0's. A mode whose state is not a mean overrides this."""
        return mean_of_states(list(states))


def mean_of_states(values: List[Any]) -> Any:
    """The element-wise mean of structurally equal nested dicts, lists and tuples: floating-point
    tensors (in float64, then their own dtype) and floats averaged; the rest the first's."""
    first = values[0]
    if isinstance(first, dict):
        return {key: mean_of_states([v[key] for v in values]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(mean_of_states(list(column)) for column in zip(*values))
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        total = sum(v.detach().to(torch.float64) for v in values)
        return (total / len(values)).to(first.dtype)
    if isinstance(first, float):
        return sum(values) / len(values)
    return first
