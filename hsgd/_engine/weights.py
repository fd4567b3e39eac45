"""One place for a step's weighting: what a rank's values count for in an average.

An average over ranks of what each rank wrote is ``sum(w_r v_r) / n`` with

    w_r = batch share x AMP inverse scale

and the averager then divides by ``passes`` (gradient accumulation) and by the
number of ranks averaged, ``n``. The batch share (load balancing,
:class:`~hsgd.LoadBalancer`) is ``b_r n / sum(b)`` over the ranks of the average,
so that a gradient average is ``sum(b_r g_r) / sum(b)``: exactly the global
batch's gradient when each ``g_r`` is the mean over the rank's own batch. The
inverse scale is ``1 / grad_scale`` under ``GradScaler.step()``, else 1.
:meth:`~hsgd._engine.mode.SyncMode.step_weight` is the one place that multiplies
them; the plain and the overlap paths both take it from there.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .._core.checks import check_shares

__all__ = ["BatchShares"]


class BatchShares:
    """Per-rank batch sizes and this rank's factor at each level (1 without shares)."""

    def __init__(self, topology):
        self.topology = topology
        self.shares: Optional[List[int]] = None
        self._factors: Dict[str, float] = {}

    def set(self, shares: Optional[Sequence[int]]) -> None:
        """Set the same list on every rank (no communication); ``None``: equal."""
        if shares is None:
            self.shares, self._factors = None, {}
            return
        check_shares(shares, self.topology.size)
        node = [shares[r] for r in self.topology.node_ranks]
        mine = shares[self.topology.rank]
        self.shares = [int(b) for b in shares]
        self._factors = {"global": mine * len(shares) / sum(shares), "node": mine * len(node) / sum(node)}

    def factor(self, level: str) -> float:
        """This rank's factor in a ``level`` (``"global"`` or ``"node"``) average."""
        return self._factors.get(level, 1.0)
