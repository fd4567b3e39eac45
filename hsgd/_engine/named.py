"""A stand-in model for callers who have only ``(name, parameter)`` pairs.

Horovod's ``DistributedOptimizer(optimizer, named_parameters=...)`` takes the
parameters, not the model. The modes need a model for three things: its
parameters (to bind and average), their names (checkpoints, messages) and a
state dict (to compare, broadcast and average). :class:`NamedParameters`
provides those for a list of pairs; the parameters keep their real names
(dots included) and nothing is copied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, List, Tuple

import torch

from .._core.agree import check_all
from ..errors import InputTypeError, InputValueError

__all__ = ["NamedParameters", "NamedParameterPairs", "model_of"]

#: What a mode's ``named_parameters`` takes: ``model.named_parameters()`` or the like.
NamedParameterPairs = Iterable[Tuple[str, torch.Tensor]]


class NamedParameters(torch.nn.Module):
    """A module whose parameters are the given ``(name, parameter)`` pairs, and no buffers."""

    _pairs: List[Tuple[str, torch.nn.Parameter]]

    def __init__(self, pairs: List[Tuple[str, torch.nn.Parameter]]):
        super().__init__()
        object.__setattr__(self, "_pairs", list(pairs))  # not registered: names may hold dots

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from ((prefix + name, p) for name, p in self._pairs)

    def parameters(self, recurse: bool = True):
        yield from (p for _, p in self._pairs)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        out = OrderedDict() if destination is None else destination
        for name, p in self._pairs:
            out[prefix + name] = p if keep_vars else p.detach()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing = [name for name, _ in self._pairs if name not in state_dict]
        if strict and missing:
            raise KeyError(f"state dict lacks {missing}")
        with torch.no_grad():
            for name, p in self._pairs:
                if name in state_dict:
                    p.copy_(state_dict[name])

    def extra_repr(self) -> str:
        return f"{len(self._pairs)} parameters"


def _pairs(named_parameters: Iterable) -> List[Tuple[str, torch.nn.Parameter]]:
    if isinstance(named_parameters, (torch.Tensor, str, dict)) or not hasattr(named_parameters, "__iter__"):
        raise InputTypeError(f"named_parameters must be (name, parameter) pairs such as "
                             f"model.named_parameters(), got {type(named_parameters).__name__}")
    pairs, seen = [], set()
    for item in named_parameters:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise InputTypeError(f"named_parameters must yield (name, parameter) pairs, got {item!r:.60}")
        name, p = item
        if name in seen:
            raise InputValueError(f"named_parameters names {name!r} twice; names must be unique")
        seen.add(name)
        pairs.append((name, p))
    return pairs


def _resolve(optimizer, model, named_parameters):
    if model is not None and named_parameters is not None:
        raise InputValueError("pass the model or named_parameters, not both")
    if model is not None:
        return model
    if named_parameters is not None:
        return NamedParameters(_pairs(named_parameters))
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None  # reported by the mode's checks
    # Horovod's fallback: the optimizer's own parameters, named by their place in its groups
    return NamedParameters([(f"param_groups.{g}.{i}", p) for g, group in enumerate(optimizer.param_groups)
                            for i, p in enumerate(group["params"])])


def model_of(optimizer, model, named_parameters, comm) -> torch.nn.Module:
    """The model a mode works on: ``model``, or a :class:`NamedParameters` over
    ``named_parameters`` or else the optimizer's parameters. Collective: a bad argument
    raises the same error on every rank."""
    return check_all(comm, _resolve, optimizer, model, named_parameters)
