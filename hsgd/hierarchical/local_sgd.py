"""``HierarchicalLocalSGD``: local steps, parameters averaged in the node, then globally.

Hierarchical local SGD (Lin et al., ICLR 2020, https://arxiv.org/abs/1808.07217):
every rank steps on its own gradients; the parameters are then averaged
within the node when ``t % intra_period == 0`` and over all ranks when
``t % (intra_period * inter_period) == 0``, where ``t`` counts the steps
taken before this one (0, 1, 2, ...). These are the semantics of torch's
``HierarchicalModelAverager``; periods of 1 average all parameters after
every step, which equals synchronous SGD for plain SGD without momentum.

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
"""

from __future__ import annotations

from typing import Optional

from .._core.checks import check_int
from .engine import HierarchicalMode

__all__ = ["HierarchicalLocalSGD"]


class HierarchicalLocalSGD(HierarchicalMode):
    """Wraps ``optimizer``: local steps, with periodic two-level parameter averaging.

    Args:
        optimizer, model, topology, inter_node, compression, broadcast: see
            :class:`~hsgd.hierarchical.engine.HierarchicalMode`.
        intra_period: average inside the node every this many steps.
        inter_period: ... and over all ranks every ``intra_period * inter_period`` steps.
    """

    name = "local"
    bind = "data"
    replicas_differ = True
    balances = True

    def __init__(self, optimizer, model=None, *, named_parameters=None, topology=None, inter_node="leader",
                 compression=None, intra_period=1, inter_period=1, broadcast=True, stall_timeout=None,
                 stall_abort=None, stall_abort_after=None, stall=None):
        self.intra_period, self.inter_period = intra_period, inter_period
        super().__init__(optimizer, model, named_parameters=named_parameters, topology=topology,
                         inter_node=inter_node, compression=compression, broadcast=broadcast,
                         settings={"intra_period": intra_period, "inter_period": inter_period},
                         stall_timeout=stall_timeout, stall_abort=stall_abort,
                         stall_abort_after=stall_abort_after, stall=stall)

    def _check_own(self, intra_period, inter_period) -> None:
        check_int("intra_period", intra_period)
        check_int("inter_period", inter_period)

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
        level = self.averaging_level(self.num_steps)
        if level is None:
            return
        # batch_shares: rank r's parameters count in proportion to its batch
        self.engine.average(level, self._shares.factor(level))
