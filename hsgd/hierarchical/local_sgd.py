"""``HierarchicalLocalSGD``: local steps, parameters averaged in the node, then globally;
and ``HierarchicalDiLoCo``: the global round as DiLoCo's outer step.

Hierarchical local SGD (Lin et al., ICLR 2020, https://arxiv.org/abs/1808.07217):
every rank steps on its own gradients; the parameters are then averaged
within the node when ``t % intra_period == 0`` and over all ranks when
``t % (intra_period * inter_period) == 0``, where ``t`` counts the steps
taken before this one (0, 1, 2, ...). These are the semantics of torch's
``HierarchicalModelAverager``; periods of 1 average all parameters after
every step, which equals synchronous SGD for plain SGD without momentum.

With ``outer_optimizer`` the global round is DiLoCo's (:mod:`hsgd.hierarchical.outer`):
the pseudo-gradient ``θ_g − mean θ`` is averaged with the two levels (and
compressed across nodes), an outer optimizer steps the global parameters
``θ_g`` with it, and every rank continues from ``θ_g``; the node level every
``intra_period`` steps stays a plain average. ``fragments`` (streaming
DiLoCo) syncs the model in that many pieces at staggered steps, each merged
``fragment_sync_delay`` steps after its sync started (the inter-node sums run
meanwhile) and mixed with the local weights by ``fragment_update_alpha``.
With ``outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0)`` the result is
plain hierarchical local SGD.

The parameters *are* views into this rank's slot of the shared window, so
the optimizer's update writes straight into shared memory. Between global
averagings the ranks' models differ: evaluate and save their average
(``hsgd.replicas.averaged_state_dict``), as the trainer does.

Example::

    >>> opt = HierarchicalLocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model,
    ...                            intra_period=4, inter_period=8)
    >>> for x, y in loader:
    ...     opt.zero_grad()
    ...     loss_fn(model(x), y).backward()
    ...     opt.step()        # local step; averages on steps 0, 4, 8, ... (node) and 0, 32, ... (all)
    >>> opt.close()
    >>> opt = HierarchicalDiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-3), model,
    ...                          intra_period=10, inter_period=50)  # outer SGD, lr 0.7, Nesterov 0.9
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, List, Optional

import torch

from .._core.checks import check_int
from .._engine.named import NamedParameterPairs
from ..compression import Compression
from ..errors import InputTypeError, InputValueError
from ..faults.stall import Stall
from ..inter_node import InterNode
from ..topology import Topology
from .engine import HierarchicalEngine, HierarchicalMode
from .outer import OuterFactory

__all__ = ["HierarchicalLocalSGD", "HierarchicalDiLoCo"]


class HierarchicalLocalSGD(HierarchicalMode):
    """Wraps ``optimizer``: local steps, with periodic two-level parameter averaging.

    Args:
        optimizer, model, topology, inter_node, compression, broadcast: see
            :class:`~hsgd.hierarchical.engine.HierarchicalMode`.
        intra_period: average inside the node every this many steps.
        inter_period: ... and over all ranks every ``intra_period * inter_period`` steps.
        outer_optimizer: ``None`` (plain averaging), or ``factory(params)`` returning a
            ``torch.optim.Optimizer`` that steps the global parameters with the averaged
            pseudo-gradient at each global round (DiLoCo's:
            ``lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)``).
            Called once per fragment.
        fragments: with ``outer_optimizer``, sync the parameters in this many fragments of
            about equal size, at staggered steps (streaming DiLoCo; at most the number of
            trainable parameter tensors).
        fragment_sync_delay: merge a fragment this many steps after its sync started
            (``0 <= delay < intra_period * inter_period``); its inter-node sums run meanwhile.
        fragment_update_alpha: a merged fragment is ``alpha * local + (1 - alpha) * global``.
    """

    name = "local"
    bind = "data"
    replicas_differ = True
    balances = True

    def __init__(self, optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module] = None, *,
                 named_parameters: Optional[NamedParameterPairs] = None, topology: Optional[Topology] = None,
                 inter_node: InterNode = "leader", compression: Optional[Compression] = None,
                 intra_period: int = 1, inter_period: int = 1, outer_optimizer: Optional[OuterFactory] = None,
                 fragments: int = 1, fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0,
                 broadcast: bool = True, stall: Stall = None) -> None:
        self.intra_period, self.inter_period = intra_period, inter_period
        self.outer_optimizer, self.fragments = outer_optimizer, fragments
        self.fragment_sync_delay, self.fragment_update_alpha = fragment_sync_delay, fragment_update_alpha
        outer = None if outer_optimizer is None else \
            f"{getattr(outer_optimizer, '__module__', '')}.{getattr(outer_optimizer, '__qualname__', '?')}"
        super().__init__(optimizer, model, named_parameters=named_parameters, topology=topology,
                         inter_node=inter_node, compression=compression, broadcast=broadcast,
                         settings={"intra_period": intra_period, "inter_period": inter_period,
                                   "outer_optimizer": outer, "fragments": fragments,
                                   "fragment_sync_delay": fragment_sync_delay,
                                   "fragment_update_alpha": fragment_update_alpha},
                         stall=stall)

    def _check_own(self, intra_period: Any, inter_period: Any, outer_optimizer: Any, fragments: Any,
                   fragment_sync_delay: Any, fragment_update_alpha: Any) -> None:
        check_int("intra_period", intra_period)
        check_int("inter_period", inter_period)
        check_int("fragments", fragments)
        check_int("fragment_sync_delay", fragment_sync_delay, minimum=0)
        alpha = fragment_update_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= float(alpha) <= 1:
            raise InputValueError(f"Invalid fragment_update_alpha {alpha!r}; use a number in [0, 1] "
                                  "(0: take the global fragment, 1: keep the local one)")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise InputTypeError(f"outer_optimizer must be a callable params -> torch.optim.Optimizer, got "
                                 f"{type(self.outer_optimizer).__name__}; e.g. lambda p: "
                                 "torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)")
        if self.outer_optimizer is None and (fragments != 1 or fragment_sync_delay or alpha):
            raise InputValueError("fragments, fragment_sync_delay and fragment_update_alpha belong to "
                                  "DiLoCo's outer step: pass outer_optimizer too (or use HierarchicalDiLoCo)")
        period = intra_period * inter_period
        if fragment_sync_delay >= period:
            raise InputValueError(f"fragment_sync_delay={fragment_sync_delay} must be below the global period "
                                  f"intra_period * inter_period = {period}: a fragment merges before it syncs again")

    def _make_engine(self, params: List[torch.nn.Parameter]) -> HierarchicalEngine:
        engine = super()._make_engine(params)
        if self.outer_optimizer is None:
            return engine
        try:
            engine.start_outer(self.outer_optimizer, self.intra_period * self.inter_period, self.fragments,
                               self.fragment_sync_delay, float(self.fragment_update_alpha))
        except BaseException:
            engine.close()
            raise
        return engine

    def averaging_level(self, step: int) -> Optional[str]:
        """``"global"``, ``"node"`` or ``None``: what step ``step`` averages."""
        if step % (self.intra_period * self.inter_period) == 0:
            return "global"
        if step % self.intra_period == 0:
            return "node"
        return None

    def _step(self) -> None:
        self._unscale_local()
        self._optimizer_step()
        step, outer = self.num_steps, self.engine.outer
        level = self.averaging_level(step)
        if outer is not None and level == "global":  # the outer step is the global round
            level = None if outer.overwrites(step) else "node"
        if level is not None:
            # batch_shares: rank r's parameters count in proportion to its batch
            self.engine.average(level, self._shares.factor(level))
        if outer is not None:
            outer.step(step, self._shares.factor("global"))

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state and step count; with ``outer_optimizer`` also
        ``"hsgd_outer"``: the global parameters, the outer optimizers' state and this rank's
        pseudo-gradients in flight."""
        state = super().state_dict()
        if self.engine.outer is not None:
            state["hsgd_outer"] = self.engine.outer.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned: the inner optimizer's state and step count and,
        with ``outer_optimizer``, the outer step's (``"hsgd_outer"``). Raises
        :class:`~hsgd.errors.InputValueError` if the state is from a run with an outer optimizer
        and this one has none, or the other way round."""
        state_dict = dict(state_dict)
        outer = state_dict.pop("hsgd_outer", None)
        engine_outer = self.engine.outer
        if (outer is None) != (engine_outer is None):
            raise InputValueError("the optimizer state is from a run " + ("without" if outer is None else "with")
                                  + " an outer optimizer (DiLoCo); resume with the same mode")
        super().load_state_dict(state_dict)
        if outer is not None and engine_outer is not None:
            engine_outer.load_state_dict(outer)


class HierarchicalDiLoCo(HierarchicalLocalSGD):
    """:class:`HierarchicalLocalSGD` with DiLoCo's outer step: SGD on the global parameters
    with learning rate ``outer_lr``, momentum ``outer_momentum`` and Nesterov
    (``outer_nesterov``); the defaults are DiLoCo's (0.7, 0.9, Nesterov). The other
    arguments are :class:`HierarchicalLocalSGD`'s."""

    name = "diloco"

    def __init__(self, optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module] = None, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_nesterov: bool = True,
                 **kwargs: Any) -> None:
        self.outer_lr, self.outer_momentum, self.outer_nesterov = outer_lr, outer_momentum, outer_nesterov
        self._given_outer = kwargs.pop("outer_optimizer", None) is not None  # refused in _check_own, agreed
        super().__init__(optimizer, model, outer_optimizer=self._outer_sgd, **kwargs)

    def _outer_sgd(self, params: List[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum,
                               nesterov=self.outer_nesterov)

    def _check_own(self, *args: Any, **settings: Any) -> None:
        lr, momentum, nesterov = self.outer_lr, self.outer_momentum, self.outer_nesterov
        if self._given_outer:
            raise InputTypeError("HierarchicalDiLoCo builds its outer SGD from outer_lr, outer_momentum and "
                                 "outer_nesterov; for another outer optimizer use "
                                 "HierarchicalLocalSGD(outer_optimizer=...)")
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not float(lr) > 0:
            raise InputValueError(f"Invalid outer_lr {lr!r}; use a positive number (DiLoCo: 0.7)")
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= float(momentum) < 1:
            raise InputValueError(f"Invalid outer_momentum {momentum!r}; use a number in [0, 1) (DiLoCo: 0.9)")
        if not isinstance(nesterov, bool):
            raise InputTypeError(f"outer_nesterov must be True or False, got {nesterov!r}")
        if nesterov and momentum == 0:
            raise InputValueError("outer_nesterov needs outer_momentum > 0; pass outer_nesterov=False for "
                                  "plain outer SGD")
        super()._check_own(**settings)
